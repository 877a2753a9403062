//! The agent's logs as a log pipeline sees them: JSON values are typed (numbers, booleans,
//! RFC 3339 times, no Rust Debug strings), text has no ANSI escapes when stderr is not a terminal,
//! a fatal error is one line, and the first line is the effective configuration.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn base(dir: &std::path::Path) -> Vec<String> {
    let d = |p: &str| {
        let path = dir.join(p);
        std::fs::create_dir_all(&path).unwrap();
        path.display().to_string()
    };
    vec![
        "run".into(),
        "--mode=host".into(),
        "--cloud=auto".into(),
        format!("--dmi-dir={}", d("dmi")),
        "--metadata-endpoint=http://127.0.0.1:1".into(),
        format!("--checkpoint-dir={}", d("ckpt")),
        format!("--state-dir={}", d("state")),
        format!("--cache-dir={}", d("cache")),
        "--gpu=off".into(),
        // Host mode needs a target; this one matches nothing.
        "--checkpoint-cmdline=^no-such-trainer$".into(),
    ]
}

fn command(args: &[String]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_spotguard"));
    c.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("SPOTGUARD_") || k == "KUBECONFIG" || k == "NODE_NAME" || k == "RUST_LOG" {
            c.env_remove(k);
        }
    }
    c.stdout(Stdio::null()).stderr(Stdio::piped());
    c
}

/// Run the agent for `secs`, then SIGTERM it; its stderr.
fn run_for(args: &[String], secs: u64) -> Output {
    let child = command(args).spawn().unwrap();
    std::thread::sleep(Duration::from_secs(secs));
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    child.wait_with_output().unwrap()
}

fn lines(o: &Output) -> Vec<String> {
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .map(str::to_string)
        .collect()
}

/// Any string value that looks like Rust's Debug output of an Option, Duration or Vec.
fn debug_strings(v: &serde_json::Value, path: &str, out: &mut Vec<String>) {
    match v {
        serde_json::Value::String(s) => {
            let debugish = s.starts_with("Some(")
                || s == "None"
                || (s.starts_with('[') && s.ends_with(']'))
                || s.ends_with("ms") && s[..s.len() - 2].parse::<f64>().is_ok();
            if debugish {
                out.push(format!("{path}={s:?}"));
            }
        }
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                debug_strings(v, &format!("{path}.{k}"), out);
            }
        }
        serde_json::Value::Array(a) => {
            for v in a {
                debug_strings(v, path, out);
            }
        }
        _ => {}
    }
}

#[test]
fn json_lines_are_typed_and_start_with_the_effective_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = base(dir.path());
    args.extend([
        "--log-format=json".into(),
        "--metrics-addr=127.0.0.1:0".into(),
        "--dry-run".into(),
    ]);
    // Auto-detection fails every 2 s: the retry line carries a duration.
    let o = run_for(&args, 3);
    let lines = lines(&o);
    assert!(lines.len() >= 3, "{lines:?}");
    let parsed: Vec<serde_json::Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let mut bad = Vec::new();
    for v in &parsed {
        debug_strings(v, "", &mut bad);
        let ts = v["timestamp"].as_str().unwrap();
        ts.parse::<jiff::Timestamp>()
            .unwrap_or_else(|e| panic!("timestamp {ts:?} is not RFC 3339: {e}"));
        // Dependencies log at warn and above only.
        let target = v["target"].as_str().unwrap_or_default();
        if !target.starts_with("spotguard") {
            assert!(
                matches!(v["level"].as_str(), Some("WARN" | "ERROR")),
                "dependency log below warn: {v}"
            );
        }
    }
    assert!(bad.is_empty(), "Debug-formatted values: {bad:?}");

    let first = &parsed[0];
    assert_eq!(first["message"], "effective configuration", "{first}");
    let settings = first["settings"].as_str().unwrap();
    assert!(settings.contains("dry-run=true (flag)"), "{settings}");
    assert!(
        settings.contains("poll-interval=1s (default)"),
        "{settings}"
    );

    let started = parsed
        .iter()
        .find(|v| v["message"] == "spotguard started")
        .expect("no start line");
    assert_eq!(started["dry_run"], serde_json::json!(true));
    let retry = parsed
        .iter()
        .find(|v| v["retry_in_ms"].is_number())
        .unwrap_or_else(|| panic!("no typed retry_in_ms in {lines:?}"));
    assert!(retry["retry_in_ms"].as_u64().unwrap() >= 1000);
}

