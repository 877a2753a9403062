//! `spotguard goodput --namespace NS --job NAME` over a Job's goodput ledger of 1 000 and then
//! 10 000 records (`Interruption` objects: 2 000 interruptions of 3 pods each and 2 recoveries
//! each, at full size), against the real API server (testkit's control plane): the built binary,
//! as an operator runs it, with the admin's kubeconfig. Reports the wall time (median of the
//! runs) and the report process's peak RSS (`wait4`'s `ru_maxrss`) at each size; the report
//! pages through the records 500 a request and keeps only the Job's.
//!
//! The goal (docs/goodput.md): 10 000 records in under 5 s. Exits non-zero past it.
//!
//! Run: `cargo bench --bench goodput_ledger` (env `GOODPUT_BENCH_RUNS`, default 3).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Api, DynamicObject, PostParams};
use spotguard::goodput::event::{EventRecord, Recovery};
use spotguard::goodput::record::{Interruption, TargetBadput};
use spotguard::node::kube::ledger::{
    api_resource, object, spec_for, RecordOwner, DEFAULT_RECORD_TTL,
};
use spotguard::node::PodRef;
use spotguard_testkit::k8s::TestCluster;

const PER_NOTICE_TARGETS: usize = 3;
const PER_NOTICE_RECOVERIES: usize = 2;
const LIMIT: Duration = Duration::from_secs(5);

fn at(s: i64) -> Timestamp {
    Timestamp::from_second(1_700_000_000 + s).unwrap()
}

/// The records of interruption `n`: a badput record per target and the recoveries.
fn records(n: usize, node: &str, ns: &str) -> Vec<(String, EventRecord)> {
    let notice = format!("aws-{n:06}-i-0123456789abcdef0");
    let mut out = Vec::new();
    for t in 0..PER_NOTICE_TARGETS {
        let pod = format!("llm-finetune-{n}-{t}-x7k2p");
        out.push((
            pod.clone(),
            EventRecord::Badput(Interruption {
                notice_id: notice.clone(),
                node: node.into(),
                kind: "spot-interruption".into(),
                source: "aws".into(),
                seen_at: Some(at(n as i64 * 600)),
                signalled_at: Some(at(n as i64 * 600)),
                deadline: Some(at(n as i64 * 600 + 120)),
                drained_at: Some(at(n as i64 * 600 + 30)),
                done_at: at(n as i64 * 600 + 30),
                targets: vec![TargetBadput {
                    target: format!("{ns}/{pod}"),
                    outcome: "acked".into(),
                    step: Some(1200),
                    save_seconds: Some(12.5),
                    downtime_seconds: Some(12.7),
                    wasted_steps: Some(0),
                    wasted_seconds: Some(0.0),
                    ..TargetBadput::default()
                }],
                ..Interruption::default()
            }),
        ));
    }
    for r in 0..PER_NOTICE_RECOVERIES {
        let pod = format!("llm-finetune-{n}-{r}-resumed");
        out.push((
            pod.clone(),
            EventRecord::Recovery(Recovery {
                notice_id: notice.clone(),
                from_node: Some("spot-a".into()),
                node: node.into(),
                target: format!("{ns}/{pod}"),
                step: 1200,
                saved_at: at(n as i64 * 600 + 20),
                first_step_at: at(n as i64 * 600 + 80),
                recovery_seconds: 60.0,
                restore_seconds: Some(4.0),
            }),
        ));
    }
    out
}

/// Create interruptions `from..to`'s records, owned by `job`, 32 at a time.
async fn fill(k: &TestCluster, ns: &str, job: &ObjectReference, from: usize, to: usize) {
    let api: Api<DynamicObject> = Api::namespaced_with(k.admin(), ns, &api_resource());
    let node = "spot-bench-node";
    let objs: Vec<DynamicObject> = (from..to)
        .flat_map(|n| records(n, node, ns))
        .map(|(pod, r)| {
            let pod = PodRef {
                namespace: ns.into(),
                name: pod,
                uid: String::new(),
            };
            let spec = spec_for(&r.to_annotation(), node, &pod).expect("a record of the ledger");
            object(
                spec,
                ns,
                Some(&RecordOwner::controller(job)),
                Timestamp::now(),
                DEFAULT_RECORD_TTL,
            )
        })
        .collect();
    futures::stream::iter(objs)
        .map(|o| {
            let api = api.clone();
            async move { api.create(&PostParams::default(), &o).await.map(drop) }
        })
        .buffer_unordered(32)
        .for_each(|r| async move { r.expect("creating a record") })
        .await;
}

