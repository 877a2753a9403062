//! `spotguard drill` end to end: the real binary, the embedded emulator, the real pipeline and a
//! real child process.

use std::process::Command;

fn drill(args: &[&str]) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_spotguard"))
        .arg("drill")
        .args(args)
        .output()
        .expect("run drill");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.code().unwrap_or(-1), text)
}

fn python(script: &str) -> Vec<String> {
    vec!["python3".into(), "-c".into(), script.into()]
}

fn with_cmd<'a>(flags: &[&'a str], cmd: &'a [String]) -> Vec<&'a str> {
    let mut v: Vec<&str> = flags.to_vec();
    v.push("--");
    v.extend(cmd.iter().map(String::as_str));
    v
}

#[test]
fn bundled_trainer_passes_on_every_cloud() {
    for cloud in ["aws", "gce", "azure"] {
        let (code, out) = drill(&["--cloud", cloud, "--after", "1s"]);
        assert_eq!(code, 0, "{cloud}:\n{out}");
        assert!(out.contains("verdict: PASS"), "{cloud}:\n{out}");
        assert!(out.contains("signal sent"), "{out}");
        assert!(out.contains("state=done"), "{out}");
        assert!(out.contains("command exit         143"), "{out}");
        assert!(out.contains("handler seen"), "{out}");
        assert!(!out.contains("+-0.000s"), "{out}");
    }
    let (_, out) = drill(&["--cloud", "gce", "--after", "1s"]);
    assert!(out.contains("hanging GET"), "{out}");
    assert!(!out.contains("polling"), "{out}");
}

#[test]
fn python_example_passes_and_shows_its_ack() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/train_loop.py");
    let ckpt = tempfile::tempdir().unwrap();
    let ckpt_arg = ckpt.path().display().to_string();
    let (code, out) = drill(&[
        "--after",
        "1s",
        "--",
        "python3",
        example,
        "--ckpt-dir",
        &ckpt_arg,
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("verdict: PASS"), "{out}");
    assert!(out.contains("state=done"), "{out}");
}

/// The handler comes late (a slow `import torch`): the drill waits for it instead of failing.
#[test]
fn the_notice_waits_for_a_slow_starting_handler_and_names_it() {
    let cmd = python(
        "import os, signal, sys, time\n\
         time.sleep(4)\n\
         hit = []\n\
         signal.signal(signal.SIGUSR1, lambda *a: hit.append(1))\n\
         while not hit: time.sleep(0.01)\n\
         d = os.environ['SPOTGUARD_DIR']\n\
         open(os.path.join(d, 'ack'), 'w').write('done')\n\
         sys.exit(143)\n",
    );
    let (code, out) = drill(&with_cmd(&["--after", "1s"], &cmd));
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("verdict: PASS"), "{out}");
    let line = out
        .lines()
        .find(|l| l.contains("handler seen"))
        .expect("handler row");
    let waited: f64 = line
        .split_whitespace()
        .nth(2)
        .unwrap()
        .trim_end_matches('s')
        .parse()
        .unwrap();
    assert!(waited >= 3.9, "{line}");
    assert!(line.contains("-c import os, signal"), "{line}");
}

#[test]
fn a_command_without_a_handler_fails_with_the_time_waited() {
    let (code, out) = drill(&[
        "--after",
        "1s",
        "--startup-timeout",
        "2s",
        "--timeout",
        "3s",
        "--",
        "sleep",
        "60",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("verdict: FAIL"), "{out}");
    assert!(out.contains("no_handler"), "{out}");
    assert!(
        out.contains("no process of the command ever caught SIGUSR1 (waited 2."),
        "{out}"
    );
    // sleep was not signalled: the drill stopped it, and says so.
    assert!(out.contains("killed by the drill (SIGTERM)"), "{out}");
    assert!(!out.contains("retryable"), "{out}");
}

/// torchrun without the launcher: the workers ack `done`, the launcher exits 1.
#[test]
fn exit_1_after_the_acks_fails_and_names_the_launcher() {
    let cmd = python(
        "import os, signal, sys, time, json\n\
         hit = []\n\
         signal.signal(signal.SIGUSR1, lambda *a: hit.append(1))\n\
         while not hit: time.sleep(0.01)\n\
         d = os.environ['SPOTGUARD_DIR']\n\
         open(os.path.join(d, 'ack-%d.json' % os.getpid()), 'w').write(json.dumps({'state': 'done', 'step': 7, 'checkpoint': None, 'ts': time.time()}))\n\
         sys.exit(1)\n",
    );
    let (code, out) = drill(&with_cmd(&["--after", "1s"], &cmd));
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("verdict: FAIL"), "{out}");
    assert!(out.contains("podFailurePolicy"), "{out}");
    assert!(out.contains("python3 -m spotguard launch"), "{out}");
    assert!(out.contains("command exit         1 "), "{out}");
}

