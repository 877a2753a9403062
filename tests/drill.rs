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
        assert!(std::path::Path::new(k).join("notice").is_dir(), "{k}");
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

#[test]
fn the_old_checkpoint_dir_flag_still_names_the_notice_dir() {
    for flag in ["--notice-dir", "--checkpoint-dir"] {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let (code, out) = drill(&["--after", "1s", flag, &d]);
        assert_eq!(code, 0, "{flag}:\n{out}");
        assert!(out.contains(&format!("SPOTGUARD_DIR={d}")), "{out}");
        assert!(
            std::fs::read_dir(dir.path())
                .unwrap()
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("ack-")),
            "{flag}: no ack in the notice dir"
        );
    }
}

/// Rehearsing a resume: three drills in one notice dir, each a PASS that signals its trainer, and
/// each trainer resumes from the checkpoint the one before saved. (The second drill used to take
/// the first one's `notice.json`, an interruption of the same boot, as proof that its trainer had
/// been signalled already: "SIGUSR1 to 0 process(es)", FAIL after the budget.)
#[test]
fn three_drills_in_one_notice_dir_each_signal_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let notice = dir.path().join("notice");
    let d = notice.display().to_string();
    let mut last_saved = 0u64;
    for run in 1..=3 {
        let (code, out) = drill(&["--after", "1s", "--checkpoint-dir", &d]);
        assert_eq!(code, 0, "drill {run}:\n{out}");
        assert!(out.contains("verdict: PASS"), "drill {run}:\n{out}");
        assert!(!out.contains("to 0 process"), "drill {run}:\n{out}");
        let resumed = out
            .lines()
            .find_map(|l| l.split("resumed from step ").nth(1))
            .and_then(|s| s.trim().parse::<u64>().ok());
        if run == 1 {
            assert_eq!(resumed, None, "the first drill starts from scratch:\n{out}");
        } else {
            assert_eq!(
                resumed,
                Some(last_saved),
                "drill {run} resumes from the step the drill before saved:\n{out}"
            );
        }
        last_saved = out
            .lines()
            .find_map(|l| l.split("at step ").nth(1))
            .and_then(|s| s.split(':').next())
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("drill {run}: no saved step:\n{out}"));
        assert!(resumed.unwrap_or(0) < last_saved, "drill {run}:\n{out}");
        // The trainer's checkpoints are beside the notice dir, never in it (it carries only the
        // notice and the acks).
        let names = |d: &std::path::Path| -> Vec<String> {
            std::fs::read_dir(d)
                .map(|r| {
                    r.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default()
        };
        assert!(
            !names(&notice).iter().any(|n| n.starts_with("checkpoint-")),
            "drill {run}: a checkpoint in the notice dir: {:?}",
            names(&notice)
        );
        assert!(
            names(&dir.path().join("notice-checkpoints"))
                .contains(&format!("checkpoint-{last_saved:08}.json")),
            "drill {run}: step {last_saved} not saved beside the notice dir"
        );
    }
}

/// A command that finished its work before the notice: say so, not "killed by the drill".
#[test]
fn a_command_that_ended_before_the_notice_says_so() {
    let cmd = python(
        "import signal, time\n\
         signal.signal(signal.SIGUSR1, lambda *a: None)\n\
         time.sleep(0.3)\n",
    );
    let (code, out) = drill(&with_cmd(&["--after", "2s"], &cmd));
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("the command ended before the notice"), "{out}");
    assert!(!out.contains("killed by the drill"), "{out}");

    // Its launcher still runs (torchrun waiting for other nodes), its training process is gone.
    let cmd = vec![
        "sh".to_string(),
        "-c".into(),
        "python3 -c 'import signal, time; signal.signal(signal.SIGUSR1, lambda *a: None); time.sleep(0.3)'; sleep 30".into(),
    ];
    let (code, out) = drill(&with_cmd(&["--after", "2s", "--timeout", "3s"], &cmd));
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("the command ended before the notice"), "{out}");
    assert!(
        out.contains("its training had ended before the notice"),
        "{out}"
    );
}