#[test]
fn text_logs_have_no_ansi_when_stderr_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = base(dir.path());
    args.extend([
        "--log-format=text".into(),
        "--metrics-addr=127.0.0.1:0".into(),
    ]);
    let o = run_for(&args, 1);
    let text = String::from_utf8_lossy(&o.stderr);
    assert!(text.contains("spotguard started"), "{text}");
    assert!(!text.contains('\u{1b}'), "ANSI escapes in {text:?}");
}

#[test]
fn a_fatal_error_is_one_line() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    for format in ["json", "text"] {
        let dir = tempfile::tempdir().unwrap();
        let mut args = base(dir.path());
        args.extend([
            format!("--log-format={format}"),
            format!("--metrics-addr={addr}"),
        ]);
        let o = command(&args).output().unwrap();
        assert_eq!(
            o.status.code(),
            Some(1),
            "{format}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let lines = lines(&o);
        let fatal: Vec<_> = lines
            .iter()
            .filter(|l| l.contains("binding the metrics server"))
            .collect();
        assert_eq!(fatal.len(), 1, "{format}: {lines:?}");
        assert!(
            !lines.iter().any(|l| l.contains('\u{1b}')),
            "{format}: {lines:?}"
        );
    }
}

/// The `notice accepted` line carries the event id of the cloud's own answer where the cloud sends
/// one (Azure Scheduled Events and EC2 scheduled events: `EventId`), the id `spotguard emulate`
/// answers when it raises the event; where the answer carries none (EC2 spot interruption, GCE)
/// the line has no such field rather than a made-up one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notice_accepted_names_the_clouds_event_id_where_it_sends_one() {
    use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
    use std::io::BufRead;
    for (cloud, notice, sends_id) in [
        (Cloud::Azure, EmulatedNotice::interruption(), true),
        (Cloud::Aws, EmulatedNotice::maintenance(), true),
        (Cloud::Aws, EmulatedNotice::interruption(), false),
        (Cloud::Gce, EmulatedNotice::interruption(), false),
    ] {
        let emu = emulator::start(EmulatorConfig::new(cloud)).await.unwrap();
        let raised = emu.raise(notice).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut args: Vec<String> = base(dir.path())
            .into_iter()
            .filter(|a| !a.starts_with("--cloud=") && !a.starts_with("--metadata-endpoint="))
            .collect();
        args.extend([
            format!("--cloud={}", cloud.as_str()),
            format!("--metadata-endpoint={}", emu.base_url()),
            "--poll-interval=200ms".into(),
            "--log-format=json".into(),
            "--log-level=info".into(),
            "--metrics-addr=127.0.0.1:0".into(),
            "--dry-run".into(),
        ]);
        let mut child = command(&args).spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut seen = Vec::new();
        let accepted = loop {
            let line = rx
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("{cloud:?}: no notice accepted line in {seen:#?}"));
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            if v["message"] == "notice accepted" {
                break v;
            }
            seen.push(line);
        };
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        let _ = child.wait();
        emu.shutdown().await;
        if sends_id {
            assert_eq!(
                accepted["cloud_event_id"], raised.id,
                "{cloud:?}: {accepted}"
            );
        } else {
            assert!(
                accepted.get("cloud_event_id").is_none(),
                "{cloud:?}: {accepted}"
            );
        }
    }
}
