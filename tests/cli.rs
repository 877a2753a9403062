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
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let ckpt = dir.path().join("ckpt");
    let o = spotguard(
        &[
            "config",
            "check",
            "--mode",
            "host",
            "--checkpoint-unit",
            "train",
            "--state-dir",
            state.to_str().unwrap(),
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ],
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
            "--checkpoint-unit",
            "train",
            "--state-dir",
            dir.path().join("state").to_str().unwrap(),
            "--checkpoint-dir",
            dir.path().join("ckpt").to_str().unwrap(),
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
    // Each value as read: durations in seconds, sizes in bytes, lists as lists.
    let read = |key: &str| -> String {
        let line = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(key))
            .unwrap_or_else(|| panic!("{key} not in {out}"));
        line.split_whitespace()
            .skip(2)
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(read("maintenance-lead"), "600s (given: 10m)");
    assert_eq!(read("checkpoint-timeout"), "45s");
    assert_eq!(
        read("upload-max-bytes"),
        "1099511627776 bytes (given: 1TiB)"
    );
    assert_eq!(read("checkpoint-unit"), "[\"train\"] (given: train)");

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

/// `spotguard ARGS…` with `env`, killed if it has not exited within `limit` (a bad setting that
/// is accepted starts the agent, which would run on): `None` then.
fn spotguard_within(
    args: &[String],
    env: &[(&str, &str)],
    limit: std::time::Duration,
) -> Option<Output> {
    let mut c = Command::new(env!("CARGO_BIN_EXE_spotguard"));
    c.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("SPOTGUARD_") || k == "KUBECONFIG" || k == "NODE_NAME" {
            c.env_remove(k);
        }
    }
    c.envs(env.iter().copied());
    c.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().expect("run spotguard");
    let start = std::time::Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return Some(child.wait_with_output().unwrap());
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait_with_output();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Every setting whose value can be judged on the machine is refused at start, by `run` and by
/// `config check` alike: exit 64, the message naming the setting and what is wrong with it.
#[test]
fn bad_settings_are_refused_at_start_naming_the_setting() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let file = file.display().to_string();
    let path = |p: &str| tmp.path().join(p).display().to_string();
    // A valid host-mode agent; each row replaces or adds settings.
    let base: Vec<(&str, String)> = vec![
        ("--mode", "host".into()),
        ("--cloud", "aws".into()),
        ("--metadata-endpoint", "http://127.0.0.1:1".into()),
        ("--checkpoint-unit", "train.service".into()),
        ("--checkpoint-dir", path("ckpt")),
        ("--state-dir", path("state")),
        ("--metrics-addr", "127.0.0.1:0".into()),
        ("--gpu", "off".into()),
    ];
    // (settings replaced (an empty value drops the flag), what the message must say)
    type Row<'a> = (Vec<(&'a str, String)>, &'a [&'a str]);
    let rows: Vec<Row> = vec![
        (
            vec![("--log-level", "inf".into())],
            &["log-level", "\"inf\" is not a level"],
        ),
        (
            vec![("--log-level", "verbose".into())],
            &["log-level", "\"verbose\""],
        ),
        (
            vec![("--log-level", "info,,".into())],
            &["log-level", "empty directive"],
        ),
        (
            vec![("--state-dir", file.clone())],
            &["state-dir", "is not a directory"],
        ),
        (
            vec![("--state-dir", format!("{file}/sub"))],
            &["state-dir", "a-file"],
        ),
        (
            vec![("--state-dir", "/proc/spotguard".into())],
            &["state-dir", "on proc"],
        ),
        (
            vec![("--checkpoint-dir", file.clone())],
            &["checkpoint-dir", "is not a directory"],
        ),
        (
            vec![("--checkpoint-unit", "bad unit name".into())],
            &["checkpoint-unit", "not a systemd unit name", "' '"],
        ),
        (
            vec![("--checkpoint-unit", "train@.service".into())],
            &["checkpoint-unit", "template"],
        ),
        (
            vec![("--checkpoint-unit", "train.timer".into())],
            &["checkpoint-unit", ".timer"],
        ),
        (
            vec![
                ("--checkpoint-unit", String::new()),
                ("--checkpoint-pidfile", "relative.pid".into()),
            ],
            &["--checkpoint-pidfile", "must be an absolute path"],
        ),
        (
            vec![("--drain-reserve", "5m".into())],
            &["drain-reserve", "the notice of aws is 2m"],
        ),
        (
            vec![("--cloud", "gce".into()), ("--drain-reserve", "40s".into())],
            &["drain-reserve", "gce", "30s"],
        ),
        (
            vec![("--checkpoint-unit", String::new())],
            &["checkpoint-unit", "no checkpoint target"],
        ),
        // Durations are bounded.
        (
            vec![("--maintenance-lead", "1000000000000h".into())],
            &["--maintenance-lead", "above the most allowed, 720h"],
        ),
        (
            vec![("--poll-interval", "2h".into())],
            &["--poll-interval", "above the most allowed, 1m"],
        ),
        // Timings that contradict each other or the cloud's notice: both settings and the
        // cloud's figure named.
        (
            vec![
                ("--cloud", "azure".into()),
                ("--poll-interval", "25s".into()),
            ],
            &["poll-interval", "25s", "azure", "30s", "--drain-reserve 8s"],
        ),
        (
            vec![
                ("--poll-interval", "1m".into()),
                ("--drain-reserve", "1m".into()),
            ],
            &["poll-interval", "aws", "2m", "--drain-reserve 1m"],
        ),
        (
            vec![
                ("--cloud", "gce".into()),
                ("--gce-preemption-notice", "5s".into()),
            ],
            &["gce-preemption-notice", "5s", "--drain-reserve", "8s"],
        ),
        (
            vec![("--maintenance-lead", "20s".into())],
            &[
                "maintenance-lead",
                "20s",
                "--on-maintenance drain",
                "--drain-reserve 25s",
                "aws",
            ],
        ),
        (
            vec![
                ("--rebalance-expiry", "1s".into()),
                ("--poll-interval", "2s".into()),
            ],
            &["rebalance-expiry", "1s", "--poll-interval (2s)"],
        ),
        // A selector that selects the world.
        (
            vec![("--checkpoint-cmdline", ".*".into())],
            &["--checkpoint-cmdline", "matches every command line"],
        ),
    ];
    let limit = std::time::Duration::from_secs(30);
    let mut failures = Vec::new();
    for (changes, words) in &rows {
        let mut settings = base.clone();
        for (k, v) in changes {
            settings.retain(|(b, _)| b != k);
            if !v.is_empty() {
                settings.push((k, v.clone()));
            }
        }
        let flags: Vec<String> = settings
            .iter()
            .flat_map(|(k, v)| [k.to_string(), v.clone()])
            .collect();
        for command in [&["config", "check"][..], &["run"][..]] {
            let argv: Vec<String> = command
                .iter()
                .map(|s| s.to_string())
                .chain(flags.iter().cloned())
                .collect();
            let verdict = match spotguard_within(&argv, &[], limit) {
                None => Some("accepted: still running after 30s".to_string()),
                Some(o) if o.status.code() != Some(64) => Some(format!(
                    "exit {:?}: {}{}",
                    o.status.code(),
                    String::from_utf8_lossy(&o.stdout),
                    stderr(&o)
                )),
                Some(o) if !words.iter().all(|w| stderr(&o).contains(w)) => {
                    Some(format!("message lacks {words:?}: {}", stderr(&o)))
                }
                Some(_) => None,
            };
            if let Some(v) = verdict {
                failures.push(format!("{command:?} {changes:?}: {v}"));
            }
        }
    }
    // The drill's report file, before the drill runs (not after minutes of it).
    let junit = path("no/such/dir/x.xml");
    for (flag, value, words) in [
        (
            "--junit",
            junit.as_str(),
            &["--junit", "no/such/dir", "No such file"][..],
        ),
        (
            "--junit",
            tmp.path().to_str().unwrap(),
            &["--junit", "is a directory"][..],
        ),
        ("--log-level", "inf", &["--log-level", "\"inf\""][..]),
    ] {
        let argv: Vec<String> = ["drill", "--cloud", "aws", flag, value]
            .iter()
            .map(|s| s.to_string())
            .collect();
        match spotguard_within(&argv, &[], limit) {
            None => failures.push(format!("drill {flag} {value}: still running after 30s")),
            Some(o) => {
                if o.status.code() != Some(64) || !words.iter().all(|w| stderr(&o).contains(w)) {
                    failures.push(format!(
                        "drill {flag} {value}: exit {:?}: {}",
                        o.status.code(),
                        stderr(&o)
                    ));
                }
                if !o.stdout.is_empty() {
                    failures.push(format!(
                        "drill {flag} {value}: the drill ran: {}",
                        String::from_utf8_lossy(&o.stdout)
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The env file's example lines, uncommented, are read by the documented
/// `set -a; . /etc/spotguard/spotguard.env; set +a` as they are meant (quotes removed, nothing run
/// as a command), and `config check` then shows each value as coming from the environment.
#[test]
fn env_file_examples_source_as_documented() {
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/systemd/spotguard.env"
    ))
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Every example line uncommented, as an operator would; the paths of this machine below.
    let mut expected = Vec::new();
    let mut text = String::new();
    for line in shipped.lines() {
        match line.strip_prefix('#') {
            Some(l) if l.starts_with("SPOTGUARD_") && l.contains('=') => {
                let (k, v) = l.split_once('=').unwrap();
                let value = v
                    .strip_prefix('\'')
                    .and_then(|v| v.strip_suffix('\''))
                    .unwrap_or(v);
                expected.push((k.to_string(), value.to_string()));
                text.push_str(l);
            }
            _ => text.push_str(line),
        }
        text.push('\n');
    }
    assert!(expected.len() > 40, "only {} example lines", expected.len());
    let env_file = dir.path().join("spotguard.env");
    std::fs::write(&env_file, text).unwrap();
    let toml = dir.path().join("empty.toml");
    std::fs::write(&toml, "").unwrap();
    let script = format!(
        "set -a; . '{}'; set +a; env; echo '--- config check'; \"$0\" config check --mode host --config '{}' --state-dir '{}' --checkpoint-dir '{}' --metrics-addr 127.0.0.1:0 --webhook-url https://hooks.example.com/x",
        env_file.display(),
        toml.display(),
        dir.path().join("state").display(),
        dir.path().join("ckpt").display(),
    );
    let mut c = Command::new("sh");
    c.args(["-c", &script, env!("CARGO_BIN_EXE_spotguard")]);
    for (k, _) in std::env::vars() {
        if k.starts_with("SPOTGUARD_") {
            c.env_remove(k);
        }
    }
    let o = c.output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    // Nothing of a value was run as a command (`.*train.py: command not found`).
    assert!(!stderr(&o).contains("not found"), "{}", stderr(&o));
    let (env, check) = out.split_once("--- config check\n").unwrap();
    for (k, v) in &expected {
        let got = env.lines().find_map(|l| l.strip_prefix(&format!("{k}=")));
        if v.is_empty() {
            assert!(got.is_none_or(str::is_empty), "{k}={got:?}");
        } else {
            assert_eq!(got, Some(v.as_str()), "{k} as the shell read it");
        }
    }
    assert_eq!(o.status.code(), Some(0), "{out}{}", stderr(&o));
    let line = check
        .lines()
        .find(|l| l.starts_with("checkpoint-cmdline "))
        .unwrap_or_else(|| panic!("no checkpoint-cmdline in {check}"));
    assert!(
        line.contains("env") && line.contains(r"python3? .*train\.py"),
        "{line}"
    );
}

/// `spotguard ARGS…` with only `env` of the cloud SDKs' variables (no credentials of the caller).
fn spotguard_clean(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_spotguard"));
    c.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("SPOTGUARD_")
            || k.starts_with("AWS_")
            || k.starts_with("GOOGLE_")
            || k == "KUBECONFIG"
            || k == "NODE_NAME"
        {
            c.env_remove(k);
        }
    }
    c.envs(env.iter().copied());
    c.output().expect("run spotguard")
}

/// Each error names its real cause in the project's words: a credential provider that found
/// nothing is "no credentials", never the bucket's denial; arguments are named as typed; a
/// refused connection is said as such; durations and signals say what is accepted.
#[test]
fn error_messages_name_the_real_cause() {
    let tmp = tempfile::tempdir().unwrap();
    let staged = tmp.path().join("step-5");
    std::fs::create_dir_all(&staged).unwrap();
    std::fs::write(staged.join("model.bin"), "weights").unwrap();
    let staged = staged.to_str().unwrap();
    let cache = tmp.path().join("cache");
    let cache = cache.to_str().unwrap();
    let missing = tmp.path().join("nothing-here");
    let missing = missing.to_str().unwrap();
    // The instance-metadata credential provider finds nothing listening.
    let no_creds = [("AWS_METADATA_ENDPOINT", "http://127.0.0.1:1")];
    let creds = [
        ("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE"),
        ("AWS_SECRET_ACCESS_KEY", "secret"),
        ("AWS_REGION", "us-east-1"),
    ];
    // (arguments, environment, exit code, words it must say, words it must not say)
    type Row<'a> = (
        Vec<&'a str>,
        &'a [(&'a str, &'a str)],
        i32,
        Vec<&'a str>,
        Vec<&'a str>,
    );
    let rows: Vec<Row> = vec![
        (
            vec!["prefetch", "s3://my-bucket/imagenet/", cache],
            &no_creds,
            2,
            vec!["no credentials (tried: env, web identity, instance metadata: connection refused by 127.0.0.1:1"],
            vec!["bucket policy", "access denied"],
        ),
        (
            vec!["upload", staged, "s3://my-bucket/run1"],
            &no_creds,
            2,
            vec!["no credentials (tried: env, web identity, instance metadata"],
            vec!["Generic S3 error"],
        ),
        (
            vec!["prefetch", "s3://my-bucket/imagenet/", cache, "--endpoint", "http://127.0.0.1:1"],
            &creds,
            2,
            vec!["connection refused by 127.0.0.1:1"],
            vec!["error sending request", "no credentials"],
        ),
        (
            vec!["prefetch", "s3://my-bucket/imagenet/", cache, "--endpoint", "not-a-url"],
            &[],
            64,
            vec!["--endpoint", "must start with http:// or https://"],
            vec!["source URL"],
        ),
        (
            vec!["upload", staged, "gs://"],
            &[],
            64,
            vec!["destination \"gs://\"", "missing bucket name"],
            vec!["source URL"],
        ),
        (vec!["upload", missing, "s3://my-bucket/run1"], &[], 64, vec!["STAGED", "no such directory"], vec![]),
        (
            vec!["run", "--webhook-url", "http://"],
            &[],
            64,
            vec!["--webhook-url", "has no host"],
            vec!["must start with"],
        ),
        (
            vec!["drill", "--timeout", "60"],
            &[],
            64,
            vec!["--timeout", "\"60\" has no unit: write 60s"],
            vec!["friendly", "designator"],
        ),
        (
            vec!["run", "--checkpoint-timeout", "soon"],
            &[],
            64,
            vec!["--checkpoint-timeout", "like 500ms, 30s, 10m or 1h30m"],
            vec!["friendly", "designator"],
        ),
        (
            vec!["run", "--checkpoint-signal", "SIGKILL"],
            &[],
            64,
            vec!["SIGKILL cannot be caught", "SIGUSR1, SIGUSR2"],
            vec!["disallowed"],
        ),
        (
            vec!["drill", "--", "python3", "-c", "import no_such_module_of_spotguard"],
            &[],
            2,
            vec!["crashed before the notice (exit 1", "its own output is above"],
            vec!["Give it more steps"],
        ),
        (
            vec!["run", "--checkpoint-signal", "SIGFOO"],
            &[],
            64,
            vec!["unknown signal \"SIGFOO\"", "SIGUSR1"],
            vec!["disallowed"],
        ),
    ];
    let mut failures = Vec::new();
    for (args, env, code, must, must_not) in &rows {
        let o = spotguard_clean(args, env);
        let e = stderr(&o);
        if o.status.code() != Some(*code)
            || !must.iter().all(|w| e.contains(w))
            || must_not.iter().any(|w| e.contains(w))
        {
            failures.push(format!(
                "{args:?}: exit {:?} (want {code}), want {must:?}, not {must_not:?}:\n{e}",
                o.status.code()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// A valid host-mode agent's arguments, state in `dir`.
fn agent_args(dir: &std::path::Path, metrics: &str) -> Vec<String> {
    vec![
        "run".into(),
        "--mode=host".into(),
        "--cloud=aws".into(),
        "--metadata-endpoint=http://127.0.0.1:1".into(),
        "--checkpoint-unit=train".into(),
        format!("--checkpoint-dir={}", dir.join("ckpt").display()),
        format!("--state-dir={}", dir.join("state").display()),
        format!("--metrics-addr={metrics}"),
        "--gpu=off".into(),
        "--log-format=text".into(),
    ]
}

/// The agent's stderr until a line satisfies `done` (then it is stopped), or it exits.
fn agent_until(args: &[String], done: impl Fn(&str) -> bool) -> String {
    use std::io::BufRead;
    let mut c = Command::new(env!("CARGO_BIN_EXE_spotguard"));
    c.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("SPOTGUARD_") || k == "RUST_LOG" {
            c.env_remove(k);
        }
    }
    let mut child = c
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = String::new();
    for line in std::io::BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        out.push_str(&line);
        out.push('\n');
        if done(&line) {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    out
}

#[test]
fn the_agent_says_refused_once_and_plainly() {
    let dir = tempfile::tempdir().unwrap();
    // The metadata endpoint refuses: said as such (not "error sending request for url").
    let log = agent_until(&agent_args(dir.path(), "127.0.0.1:0"), |l| {
        l.contains("metadata poll failed")
    });
    let line = log
        .lines()
        .find(|l| l.contains("metadata poll failed"))
        .unwrap_or_else(|| panic!("no failed poll logged:\n{log}"));
    assert!(
        line.contains("connection refused by 127.0.0.1:1")
            && !line.contains("error sending request"),
        "{line}"
    );
    // The metrics address in use: the cause once.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let log = agent_until(&agent_args(dir.path(), &addr), |l| {
        l.contains("spotguard stopped")
    });
    let line = log
        .lines()
        .find(|l| l.contains("spotguard stopped"))
        .unwrap_or_else(|| panic!("the agent did not stop:\n{log}"));
    assert_eq!(line.matches("Address already in use").count(), 1, "{line}");
}

/// `--checkpoint-cmdline`'s list form is a list wherever the docs promise one (the environment
/// included), and a pattern that matches every command line is refused, named.
#[test]
fn checkpoint_cmdline_is_a_list_and_never_selects_the_world() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state").display().to_string();
    let ckpt = dir.path().join("ckpt").display().to_string();
    let base = [
        "config",
        "check",
        "--mode",
        "host",
        "--cloud",
        "aws",
        "--state-dir",
        &state,
        "--checkpoint-dir",
        &ckpt,
    ];
    let o = spotguard(
        &base,
        &[("SPOTGUARD_CHECKPOINT_CMDLINE", "sgtrain,torchrun")],
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let line = out
        .lines()
        .find(|l| l.starts_with("checkpoint-cmdline "))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains("env") && line.contains(r#"["sgtrain", "torchrun"]"#),
        "{line}"
    );
    for (args, env) in [
        (vec!["--checkpoint-cmdline", ""], vec![]),
        (vec!["--checkpoint-cmdline", "^"], vec![]),
        (vec!["--checkpoint-cmdline", "sgtrain,"], vec![]),
        (vec![], vec![("SPOTGUARD_CHECKPOINT_CMDLINE", "sgtrain,.?")]),
    ] {
        let argv: Vec<&str> = base.iter().copied().chain(args.iter().copied()).collect();
        let o = spotguard(&argv, &env);
        assert_eq!(
            o.status.code(),
            Some(64),
            "{args:?} {env:?}: {}",
            stderr(&o)
        );
        assert!(
            stderr(&o).contains("matches every command line"),
            "{args:?} {env:?}: {}",
            stderr(&o)
        );
    }
}

/// The config file: anything but a regular file is refused at once (a FIFO without a writer
/// never holds start-up), and a key given under both spellings is refused naming both.
#[test]
fn config_file_is_a_regular_file_with_each_key_once() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("spotguard.toml");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let limit = std::time::Duration::from_secs(30);
    for (path, what) in [
        (fifo.display().to_string(), "is a FIFO"),
        (dir.path().display().to_string(), "is a directory"),
        ("/dev/zero".to_string(), "is a device"),
    ] {
        let argv: Vec<String> = ["config", "check", "--config", &path]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let o = spotguard_within(&argv, &[], limit)
            .unwrap_or_else(|| panic!("--config {path}: still waiting after 30s"));
        assert_eq!(o.status.code(), Some(64), "{path}: {}", stderr(&o));
        assert!(stderr(&o).contains(what), "{path}: {}", stderr(&o));
    }
    let f = dir.path().join("twice.toml");
    std::fs::write(&f, "poll-interval = \"2s\"\npoll_interval = \"3s\"\n").unwrap();
    let o = spotguard(&["config", "check", "--config", f.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("`poll-interval`") && e.contains("`poll_interval`"),
        "{e}"
    );
}

/// A user name and password in a URL never reach the logs or `config check`: the
/// effective-configuration line, the metadata poll's warning, the table.
#[test]
fn credentials_in_urls_are_never_shown() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = agent_args(dir.path(), "127.0.0.1:0");
    args.retain(|a| !a.starts_with("--metadata-endpoint="));
    args.push("--metadata-endpoint=http://admin:S3CRET@127.0.0.1:1".into());
    args.push("--upload-endpoint=http://key:S3CRET@127.0.0.1:2".into());
    let log = agent_until(&args, |l| l.contains("metadata poll failed"));
    assert!(log.contains("effective configuration"), "{log}");
    assert!(log.contains("metadata poll failed"), "{log}");
    assert!(!log.contains("S3CRET"), "a password was logged:\n{log}");
    assert!(log.contains("http://redacted@127.0.0.1:1"), "{log}");
    let mut check: Vec<String> = vec!["config".into(), "check".into()];
    check.extend(args.into_iter().skip(1));
    check.push("--prefetch-endpoint=http://key:S3CRET@127.0.0.1:3".into());
    let argv: Vec<&str> = check.iter().map(String::as_str).collect();
    let o = spotguard(&argv, &[]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!out.contains("S3CRET"), "a password was printed:\n{out}");
    assert!(out.contains("http://redacted@127.0.0.1:3"), "{out}");
}

/// SIGHUP: the agent says it does not reload and keeps running (it used to die with 129 without
/// a word); a SIGTERM after it still stops it cleanly.
#[test]
fn sighup_is_said_and_the_agent_keeps_running() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_spotguard"));
    c.args(agent_args(dir.path(), "127.0.0.1:0"));
    for (k, _) in std::env::vars() {
        if k.starts_with("SPOTGUARD_") || k == "RUST_LOG" {
            c.env_remove(k);
        }
    }
    let mut child = c
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut log = String::new();
    let mut next_until = |what: &str, log: &mut String| {
        for line in lines.by_ref() {
            let line = line.unwrap();
            log.push_str(&line);
            log.push('\n');
            if line.contains(what) {
                return true;
            }
        }
        false
    };
    // Running: its first poll (the signal handlers are installed before the sources start).
    assert!(next_until("metadata poll failed", &mut log), "{log}");
    rustix::process::kill_process(pid, rustix::process::Signal::HUP).unwrap();
    assert!(
        next_until("reloading settings is not supported", &mut log),
        "no word on SIGHUP:\n{log}"
    );
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{status}:\n{log}");
}