/// `accelerate launch --cpu --num_processes 2` runs one process: the drill warns.
#[test]
fn fewer_processes_than_the_launcher_was_asked_for_is_a_warning() {
    let mut cmd = python(
        "import os, signal, sys, time\n\
         hit = []\n\
         signal.signal(signal.SIGUSR1, lambda *a: hit.append(1))\n\
         while not hit: time.sleep(0.01)\n\
         open(os.path.join(os.environ['SPOTGUARD_DIR'], 'ack'), 'w').write('')\n\
         sys.exit(143)\n",
    );
    cmd.extend(["--num_processes".to_string(), "2".to_string()]);
    let (code, out) = drill(&with_cmd(&["--after", "1s"], &cmd));
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("asked for 2 processes but only 1 caught the signal"),
        "{out}"
    );
}

// ---- --elastic, against the stand-in torchrun (clients/python/tests/standin) ----------------

fn standin_job(dir: &std::path::Path, launcher: bool, max_restarts: &str) -> Vec<String> {
    let standin = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/python/tests/standin");
    let mut cmd: Vec<String> = Vec::new();
    if launcher {
        cmd.extend(["python3", "-m", "spotguard", "launch", "--"].map(String::from));
    }
    cmd.extend([
        "python3".to_string(),
        format!("{standin}/torchrun"),
        "--nnodes".into(),
        "1:2".into(),
        "--nproc-per-node".into(),
        "2".into(),
        "--max-restarts".into(),
        max_restarts.into(),
        "--rdzv-backend".into(),
        "standin".into(),
        "--rdzv-conf".into(),
        "last_call_timeout=1".into(),
        "--rdzv-endpoint".into(),
        dir.join("rdzv").display().to_string(),
        "--rdzv-id".into(),
        "job".into(),
        format!("{standin}/worker.py"),
        "--ckpt-dir".into(),
        dir.join("ck").display().to_string(),
        "--step-time".into(),
        "0.03".into(),
        // A lost peer fails a step after 1 s (a gloo collective would fail on the closed socket).
        "--peer-timeout".into(),
        "1".into(),
    ]);
    cmd
}

fn elastic_drill(cmd: &[String], json: bool, settle: &str) -> (i32, String, String) {
    let mut args = vec![
        "drill",
        "--elastic",
        "--cloud",
        "gce",
        "--after",
        "1s",
        "--kill-after",
        "5s",
        "--settle",
        settle,
    ];
    if json {
        args.push("--json");
    }
    args.push("--");
    let o = Command::new(env!("CARGO_BIN_EXE_spotguard"))
        .args(&args)
        .args(cmd)
        .env(
            "PYTHONPATH",
            concat!(env!("CARGO_MANIFEST_DIR"), "/clients/python"),
        )
        .output()
        .expect("run drill");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn elastic_the_preempted_node_leaves_and_the_other_resumes_from_the_saved_step() {
    let dir = tempfile::tempdir().unwrap();
    let (code, out, err) = elastic_drill(&standin_job(dir.path(), true, "1"), true, "1s");
    assert_eq!(code, 0, "{out}\n{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("one JSON document");
    let r = &doc["runs"][0];
    assert_eq!(r["pass"], true, "{r}");
    assert_eq!(r["elastic"], true);
    assert_eq!(r["interrupted_node"], 2);
    let saved = r["step_saved"].as_i64().unwrap();
    assert!(saved > 0, "{r}");
    assert_eq!(r["steps_lost"], 0, "{r}");
    assert_eq!(r["survivors"][0]["node"], 1);
    // Its first round after the notice starts from the step the preempted node saved.
    assert_eq!(r["survivors"][0]["first_resumed_step"], saved, "{r}");
    // The survivor trains on without the preempted node. Its first round after the notice may
    // still count that node (the stand-in's rendezvous is not c10d, so the launcher leaves the
    // entry to its heartbeat expiry, 1.5 s here; a round formed before then fails when the node
    // is gone and forms again, losing nothing), or the launcher may restart a healthy round once
    // more while that entry still waits (its workers then checkpoint on the SIGTERM, a step or
    // two past the saved one, and resume from there): the round that stuck is its last one, it
    // resumes from the saved step or later, and "training again" counts from it.
    let last = r["nodes"][0]["resumes"]
        .as_array()
        .and_then(|a| a.last())
        .expect("node 1 resumed");
    assert_eq!(last["world_size"], 2, "{r}");
    let resumed = r["survivors"][0]["resumed_step"].as_i64().unwrap();
    assert!(resumed >= saved, "{r}");
    assert_eq!(last["step"], resumed, "{r}");
    let again = r["training_again_s"].as_f64().unwrap();
    assert!(again > 0.0 && again < 30.0, "{r}");
    let stuck = r["survivors"][0]["resumed_s"].as_f64().unwrap();
    assert!((again - stuck).abs() < 1e-6, "{r}");
    assert!(stuck <= last["at_s"].as_f64().unwrap(), "{r}");
    assert_eq!(r["survivors"][0]["world_size"], 2, "{r}");
    // The preempted node left on its own (the launcher's 143), nothing was left to kill.
    let n2 = &r["nodes"][1];
    assert_eq!(n2["exit"]["code"], 143, "{r}");
    assert_eq!(n2["killed_at_power_off"], 0, "{r}");
    assert!(err.contains("[node 2] spotguard launch: notice"), "{err}");
}

#[test]
fn elastic_without_the_launcher_names_torchrun_restarting_the_workers() {
    let dir = tempfile::tempdir().unwrap();
    let (code, out, err) = elastic_drill(&standin_job(dir.path(), false, "3"), false, "5s");
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.contains("verdict: FAIL — torchrun restarted the workers on the preempted node"),
        "{out}"
    );
    assert!(out.contains("python3 -m spotguard launch"), "{out}");
    for row in [
        "step saved",
        "node left",
        "survivors resumed",
        "steps lost",
        "training again",
    ] {
        assert!(out.contains(row), "{row}:\n{out}");
    }
    let lost: i64 = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("steps lost"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("steps lost row");
    assert!(lost > 0, "{out}");
    // The power-off killed the node's whole tree: its agent and both workers, which run in
    // sessions of their own (like torch's) and so are not in the node's process group.
    let killed: usize = out
        .lines()
        .find_map(|l| l.split("still running at the power-off, ").nth(1))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("node left row");
    assert!(killed >= 3, "{out}");
}

#[test]
fn elastic_without_restarts_names_max_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let (code, out, err) = elastic_drill(&standin_job(dir.path(), false, "0"), false, "1s");
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("a survivor did not resume: node 1"), "{out}");
    assert!(out.contains("--max-restarts 0"), "{out}");
}