struct Sample {
    wall: Duration,
    max_rss_kib: i64,
    rows: usize,
}

/// One `spotguard goodput --json` run: its wall time, peak RSS (`wait4`'s, of that process
/// alone) and rows.
// The child is reaped by `wait4` (for its rusage), which clippy does not see.
#[allow(clippy::zombie_processes)]
fn report(k: &TestCluster, ns: &str) -> Sample {
    use std::io::Read;
    let started = Instant::now();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_spotguard"))
        .args(["goodput", "--namespace", ns, "--job", "bench", "--json"])
        .arg("--kubeconfig")
        .arg(&k.cp.admin_kubeconfig)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("running spotguard goodput");
    let mut stdout = Vec::new();
    child
        .stdout
        .take()
        .expect("piped stdout")
        .read_to_end(&mut stdout)
        .expect("reading the report");
    let pid = child.id() as libc::pid_t;
    // SAFETY: wait4 on our own child, filling the status and rusage it is given; the child is
    // reaped here (std's handle is then dropped without waiting).
    let (status, max_rss_kib) = unsafe {
        let mut status = 0;
        let mut ru: libc::rusage = std::mem::zeroed();
        let r = libc::wait4(pid, &mut status, 0, &mut ru);
        assert_eq!(r, pid, "wait4: {}", std::io::Error::last_os_error());
        (status, ru.ru_maxrss)
    };
    let wall = started.elapsed();
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "spotguard goodput failed: status {status}"
    );
    let v: serde_json::Value = serde_json::from_slice(&stdout).expect("the report's JSON");
    Sample {
        wall,
        max_rss_kib,
        rows: v["interruptions"].as_array().map_or(0, Vec::len),
    }
}

fn main() -> ExitCode {
    let runs: usize = std::env::var("GOODPUT_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let k = TestCluster::new().await;
        let ns = k.namespace("goodput-bench").await;
        let jobs: Api<Job> = Api::namespaced(k.admin(), &ns);
        let job: Job = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "bench"},
            "spec": {"suspend": true, "template": {"spec": {"restartPolicy": "Never",
                "containers": [{"name": "main", "image": "registry.example/trainer:1"}]}}}
        }))
        .unwrap();
        let job = jobs.create(&PostParams::default(), &job).await.unwrap();
        let owner = ObjectReference {
            api_version: Some("batch/v1".into()),
            kind: Some("Job".into()),
            name: Some("bench".into()),
            uid: job.metadata.uid.clone(),
            ..Default::default()
        };
        let per = PER_NOTICE_TARGETS + PER_NOTICE_RECOVERIES;
        let mut ok = true;
        let mut filled = 0;
        for records in [1_000, 10_000] {
            let notices = records / per;
            let t = Instant::now();
            fill(&k, &ns, &owner, filled, notices).await;
            filled = notices;
            eprintln!(
                "goodput_ledger: {records} records in the ledger ({:.1}s to create)",
                t.elapsed().as_secs_f64()
            );
            let mut samples: Vec<Sample> = (0..runs).map(|_| report(&k, &ns)).collect();
            samples.sort_by_key(|s| s.wall);
            let median = &samples[samples.len() / 2];
            assert!(samples.iter().all(|s| s.rows == notices), "rows");
            println!(
                "goodput report over {records} records ({notices} interruptions): median {:.2} s (min {:.2}, max {:.2}), peak RSS {:.1} MiB",
                median.wall.as_secs_f64(),
                samples[0].wall.as_secs_f64(),
                samples[samples.len() - 1].wall.as_secs_f64(),
                samples.iter().map(|s| s.max_rss_kib).max().unwrap_or(0) as f64 / 1024.0
            );
            if records == 10_000 && median.wall > LIMIT {
                eprintln!("goodput_ledger: over {LIMIT:?}");
                ok = false;
            }
        }
        if ok {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    })
}
