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

#[test]
fn version_names_the_commit() {
    let o = spotguard(&["--version"], &[]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    // `spotguard 0.1.0 (commit 0123456789ab)`; `unknown` only when built without git.
    let commit = out
        .split("(commit ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap_or_else(|| panic!("no commit in {out:?}"));
    assert!(
        commit == "unknown" || (commit.len() >= 7 && commit.chars().all(|c| c.is_ascii_hexdigit())),
        "{out:?}"
    );
}

#[test]
fn help_into_a_closed_pipe_exits_0() {
    use std::process::Stdio;
    for args in [
        vec!["--help"],
        vec!["run", "--help"],
        vec!["completions", "bash"],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_spotguard"))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Close the pipe (like `| head -1` exiting) before the process gets to write.
        drop(child.stdout.take());
        let o = child.wait_with_output().unwrap();
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn booleans_are_shown_as_switches() {
    let o = spotguard(&["run", "--help"], &[]);
    let out = String::from_utf8_lossy(&o.stdout);
    for flag in [
        "--dry-run",
        "--force-delete-at-deadline",
        "--imds-v1-fallback",
    ] {
        let line = out
            .lines()
            .find(|l| l.trim_start().starts_with(flag))
            .unwrap_or_else(|| panic!("{flag} not in run --help"));
        assert!(!line.contains('<'), "{line}");
    }
    // Still settable from the environment and a config file.
    let o = spotguard(
        &["config", "check", "--mode", "host"],
        &[("SPOTGUARD_DRY_RUN", "true")],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("dry-run"));
}

#[test]
fn completions_are_generated_for_every_shell() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let o = spotguard(&["completions", shell], &[]);
        assert_eq!(o.status.code(), Some(0), "{shell}: {}", stderr(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            out.contains("checkpoint-timeout") && out.contains("drill"),
            "{shell}: completion lacks flags or subcommands"
        );
    }
    let o = spotguard(&["completions", "tcsh"], &[]);
    assert_eq!(o.status.code(), Some(64));
}

#[test]
fn config_check_validates_without_starting() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("spotguard.toml");
    std::fs::write(&f, "poll-interval = \"2s\"\ndry-run = true\n").unwrap();
    let o = spotguard(
        &[
            "config",
            "check",
            "--config",
            f.to_str().unwrap(),
            "--mode",
            "host",
            "--webhook-url",
            "https://hooks.example.com/services/SECRET",
        ],
        &[("SPOTGUARD_CHECKPOINT_TIMEOUT", "45s")],
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let origin = |key: &str| -> String {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(key))
            .unwrap_or_else(|| panic!("{key} not in {out}"))
            .split_whitespace()
            .nth(1)
            .unwrap()
            .to_string()
    };
    assert_eq!(origin("mode"), "flag");
    assert_eq!(origin("checkpoint-timeout"), "env");
    assert_eq!(origin("poll-interval"), "file");
    assert_eq!(origin("dry-run"), "file");
    assert_eq!(origin("drain-concurrency"), "default");
    assert!(!out.contains("SECRET"), "a secret was printed: {out}");
    assert!(out.contains("configuration OK (mode host"), "{out}");

    // Invalid: exit 64 naming the key; nothing is bound or started.
    let o = spotguard(
        &["config", "check", "--mode", "kubernetes"],
        &[("SPOTGUARD_METRICS_ADDR", "127.0.0.1:1")],
    );
    assert_eq!(o.status.code(), Some(64));
    assert!(stderr(&o).contains("node-name"), "{}", stderr(&o));
}

#[test]
fn webhook_template_errors_exit_64_naming_the_key() {
    for (key, env, template) in [
        (
            "webhook-template",
            "SPOTGUARD_WEBHOOK_TEMPLATE",
            r#"{"text": "{{nodes}}"}"#,
        ),
        (
            "webhook-outcome-template",
            "SPOTGUARD_WEBHOOK_OUTCOME_TEMPLATE",
            r#"{"step": {{step}}}"#,
        ),
    ] {
        let o = spotguard(
            &[
                "run",
                "--mode",
                "host",
                "--webhook-url",
                "http://127.0.0.1:9/hook",
            ],
            &[(env, template)],
        );
        assert_eq!(o.status.code(), Some(64), "{key}: {}", stderr(&o));
        assert!(stderr(&o).contains(key), "{key}: {}", stderr(&o));
    }
    let o = spotguard(
        &[
            "run",
            "--mode",
            "host",
            "--webhook-url",
            "http://127.0.0.1:9/hook",
            "--webhook-preset",
            "pagerduty",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(64));
    assert!(stderr(&o).contains("webhook-routing-key"), "{}", stderr(&o));
}

#[test]
fn env_value_errors_name_the_variable() {
    let o = spotguard(&["run"], &[("SPOTGUARD_POLL_INTERVAL", "often")]);
    assert_eq!(o.status.code(), Some(64));
    let e = stderr(&o);
    assert!(
        e.contains("SPOTGUARD_POLL_INTERVAL") && e.contains("'often'"),
        "{e}"
    );
    // Given as a flag, the flag is named.
    let o = spotguard(
        &["run", "--poll-interval", "often"],
        &[("SPOTGUARD_POLL_INTERVAL", "1s")],
    );
    assert_eq!(o.status.code(), Some(64));
    assert!(
        !stderr(&o).contains("SPOTGUARD_POLL_INTERVAL"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn run_flags_are_grouped_under_headings() {
    let o = spotguard(&["run", "--help"], &[]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let headings: Vec<&str> = out
        .lines()
        .filter(|l| !l.starts_with(' ') && l.ends_with(':'))
        .collect();
    for h in [
        "Notices:",
        "Checkpoint:",
        "Drain:",
        "Observability:",
        "Prefetch:",
        "Host mode:",
    ] {
        assert!(headings.contains(&h), "{h} missing from {headings:?}");
    }
    // A flag appears under its heading.
    let under = |flag: &str| -> String {
        let mut current = "";
        for l in out.lines() {
            if !l.starts_with(' ') && l.ends_with(':') {
                current = l;
            } else if l.trim_start().starts_with(flag) {
                return current.to_string();
            }
        }
        panic!("{flag} not in run --help");
    };
    assert_eq!(under("--poll-interval"), "Notices:");
    assert_eq!(under("--checkpoint-timeout"), "Checkpoint:");
    assert_eq!(under("--drain-reserve"), "Drain:");
    assert_eq!(under("--webhook-url"), "Observability:");
    assert_eq!(under("--cache-dir"), "Prefetch:");
    assert_eq!(under("--checkpoint-pidfile"), "Host mode:");
}