/// `--upload-to`: the bundled trainer saves to a local staged directory, acks staged and exits;
/// the agent uploads it into the directory; the drill reports the trainer's downtime and the
/// upload's time, bytes and verdict, as text and JSON.
#[test]
fn a_staged_checkpoint_is_rehearsed_with_a_local_destination() {
    let dest = tempfile::tempdir().unwrap();
    let to = dest.path().join("run1");
    let to = to.to_str().unwrap();
    let (code, out) = drill(&["--after", "1s", "--upload-to", to, "--staged-size", "8MiB"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("verdict: PASS"), "{out}");
    assert!(out.contains("trainer downtime"), "{out}");
    assert!(
        out.contains("badput: checkpoint save") && out.contains("nothing thrown away"),
        "{out}"
    );
    assert!(out.contains("upload "), "{out}");
    assert!(out.contains("published"), "{out}");
    let checkpoint = std::fs::read_dir(dest.path().join("run1"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join("manifest.json").exists())
        .unwrap_or_else(|| panic!("no published checkpoint:\n{out}"));
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(checkpoint.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["bytes"], 8 * 1024 * 1024 + 13, "{manifest}");

    let to = dest.path().join("run2");
    let (code, out) = drill(&[
        "--after",
        "1s",
        "--json",
        "--upload-to",
        to.to_str().unwrap(),
        "--staged-size",
        "4MiB",
    ]);
    assert_eq!(code, 0, "{out}");
    // stdout (the JSON) comes first, then the command's and the drill's stderr.
    let json: serde_json::Value = serde_json::Deserializer::from_str(&out)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("{out}"))
        .unwrap_or_else(|e| panic!("{e}: {out}"));
    let run = &json["runs"][0];
    assert_eq!(run["upload"]["outcome"], "published", "{run}");
    assert_eq!(run["upload"]["bytes"], 4 * 1024 * 1024 + 13, "{run}");
    assert!(run["upload"]["seconds"].as_f64().is_some(), "{run}");
    let downtime = run["downtime_s"].as_f64().unwrap();
    assert!(downtime > 0.0 && downtime < 10.0, "{run}");
}