#[test]
fn exit_0_after_the_ack_is_not_labelled_retryable() {
    let cmd = python(
        "import os, signal, sys, time\n\
         hit = []\n\
         signal.signal(signal.SIGUSR1, lambda *a: hit.append(1))\n\
         while not hit: time.sleep(0.01)\n\
         open(os.path.join(os.environ['SPOTGUARD_DIR'], 'ack'), 'w').write('')\n",
    );
    let (code, out) = drill(&with_cmd(&["--after", "1s"], &cmd));
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("0 = success"), "{out}");
    assert!(!out.contains("retryable"), "{out}");
}

#[test]
fn a_checkpoint_that_does_not_fit_the_gce_budget_fails_and_the_late_ack_says_so() {
    // The trainer needs 25 s to save; GCE gives 30 s − 8 s reserve.
    let (code, out) = drill(&[
        "--cloud",
        "gce",
        "--after",
        "1s",
        "--",
        env!("CARGO_BIN_EXE_spotguard"),
        "example-trainer",
        "--save-time",
        "25s",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("timeout"), "{out}");
    assert!(out.contains("late: after the budget"), "{out}");
    assert!(!out.contains("verdict: PASS"), "{out}");
}

#[test]
fn json_junit_keep_and_repeat() {
    let dir = tempfile::tempdir().unwrap();
    let junit = dir.path().join("drill.xml");
    let junit_arg = junit.display().to_string();
    let o = Command::new(env!("CARGO_BIN_EXE_spotguard"))
        .args([
            "drill", "--after", "1s", "--repeat", "2", "--json", "--keep",
        ])
        .args(["--junit", &junit_arg])
        .output()
        .expect("run drill");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{stderr}");
    let doc: serde_json::Value =
        serde_json::from_slice(&o.stdout).expect("stdout is one JSON document");
    assert_eq!(doc["pass"], true);
    let runs = doc["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for r in runs {
        assert_eq!(r["pass"], true, "{r}");
        assert_eq!(r["exit"]["code"], 143, "{r}");
        assert_eq!(r["exit"]["killed_by_drill"], false, "{r}");
        assert_eq!(r["handler"]["found"], true, "{r}");
        assert_eq!(r["acks"][0]["state"], "done", "{r}");
        assert_eq!(r["results"][0]["outcome"], "acked", "{r}");
        assert!(r["signal_sent_s"].as_f64().unwrap() >= 0.0, "{r}");
    }
    // The trainer's own output went to stderr, with the kept dirs.
    assert!(stderr.contains("example-trainer: checkpoint"), "{stderr}");
    let kept: Vec<&str> = stderr
        .lines()
        .filter_map(|l| l.trim().strip_prefix("drill dir (kept): "))
        .collect();
    assert_eq!(kept.len(), 2, "{stderr}");
    for k in kept {
        assert!(std::path::Path::new(k).join("checkpoint").is_dir(), "{k}");
        std::fs::remove_dir_all(k).unwrap();
    }
    let xml = std::fs::read_to_string(&junit).unwrap();
    assert!(xml.contains("tests=\"2\" failures=\"0\""), "{xml}");
    assert_eq!(xml.matches("<testcase ").count(), 2, "{xml}");
}

#[test]
fn help_lists_the_exit_codes() {
    let o = Command::new(env!("CARGO_BIN_EXE_spotguard"))
        .args(["drill", "--help"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("Exit codes:"), "{text}");
    for line in ["  0  PASS", "  1  FAIL", "  2  the drill could not run"] {
        assert!(text.contains(line), "{line}:\n{text}");
    }
}
