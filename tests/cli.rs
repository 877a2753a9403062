//! The binary's command line: bad flags, env values and config files exit 64 naming the key,
//! before anything starts; help and version exit 0.

use std::process::{Command, Output};

fn spotguard(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_spotguard"));
    c.args(args);
    // Isolate from the caller's environment.
    for (k, _) in std::env::vars() {
        if k.starts_with("SPOTGUARD_") || k == "KUBECONFIG" || k == "NODE_NAME" {
            c.env_remove(k);
        }
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run spotguard")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn bad_flag_values_exit_64_naming_the_flag() {
    for (args, key) in [
        (vec!["run", "--poll-interval", "often"], "--poll-interval"),
        (
            vec!["run", "--checkpoint-signal", "SIGKILL"],
            "--checkpoint-signal",
        ),
        (vec!["run", "--cloud", "ibm"], "--cloud"),
        (
            vec!["run", "--metadata-endpoint", "ftp://x"],
            "--metadata-endpoint",
        ),
        (vec!["run", "--no-such-flag"], "--no-such-flag"),
    ] {
        let o = spotguard(&args, &[]);
        assert_eq!(o.status.code(), Some(64), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(key), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn bad_env_values_exit_64_naming_the_variable() {
    let o = spotguard(&["run"], &[("SPOTGUARD_CHECKPOINT_TIMEOUT", "forever")]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("--checkpoint-timeout"),
        "{}",
        stderr(&o)
    );
    let o = spotguard(&["run"], &[("SPOTGUARD_DRY_RUN", "perhaps")]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
    assert!(stderr(&o).contains("--dry-run"), "{}", stderr(&o));
    let o = spotguard(&["run", "--mode", "kubernetes"], &[]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
    assert!(stderr(&o).contains("node-name"), "{}", stderr(&o));
}

#[test]
fn bad_config_files_exit_64_naming_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("spotguard.toml");
    for (content, needle) in [
        ("poll-interval = \"whenever\"\n", "poll-interval"),
        ("unknown-key = true\n", "unknown-key"),
        (
            "[[datasets]]\nname = \"x\"\nurl = \"http://nope\"\n",
            "prefetch",
        ),
        ("[gpu.thresholds]\nnot_a_threshold = 3\n", "gpu"),
        ("not toml at all", "config file"),
    ] {
        std::fs::write(&f, content).unwrap();
        let o = spotguard(&["run", "--config", f.to_str().unwrap()], &[]);
        assert_eq!(o.status.code(), Some(64), "{content}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{content}: {}", stderr(&o));
    }
    let o = spotguard(&["run", "--config", "/nonexistent/spotguard.toml"], &[]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
}

#[test]
fn help_and_version_exit_0() {
    let o = spotguard(&["--help"], &[]);
    assert_eq!(o.status.code(), Some(0));
    let out = String::from_utf8_lossy(&o.stdout);
    for cmd in ["run", "drill", "emulate", "prefetch", "gpu"] {
        assert!(out.contains(cmd), "{cmd} missing from --help");
    }
    let o = spotguard(&["--version"], &[]);
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stdout).contains(env!("CARGO_PKG_VERSION")));
}

#[test]
fn configuration_reference_matches_docs() {
    let o = spotguard(&["config-reference"], &[]);
    assert_eq!(o.status.code(), Some(0));
    let generated = String::from_utf8_lossy(&o.stdout);
    let committed = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/configuration.md"
    ))
    .expect("docs/configuration.md");
    assert!(
        generated == committed,
        "docs/configuration.md drifted from the CLI: run `cargo run -- config-reference > docs/configuration.md`"
    );
}

#[test]
fn env_file_names_only_real_variables() {
    // Every SPOTGUARD_* in the systemd env file is a variable `run` reads.
    let reference =
        String::from_utf8_lossy(&spotguard(&["config-reference"], &[]).stdout).into_owned();
    let env_file = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/systemd/spotguard.env"
    ))
    .unwrap();
    let words: Vec<&str> = env_file
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .collect();
    for word in &words {
        // SPOTGUARD_DIR is the training side's variable, mentioned in a comment.
        if word.starts_with("SPOTGUARD_")
            && word.len() > "SPOTGUARD_".len()
            && *word != "SPOTGUARD_DIR"
        {
            assert!(
                reference.contains(word),
                "{word} in systemd/spotguard.env is not a run variable"
            );
        }
    }
    // And every documented variable is in the env file.
    for var in reference
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("SPOTGUARD_") && w.len() > "SPOTGUARD_".len())
    {
        assert!(
            words.contains(&var),
            "{var} missing from systemd/spotguard.env"
        );
    }
}
