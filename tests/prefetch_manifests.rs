//! The shipped manifests' prefetch parts: the DaemonSet's prefetch container (its own memory
//! limit, no capabilities, pod requests off by default) and the example Job (its annotation
//! names the directory the trainer reads, and an initContainer waits for the dataset). YAML is
//! read with PyYAML (installed with moto by `scripts/deps/prefetch.sh`).

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use spotguard::prefetch::policy::{annotation_entries, AllowPattern, AnnotationPolicy};

fn load(file: &str) -> Vec<Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(file);
    let out = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))",
        ])
        .arg(&path)
        .output()
        .expect("python3 (with PyYAML: scripts/deps/prefetch.sh)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn env<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str())
}

#[test]
fn the_prefetcher_is_its_own_container_with_its_own_memory_and_no_capabilities() {
    let docs = load("daemonset/daemonset.yaml");
    let ds = docs.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
    let pod = &ds["spec"]["template"]["spec"];
    let containers = pod["containers"].as_array().unwrap();
    let agent = containers
        .iter()
        .find(|c| c["name"] == "spotguard")
        .unwrap();
    let prefetch = containers.iter().find(|c| c["name"] == "prefetch").unwrap();
    assert_eq!(prefetch["args"][0], "prefetch-serve");
    // The agent runs no prefetch (no datasets configured there).
    assert!(env(agent, "SPOTGUARD_PREFETCH").is_none());
    // Own memory limit, apart from the agent's 192 MiB (staged checkpoint uploads).
    let limit = prefetch["resources"]["limits"]["memory"].as_str().unwrap();
    assert_ne!(limit, "192Mi");
    assert_eq!(agent["resources"]["limits"]["memory"], "192Mi");
    // No capabilities at all; read-only root filesystem.
    let sc = &prefetch["securityContext"];
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert!(sc["capabilities"]["add"].is_null());
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    // Pod requests are off unless the operator turns them on.
    assert_eq!(
        env(prefetch, "SPOTGUARD_PREFETCH_ANNOTATIONS"),
        Some("false")
    );
    assert!(env(prefetch, "SPOTGUARD_PREFETCH_ALLOW").is_none());
    // Both share the cache (the stop file and the claim protocol).
    for c in [agent, prefetch] {
        let mounts = c["volumeMounts"].as_array().unwrap();
        assert!(
            mounts
                .iter()
                .any(|m| m["name"] == "cache" && m["mountPath"] == "/var/cache/spotguard"),
            "{}",
            c["name"]
        );
    }
}

#[test]
fn the_example_job_reads_the_dataset_its_annotation_names_and_waits_for_it() {
    let docs = load("daemonset/examples/training-job.yaml");
    let job = docs.iter().find(|d| d["kind"] == "Job").unwrap();
    let template = &job["spec"]["template"];
    let annotation = template["metadata"]["annotations"]["spotguard.io/prefetch"]
        .as_str()
        .unwrap();
    let entries: Vec<&str> = annotation_entries(annotation).collect();
    assert_eq!(entries.len(), 1);
    // Accepted by an operator allow-list covering the example bucket's prefix.
    let policy = AnnotationPolicy {
        enabled: true,
        allow: vec![AllowPattern::parse("s3://example-datasets/tokenized").unwrap()],
    };
    let namespace = job["metadata"]["namespace"].as_str().unwrap_or("default");
    let (name, url) = policy.check(entries[0], namespace).unwrap();

    let spec = &template["spec"];
    let cache_volume = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["hostPath"]["path"] == "/var/cache/spotguard")
        .unwrap()["name"]
        .clone();
    let mount_of = |c: &Value| -> String {
        c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == cache_volume)
            .unwrap()["mountPath"]
            .as_str()
            .unwrap()
            .to_string()
    };
    // The trainer reads <mount>/<name>.
    let trainer = spec["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "trainer")
        .unwrap();
    let data_dir = format!("{}/{name}", mount_of(trainer));
    let args: Vec<&str> = trainer["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert!(args.contains(&data_dir.as_str()), "{args:?} vs {data_dir}");

    // The initContainer waits for that dataset from that source under the same mount.
    let init = &spec["initContainers"][0];
    let wait: Vec<&str> = init["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    let after = |flag: &str| wait.iter().position(|a| *a == flag).map(|i| wait[i + 1]);
    assert_eq!(wait[0], "prefetch");
    assert_eq!(after("--wait"), Some(name.as_str()));
    assert_eq!(after("--source"), Some(url.as_str()));
    assert_eq!(wait.last().copied(), Some(mount_of(init).as_str()));
}
