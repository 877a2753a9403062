//! The agent's logs as a log pipeline sees them: JSON values are typed (numbers, booleans,
//! RFC 3339 times, no Rust Debug strings), text has no ANSI escapes when stderr is not a terminal,
//! a fatal error is one line, the first line is the effective configuration, and every line of a
//! whole plan is one JSON object with unique keys (no field of ours named `target`).

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

/// A JSON value whose every object has unique keys: a log pipeline's parser keeps one of two
/// equal keys, so a line with two (`target` beside tracing's own) loses one.
struct UniqueKeys;

impl<'de> serde::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UniqueKeys)
    }
}

impl<'de> serde::de::Visitor<'de> for UniqueKeys {
    type Value = UniqueKeys;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self, E> {
        Ok(UniqueKeys)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self, E> {
        Ok(UniqueKeys)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self, E> {
        Ok(UniqueKeys)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self, E> {
        Ok(UniqueKeys)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self, E> {
        Ok(UniqueKeys)
    }
    fn visit_unit<E>(self) -> Result<Self, E> {
        Ok(UniqueKeys)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self, A::Error> {
        while seq.next_element::<UniqueKeys>()?.is_some() {}
        Ok(UniqueKeys)
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self, A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(serde::de::Error::custom(format!("duplicate key {key:?}")));
            }
            map.next_value::<UniqueKeys>()?;
        }
        Ok(UniqueKeys)
    }
}

/// A log line that is one JSON object with unique keys at every level; the error says why not.
fn strict_object(line: &str) -> Result<(), String> {
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    if !v.is_object() {
        return Err("not an object".into());
    }
    serde_json::from_str::<UniqueKeys>(line)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[test]
fn the_strict_parse_refuses_a_duplicate_key() {
    assert!(strict_object(r#"{"target":"spotguard::x","a":{"b":1,"c":[{"d":2}]}}"#).is_ok());
    let e = strict_object(r#"{"target":"spotguard::x","fields":1,"target":"ns/pod"}"#).unwrap_err();
    assert!(e.contains("duplicate key \"target\""), "{e}");
    assert!(strict_object(r#"{"a":[{"k":1,"k":2}]}"#).is_err());
    assert!(strict_object("[1]").is_err());
}

/// An agent taken through a whole plan with JSON logs (a notice, a trainer signalled, its
/// checkpoint's end, the plan's end): every line it writes is one JSON object with unique keys,
/// and the checkpoint's lines name the target group as `target_group`, beside tracing's `target`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_json_line_of_a_plan_has_unique_keys() {
    use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
    use spotguard_testkit::process::{catches_usr1, Kid};
    use spotguard_testkit::wait::eventually_blocking;
    use std::io::BufRead;

    // A trainer that catches the signal and exits on it. The regex below matches its command
    // line and not the agent's own (where the parenthesis is escaped).
    let mut trainer = Command::new("sh");
    trainer.args([
        "-c",
        "trap 'exit 0' USR1; : 'logs-trainer(x)'; while :; do sleep 0.1; done",
    ]);
    let mut trainer = Kid::spawn(trainer);
    let pid = trainer.pid();
    eventually_blocking("the trainer's USR1 trap", Duration::from_secs(10), || {
        catches_usr1(pid)
    });

    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = base(dir.path())
        .into_iter()
        .filter(|a| {
            !a.starts_with("--cloud=")
                && !a.starts_with("--metadata-endpoint=")
                && !a.starts_with("--checkpoint-cmdline=")
        })
        .collect();
    args.extend([
        "--cloud=aws".into(),
        format!("--metadata-endpoint={}", emu.base_url()),
        "--poll-interval=200ms".into(),
        r"--checkpoint-cmdline=logs-trainer\(x\)".into(),
        "--log-format=json".into(),
        "--log-level=debug".into(),
        "--metrics-addr=127.0.0.1:0".into(),
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
    let mut lines: Vec<String> = Vec::new();
    let next = |lines: &mut Vec<String>, what: &str| {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("no {what} line in {lines:#?}"));
        lines.push(line);
    };
    while !lines.iter().any(|l| l.contains("\"spotguard started\"")) {
        next(&mut lines, "start");
    }
    emu.raise(EmulatedNotice::interruption()).unwrap();
    while !lines.iter().any(|l| l.contains("\"checkpoint finished\"")) {
        next(&mut lines, "checkpoint finished");
    }
    trainer.wait();
    // The plan goes on to its end; the agent then exits, or is told to.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    lines.extend(rx.iter());
    let _ = child.wait();
    emu.shutdown().await;

    let bad: Vec<String> = lines
        .iter()
        .filter_map(|l| strict_object(l).err().map(|e| format!("{e}: {l}")))
        .collect();
    assert!(
        bad.is_empty(),
        "log lines a pipeline misreads:\n{}",
        bad.join("\n")
    );
    for message in ["checkpoint signal sent", "checkpoint finished"] {
        let v: serde_json::Value = lines
            .iter()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .find(|v| v["message"] == message)
            .unwrap_or_else(|| panic!("no {message:?} line in {lines:#?}"));
        // The checkpoint span's fields (JSON logs: the current span, under `span`).
        let group = v["span"]["target_group"]
            .as_str()
            .unwrap_or_else(|| panic!("{message:?} without span.target_group: {v}"));
        assert!(group.starts_with("cmdline:"), "{v}");
        assert!(
            v["target"].as_str().unwrap().starts_with("spotguard"),
            "{v}"
        );
    }
}

/// A tracing field named `target` (`target = …` or the shorthand `target,`) in any macro under
/// src/ collides with tracing's own `target` (the module path) in every JSON line: the target
/// group is `target_group`. (`target: "…"`, the macro's own target, is tracing's and allowed.)
#[test]
fn no_tracing_field_is_named_target() {
    let field = regex::Regex::new(r"(?:^|[(,{]\s*)[%?]?target\s*(?:=[^=]|[,)}])").unwrap();
    let macro_start = regex::Regex::new(
        r"\b(?:trace|debug|info|warn|error|event|span|trace_span|debug_span|info_span|warn_span|error_span)!\s*\(|\bfields\s*\(",
    )
    .unwrap();
    let mut found = Vec::new();
    let mut stack = vec![spotguard_testkit::assets::repo_root().join("src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for m in macro_start.find_iter(&text) {
                let args = balanced(&text[m.end()..]);
                if field.is_match(&without_strings(args)) {
                    let line = text[..m.start()].lines().count().max(1);
                    found.push(format!("{}:{line}: {}", path.display(), m.as_str()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "tracing fields named `target` (name it `target_group`):\n{}",
        found.join("\n")
    );
}

/// The text up to the parenthesis that closes the one just opened.
fn balanced(text: &str) -> &str {
    let mut depth = 1;
    let mut in_str = false;
    let mut escaped = false;
    for (i, c) in text.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_str => escaped = true,
            '"' => in_str = !in_str,
            '(' if !in_str => depth += 1,
            ')' if !in_str => {
                depth -= 1;
                if depth == 0 {
                    return &text[..i];
                }
            }
            _ => {}
        }
    }
    text
}

/// `text` with the contents of its string literals and its `//` comments blanked (a message or
/// a comment may say "target =", and a comment line may stand between two fields).
fn without_strings(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_str = false;
    let mut escaped = false;
    let mut comment = false;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\n' if comment => {
                comment = false;
                out.push(c);
            }
            _ if comment => {}
            _ if escaped => escaped = false,
            '\\' if in_str => escaped = true,
            '"' => {
                in_str = !in_str;
                out.push('"');
            }
            _ if in_str => {}
            '/' if chars.peek() == Some(&'/') => comment = true,
            _ => out.push(c),
        }
    }
    out
}
