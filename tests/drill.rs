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

#[test]
fn bundled_trainer_passes_on_every_cloud() {
    for cloud in ["aws", "gce", "azure"] {
        let (code, out) = drill(&["--cloud", cloud, "--after", "1s"]);
        assert_eq!(code, 0, "{cloud}:\n{out}");
        assert!(out.contains("verdict: PASS"), "{cloud}:\n{out}");
        assert!(out.contains("signal sent"), "{out}");
        assert!(out.contains("state=done"), "{out}");
        assert!(out.contains("command exit         143"), "{out}");
    }
}

#[test]
fn python_example_passes_and_shows_its_ack() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/train_loop.py");
    let (code, out) = drill(&["--after", "2s", "--", "python3", example]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("verdict: PASS"), "{out}");
    assert!(out.contains("state=done"), "{out}");
}

#[test]
fn a_command_without_a_handler_fails_with_a_hint() {
    let (code, out) = drill(&["--after", "1s", "--timeout", "3s", "--", "sleep", "60"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("verdict: FAIL"), "{out}");
    assert!(out.contains("no_handler"), "{out}");
}

#[test]
fn a_checkpoint_that_does_not_fit_the_gce_budget_fails() {
    // The trainer needs 40 s to save; GCE gives 30 s − 8 s reserve.
    let (code, out) = drill(&[
        "--cloud",
        "gce",
        "--after",
        "1s",
        "--",
        env!("CARGO_BIN_EXE_spotguard"),
        "example-trainer",
        "--save-time",
        "40s",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("timeout"), "{out}");
}
