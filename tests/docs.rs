//! Documentation drift: every metric family registered in the source appears in docs/metrics.md,
//! and what a fresh agent and a host-mode plan export matches it; every log field the docs name
//! is on a real log line of that plan, in the shape the docs give; every `drill` message that
//! troubleshooting.md quotes is text the binary prints.

use std::path::Path;

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let p = entry.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_registered_metric_is_documented() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let docs = std::fs::read_to_string(root.join("docs/metrics.md")).unwrap();
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    let mut names = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        // `register(` / `register_with_unit(` / `sub-collectors` take the family name first.
        for (i, _) in text.match_indices("\"spotguard_") {
            let rest = &text[i + 1..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            let before = &text[..i];
            let registered = before
                .rfind("register")
                .is_some_and(|r| i - r < 80 && !before[r..].contains(';'));
            if registered && !name.ends_with('_') {
                names.push((name, f.display().to_string()));
            }
        }
    }
    assert!(names.len() > 30, "found only {} registrations", names.len());
    for (name, file) in names {
        let documented = docs.contains(&format!("`{name}`"))
            || docs.contains(&format!("`{name}_total`"))
            || docs.contains(&format!("`{name}_info`"))
            || docs.contains(&format!("{name}`"))
            || docs.contains(&format!("{name}_total`"));
        assert!(
            documented,
            "{name} (registered in {file}) is not in docs/metrics.md"
        );
    }
}

/// One documented family: a row of a table in docs/metrics.md.
struct Documented {
    name: String,
    kind: String,
    /// Label → documented values (empty: values found at run time).
    labels: Vec<(String, Vec<String>)>,
}

/// Backticked words in `s`.
fn ticked(s: &str) -> Vec<String> {
    s.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// Rows of the reference tables, except the per-GPU section (its series exist per GPU found).
fn documented_families(docs: &str) -> Vec<Documented> {
    let mut out = Vec::new();
    let mut section = "";
    for line in docs.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            section = h.trim();
            continue;
        }
        // GPU families exist only where NVML loads; prefetch families are the prefetcher
        // process's, not the agent's.
        if section == "GPU health"
            || section == "Dataset prefetch"
            || !line.starts_with("| `spotguard_")
        {
            continue;
        }
        let cols: Vec<&str> = line.split(" | ").collect();
        let (names, kind, labels) = (cols[0], cols[1].trim(), cols[2]);
        // `a` (`x`, `y`), `b` → [(a, [x, y]), (b, [])]
        let mut parsed: Vec<(String, Vec<String>)> = Vec::new();
        let mut rest = labels.trim();
        while let Some(start) = rest.find('`') {
            let after = &rest[start + 1..];
            let end = after.find('`').unwrap();
            let label = after[..end].to_string();
            rest = after[end + 1..].trim_start();
            let mut values = Vec::new();
            if let Some(inner) = rest.strip_prefix('(') {
                let close = inner.find(')').unwrap();
                values = ticked(&inner[..close]);
                rest = &inner[close + 1..];
            }
            parsed.push((label, values));
            rest = rest.trim_start_matches([',', ' ']);
        }
        for name in ticked(names.trim_start_matches('|')) {
            out.push(Documented {
                name,
                kind: kind.to_string(),
                labels: parsed.clone(),
            });
        }
    }
    out
}

/// Sorted label pairs of one series.
type Labels = Vec<(String, String)>;

/// `name{a="x",b="y"} value` → (name, sorted labels, value).
fn parse_sample(line: &str) -> Option<(String, Labels, f64)> {
    if line.starts_with('#') || line.is_empty() {
        return None;
    }
    let (series, value) = line.rsplit_once(' ')?;
    let (name, labels) = match series.split_once('{') {
        Some((n, l)) => (n, l.trim_end_matches('}')),
        None => (series, ""),
    };
    let mut pairs: Vec<(String, String)> = labels
        .split("\",")
        .filter(|p| !p.is_empty())
        .filter_map(|p| {
            let (k, v) = p.split_once('=')?;
            Some((k.to_string(), v.trim_matches('"').to_string()))
        })
        .collect();
    pairs.sort();
    Some((name.to_string(), pairs, value.parse().ok()?))
}

/// Every combination of the documented label values.
fn combinations(labels: &[(String, Vec<String>)]) -> Vec<Vec<(String, String)>> {
    let mut out: Vec<Vec<(String, String)>> = vec![Vec::new()];
    for (label, values) in labels {
        out = out
            .into_iter()
            .flat_map(|prefix| {
                values.iter().map(move |v| {
                    let mut next = prefix.clone();
                    next.push((label.clone(), v.clone()));
                    next
                })
            })
            .collect();
    }
    for combo in &mut out {
        combo.sort();
    }
    out
}

#[tokio::test]
async fn a_fresh_agent_exports_every_documented_series_at_zero() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let docs = std::fs::read_to_string(root.join("docs/metrics.md")).unwrap();
    let families = documented_families(&docs);
    assert!(
        families.len() > 20,
        "found only {} documented families",
        families.len()
    );

    // Host mode, cloud auto-detection that cannot succeed (no DMI, metadata endpoint refused): no
    // metadata poll ever happens, so every documented series must still be at its initial 0 (the
    // GPU families excepted: with --gpu off they are not exported).
    let dir = tempfile::tempdir().unwrap();
    let d = |p: &str| {
        let path = dir.path().join(p);
        std::fs::create_dir_all(&path).unwrap();
        path.display().to_string()
    };
    let argv = [
        "--mode=host".to_string(),
        "--cloud=auto".into(),
        format!("--dmi-dir={}", d("dmi")),
        "--metadata-endpoint=http://127.0.0.1:1".into(),
        format!("--checkpoint-dir={}", d("ckpt")),
        format!("--state-dir={}", d("state")),
        format!("--cache-dir={}", d("cache")),
        "--metrics-addr=127.0.0.1:0".into(),
        "--gpu=off".into(),
        "--log-level=error".into(),
        "--checkpoint-cmdline=^no-such-trainer$".into(),
    ];
    let args = spotguard::config::parse_run_args(argv).unwrap_or_else(|text| panic!("{text}"));
    let cfg = spotguard::config::Config::resolve(args, &spotguard::config::ProcessEnv).unwrap();
    let cancel = tokio_util::sync::CancellationToken::new();
    let app = spotguard::app::start(cfg, cancel.clone()).await.unwrap();
    let text = spotguard_testkit::metrics_text(app.admin_addr).await;
    cancel.cancel();
    let samples: Vec<_> = text.lines().filter_map(parse_sample).collect();

    let mut checked = 0;
    for f in &families {
        // --gpu off: no GPU family at all (docs/metrics.md says so), so that the GPU alert stays
        // silent where GPU health is off on purpose.
        if f.name.starts_with("spotguard_gpu_") {
            assert!(
                !samples.iter().any(|(n, _, _)| n.starts_with(&f.name)),
                "{} is exported with --gpu off",
                f.name
            );
            continue;
        }
        if f.kind == "info" || f.labels.iter().any(|(_, values)| values.is_empty()) {
            continue;
        }
        let series = if f.kind == "histogram" {
            format!("{}_count", f.name)
        } else {
            f.name.clone()
        };
        for combo in combinations(&f.labels) {
            let found = samples
                .iter()
                .find(|(n, l, _)| *n == series && *l == combo)
                .unwrap_or_else(|| {
                    panic!("{series}{combo:?} is documented but not exported by a fresh agent")
                });
            assert_eq!(found.2, 0.0, "{series}{combo:?} starts at {}", found.2);
            checked += 1;
        }
    }
    assert!(checked >= 100, "checked only {checked} series");
    // The reverse: no label value created at start-up that the docs do not list (series counted
    // since, like a detection error, carry run-time values).
    for (name, labels, _) in samples.iter().filter(|s| s.2 == 0.0) {
        let Some(f) = families.iter().find(|f| {
            *name == f.name || *name == format!("{}_count", f.name) && f.kind == "histogram"
        }) else {
            continue;
        };
        for (k, v) in labels {
            if let Some((_, values)) = f.labels.iter().find(|(l, _)| l == k) {
                assert!(
                    values.is_empty() || values.contains(v),
                    "{name} exports {k}={v:?}, which docs/metrics.md does not list"
                );
            }
        }
    }
}

/// How a shell block of docs/ is tested: the HTML comment on the line before its fence.
#[derive(Debug)]
enum Marker {
    /// `<!-- doc-test: run -->`: executed as written.
    Run,
    /// `<!-- doc-test: run with emulator CLOUD -->`: executed as written while `spotguard
    /// emulate --cloud CLOUD` listens at `$E`.
    RunWithEmulator(String),
    /// `<!-- doc-test: append PATH -->`: lines the reader pastes into PATH (a file of the sandbox).
    Append(String),
    /// `<!-- doc-test: skip: REASON -->`: cannot run here, and why.
    Skip,
}

/// One ```sh or ```console block.
struct ShellBlock {
    file: String,
    line: usize,
    marker: Marker,
    /// The commands (for `console`: the `$ ` lines and their continuations).
    script: String,
}

fn shell_blocks(root: &Path) -> (Vec<ShellBlock>, Vec<String>) {
    let mut blocks = Vec::new();
    let mut problems = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    files.sort();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let fence = lines[i].trim_start();
            let lang = fence.strip_prefix("```").unwrap_or("");
            if !fence.starts_with("```") || !matches!(lang, "sh" | "console" | "bash") {
                if fence.starts_with("```") {
                    // Skip over a block of another language.
                    i += 1;
                    while i < lines.len() && !lines[i].trim_start().starts_with("```") {
                        i += 1;
                    }
                }
                i += 1;
                continue;
            }
            let start = i + 1;
            let mut end = start;
            while end < lines.len() && !lines[end].trim_start().starts_with("```") {
                end += 1;
            }
            let body = &lines[start..end];
            let prev = if i > 0 { lines[i - 1].trim() } else { "" };
            let marker = prev
                .strip_prefix("<!-- doc-test:")
                .and_then(|m| m.strip_suffix("-->"))
                .map(str::trim);
            let marker = match marker {
                Some("run") => Some(Marker::Run),
                Some(m) if m.starts_with("run with emulator ") => Some(Marker::RunWithEmulator(
                    m["run with emulator ".len()..].trim().to_string(),
                )),
                Some(m) if m.starts_with("append ") => {
                    Some(Marker::Append(m["append ".len()..].trim().to_string()))
                }
                Some(m) if m.starts_with("skip:") && m.len() > "skip:".len() + 10 => {
                    Some(Marker::Skip)
                }
                _ => None,
            };
            match marker {
                None => problems.push(format!(
                    "docs/{name}:{}: a shell block without `<!-- doc-test: run -->`, `<!-- doc-test: append PATH -->` or `<!-- doc-test: skip: WHY -->` on the line before",
                    i + 1
                )),
                Some(marker) => {
                    let script = if lang == "console" {
                        let mut out = String::new();
                        let mut continued = false;
                        for l in body {
                            if let Some(cmd) = l.strip_prefix("$ ") {
                                out.push_str(cmd);
                            } else if continued {
                                out.push_str(l);
                            } else {
                                continue;
                            }
                            out.push('\n');
                            continued = l.ends_with('\\');
                        }
                        out
                    } else {
                        body.join("\n") + "\n"
                    };
                    blocks.push(ShellBlock {
                        file: name.clone(),
                        line: i + 1,
                        marker,
                        script,
                    });
                }
            }
            i = end + 1;
        }
    }
    (blocks, problems)
}

/// Every shell block of docs/ says how it is tested, and each one a reader runs as written runs
/// here: in doc order, per page in a sandbox standing in for the machine the page is about
/// (`/etc/spotguard/` is the sandbox's, holding the shipped env file as the install step puts
/// it; the state and notice dirs systemd makes are the sandbox's; `spotguard` is this build; the
/// working directory has the checkout's `examples/`).
#[test]
fn shell_blocks_in_docs_run_as_written() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (blocks, problems) = shell_blocks(root);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(
        blocks.len() > 20,
        "found only {} shell blocks",
        blocks.len()
    );
    let runnable = blocks
        .iter()
        .filter(|b| !matches!(b.marker, Marker::Skip))
        .count();
    assert!(runnable >= 4, "only {runnable} blocks run");
    let mut failures = Vec::new();
    let mut sandboxes: std::collections::HashMap<String, tempfile::TempDir> = Default::default();
    for b in &blocks {
        if matches!(b.marker, Marker::Skip) {
            continue;
        }
        let sandbox = sandboxes.entry(b.file.clone()).or_insert_with(|| {
            let s = tempfile::tempdir().unwrap();
            let p = s.path();
            for d in ["bin", "etc/spotguard", "work", "state", "run"] {
                std::fs::create_dir_all(p.join(d)).unwrap();
            }
            std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_spotguard"), p.join("bin/spotguard"))
                .unwrap();
            std::fs::copy(
                root.join("systemd/spotguard.env"),
                p.join("etc/spotguard/spotguard.env"),
            )
            .unwrap();
            std::os::unix::fs::symlink(root.join("examples"), p.join("work/examples")).unwrap();
            s
        });
        let s = sandbox.path();
        let local = |text: &str| {
            text.replace(
                "/etc/spotguard/",
                &format!("{}/etc/spotguard/", s.display()),
            )
        };
        match &b.marker {
            Marker::Append(path) => {
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .append(true)
                    .create(true)
                    .open(local(path))
                    .unwrap();
                f.write_all(b.script.as_bytes()).unwrap();
            }
            Marker::Run | Marker::RunWithEmulator(_) => {
                let emulator = match &b.marker {
                    Marker::RunWithEmulator(cloud) => Some(Emulate::start(cloud)),
                    _ => None,
                };
                let mut c = std::process::Command::new("bash");
                c.args(["-e", "-o", "pipefail", "-c", &local(&b.script)])
                    .current_dir(s.join("work"));
                for (k, _) in std::env::vars() {
                    if k.starts_with("SPOTGUARD_") || k == "KUBECONFIG" || k == "NODE_NAME" {
                        c.env_remove(k);
                    }
                }
                let path = format!(
                    "{}:{}",
                    s.join("bin").display(),
                    std::env::var("PATH").unwrap_or_default()
                );
                c.env("PATH", path)
                    .env("SPOTGUARD_STATE_DIR", s.join("state"))
                    .env("SPOTGUARD_CHECKPOINT_DIR", s.join("run"));
                if let Some(e) = &emulator {
                    c.env("E", &e.url);
                }
                let o = c.output().unwrap();
                drop(emulator);
                if !o.status.success() {
                    failures.push(format!(
                        "docs/{}:{}: exit {:?}\n{}\n--- stdout\n{}\n--- stderr\n{}",
                        b.file,
                        b.line,
                        o.status.code(),
                        b.script,
                        String::from_utf8_lossy(&o.stdout),
                        String::from_utf8_lossy(&o.stderr)
                    ));
                }
            }
            Marker::Skip => {}
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// `spotguard emulate` listening on a free local port (stopped when dropped).
struct Emulate {
    child: std::process::Child,
    url: String,
}

impl Emulate {
    fn start(cloud: &str) -> Emulate {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_spotguard"))
            .args(["emulate", "--cloud", cloud, "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut e = Emulate {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        // Until it accepts connections (or has exited: then the block's requests fail).
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if e.child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        e
    }
}

impl Drop for Emulate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sections of docs/metrics.md that a host-mode plan does not exercise, and why.
const NOT_IN_A_HOST_PLAN: &[(&str, &str)] = &[
    (
        "Checkpoint upload",
        "needs a staged checkpoint and an object store",
    ),
    (
        "Checkpoint relay",
        "needs a peer agent and a staged checkpoint",
    ),
    (
        "Node and drain",
        "needs Kubernetes (host mode counts only `drain`, checked below)",
    ),
    (
        "GPU health",
        "needs a GPU (with `--gpu off`, none is exported)",
    ),
    (
        "Dataset prefetch",
        "exported by the prefetcher's process, not the agent",
    ),
];

/// What one documented series must read after one acknowledged EC2 interruption in host mode.
enum After {
    /// Exactly this value.
    Is(f64),
    /// More than 0.
    Positive,
}

/// The notice, checkpoint and plan series a host-mode interruption moves (`_count` of a
/// histogram: one observation).
/// A series: its name and (sorted) labels.
type Series = (&'static str, &'static [(&'static str, &'static str)]);

const PLAN_SERIES: &[(Series, After)] = &[
    (
        ("spotguard_metadata_polls_total", &[("source", "aws")]),
        After::Positive,
    ),
    (
        (
            "spotguard_notices_total",
            &[("kind", "interruption"), ("source", "aws")],
        ),
        After::Is(1.0),
    ),
    (
        (
            "spotguard_notice_to_signal_seconds_count",
            &[("source", "aws")],
        ),
        After::Is(1.0),
    ),
    (
        ("spotguard_notice_active", &[("kind", "interruption")]),
        After::Is(0.0),
    ),
    (
        ("spotguard_notice_deadline_timestamp_seconds", &[]),
        After::Positive,
    ),
    (
        ("spotguard_checkpoint_total", &[("outcome", "acked")]),
        After::Is(1.0),
    ),
    (("spotguard_checkpoint_signals_total", &[]), After::Is(1.0)),
    (
        ("spotguard_checkpoint_ack_latency_seconds_count", &[]),
        After::Is(1.0),
    ),
    (
        ("spotguard_checkpoint_headroom_seconds_count", &[]),
        After::Is(1.0),
    ),
    (
        ("spotguard_checkpoint_last_duration_seconds", &[]),
        After::Positive,
    ),
    (
        ("spotguard_checkpoint_last_budget_seconds", &[]),
        After::Positive,
    ),
    (
        ("spotguard_checkpoint_last_acked_step", &[]),
        After::Is(1.0),
    ),
    (
        ("spotguard_plans_total", &[("outcome", "completed")]),
        After::Is(1.0),
    ),
    (
        (
            "spotguard_node_actions_total",
            &[("action", "drain"), ("outcome", "ok")],
        ),
        After::Is(1.0),
    ),
    (
        (
            "spotguard_node_actions_total",
            &[("action", "protect"), ("outcome", "ok")],
        ),
        After::Is(0.0),
    ),
    (
        (
            "spotguard_errors_total",
            &[("error", "none"), ("module", "checkpoint")],
        ),
        After::Is(0.0),
    ),
];

/// How a documented log field's value reads.
#[derive(Debug, Clone, Copy)]
enum Shape {
    /// A string in the settings' duration format (`"10s"`, `"17s 271ms"`).
    Duration,
    /// A whole number of milliseconds (`_ms`).
    Millis,
    /// The id the checkpoint dir's `notice.json` carries.
    NoticeId,
}

/// Log fields the docs name, the line a plan run shows them on, and their shape.
const LOG_FIELDS: &[(&str, &str, Shape)] = &[
    // operators-guide.md, Logs: `"interval":"10s"`.
    ("interval", "notice monitor started", Shape::Duration),
    // operators-guide.md, Logs: `"retry_in":"17s 271ms"`.
    ("retry_in", "metadata poll failed", Shape::Duration),
    // architecture.md: `seen_after_ms` of the `notice accepted` line.
    ("seen_after_ms", "notice accepted", Shape::Millis),
    // checkpoint-protocol.md, training-integration.md: `notice_id`, as in notice.json.
    ("notice_id", "notice accepted", Shape::NoticeId),
];

/// Log fields the docs name that a plan run does not log, and where they are checked instead; and
/// names the docs write like log fields that are fields of other JSON.
const LOG_FIELDS_ELSEWHERE: &[(&str, &str)] = &[
    ("retry_in_ms", "cloud auto-detection's retry: tests/logs.rs"),
    (
        "retry_in_s",
        "prefetch-serve's restart of the prefetcher process",
    ),
    // Named in docs in the same forms, but not log fields.
    ("downtime_s", "a `drill --json` field: tests/drill.rs"),
    ("part", "a field of a staged ack: src/upload/ack.rs"),
    ("step", "a field of the ack file: tests/checkpoint.rs"),
];

/// Field names the docs give for log lines: `"name":…` examples and `name_ms` / `name_s`.
fn documented_log_fields(root: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(root.join("docs")).unwrap().flatten() {
        let file = entry.file_name().to_string_lossy().to_string();
        if file == "metrics.md" || !file.ends_with(".md") {
            continue;
        }
        let text = std::fs::read_to_string(entry.path()).unwrap();
        for (i, line) in text.lines().enumerate() {
            for word in ticked(line) {
                let name = match word.strip_prefix('"').and_then(|w| w.split_once("\":")) {
                    Some((name, _)) => name.to_string(),
                    None if (word.ends_with("_ms") || word.ends_with("_s"))
                        && word.chars().all(|c| c.is_ascii_lowercase() || c == '_') =>
                    {
                        word.clone()
                    }
                    None => continue,
                };
                out.push((name, format!("docs/{file}:{}", i + 1)));
            }
        }
    }
    out
}

/// The trainer: catches SIGUSR1 and acknowledges `done` at step 1 in `$SPOTGUARD_DIR`.
const ACKING_TRAINER: &str = r#"
trap 'printf '"'"'{"state":"done","step":1,"checkpoint":"ckpt-1","ts":%s}'"'"' $(date +%s.%N) > "$SPOTGUARD_DIR/.ack.tmp"; mv "$SPOTGUARD_DIR/.ack.tmp" "$SPOTGUARD_DIR/ack-$$.json"' USR1
while :; do sleep 0.05; done
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_exports_and_logs_what_the_docs_name() {
    use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig, Fault};
    use std::io::BufRead;
    use std::time::Duration;

    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let docs = std::fs::read_to_string(root.join("docs/metrics.md")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let d = |p: &str| {
        let path = tmp.path().join(p);
        std::fs::create_dir_all(&path).unwrap();
        path
    };
    let ckpt = d("ckpt");
    let mut trainer = tokio::process::Command::new("bash")
        .arg("-c")
        .arg(ACKING_TRAINER)
        .env("SPOTGUARD_DIR", &ckpt)
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = trainer.id().unwrap();
    for _ in 0..400 {
        if spotguard_testkit::process::catches_usr1(pid) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        spotguard_testkit::process::catches_usr1(pid),
        "trainer did not start"
    );
    let pidfile = tmp.path().join("trainer.pid");
    std::fs::write(&pidfile, pid.to_string()).unwrap();

    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    // The first poll fails: its line carries `retry_in`.
    emu.fault(Fault::error(500).times(1)).unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_spotguard"));
    cmd.args([
        "run".to_string(),
        "--mode=host".into(),
        "--cloud=aws".into(),
        format!("--metadata-endpoint={}", emu.base_url()),
        "--poll-interval=200ms".into(),
        "--checkpoint-timeout=20s".into(),
        format!("--checkpoint-dir={}", ckpt.display()),
        format!("--state-dir={}", d("state").display()),
        format!("--cache-dir={}", d("cache").display()),
        format!("--checkpoint-pidfile={}", pidfile.display()),
        "--metrics-addr=127.0.0.1:0".into(),
        "--gpu=off".into(),
        "--log-format=json".into(),
        "--log-level=info".into(),
        "--shutdown-grace=2s".into(),
    ]);
    for (k, _) in std::env::vars() {
        if k.starts_with("SPOTGUARD_") || k == "KUBECONFIG" || k == "NODE_NAME" || k == "RUST_LOG" {
            cmd.env_remove(k);
        }
    }
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let mut agent = cmd.spawn().unwrap();
    let stderr = agent.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<serde_json::Value>();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let v =
                serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
            if tx.send(v).is_err() {
                break;
            }
        }
    });
    let mut lines: Vec<serde_json::Value> = Vec::new();
    let mut until = |message: &str| -> serde_json::Value {
        loop {
            let v = rx
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("no {message:?} line; lines so far: {lines:#?}"));
            lines.push(v.clone());
            if v["message"] == message {
                return v;
            }
        }
    };
    let started = until("spotguard started");
    let metrics_addr: std::net::SocketAddr = started["metrics"].as_str().unwrap().parse().unwrap();
    emu.raise(EmulatedNotice::interruption()).unwrap();
    let outcome = until("plan outcome");
    assert_eq!(outcome["outcome"], "completed", "{outcome}");
    let text = spotguard_testkit::metrics_text(metrics_addr).await;
    unsafe {
        libc::kill(agent.id() as i32, libc::SIGTERM);
    }
    until("all tasks stopped");
    let _ = agent.wait();
    let _ = trainer.start_kill();
    emu.shutdown().await;

    // Metrics: each series the plan moves reads as documented.
    let samples: Vec<_> = text.lines().filter_map(parse_sample).collect();
    let families = documented_families(&docs);
    for ((series, labels), after) in PLAN_SERIES {
        let base = series.trim_end_matches("_count");
        assert!(
            families.iter().any(|f| f.name == *series
                || f.name == base
                || format!("{}_total", f.name) == *series),
            "{series} is checked here but docs/metrics.md has no row for it"
        );
        let want: Labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let (_, _, value) = samples
            .iter()
            .find(|(n, l, _)| n == series && *l == want)
            .unwrap_or_else(|| panic!("{series}{want:?} not exported after a plan:\n{text}"));
        match after {
            After::Is(v) => assert_eq!(value, v, "{series}{want:?}"),
            After::Positive => assert!(*value > 0.0, "{series}{want:?} = {value}"),
        }
    }
    // And the reverse: every family exported is documented, in a section the plan covers or in
    // one of those it does not (listed with the reason).
    let mut section = "";
    let mut documented: Vec<(String, String)> = Vec::new();
    for line in docs.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            section = h.trim();
        } else if line.starts_with("| `spotguard_") {
            let names = line.split(" | ").next().unwrap();
            documented.extend(ticked(names).into_iter().map(|n| (n, section.to_string())));
        }
    }
    for (excluded, why) in NOT_IN_A_HOST_PLAN {
        assert!(
            documented.iter().any(|(_, s)| s == excluded),
            "section {excluded:?} ({why}) is gone from docs/metrics.md: update this test"
        );
    }
    for (name, _, _) in &samples {
        let family = ["_total", "_count", "_sum", "_bucket", "_created"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        assert!(
            documented
                .iter()
                .any(|(n, _)| n == family || n == name || *n == format!("{family}_total")),
            "{name} is exported by a plan but docs/metrics.md does not document it"
        );
    }

    // Logs: each field the docs name is on its line, in the documented shape.
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("notice.json")).unwrap()).unwrap();
    for (field, message, shape) in LOG_FIELDS {
        let line = lines
            .iter()
            .find(|v| v["message"] == *message && !v[field].is_null())
            .unwrap_or_else(|| panic!("no {message:?} line with {field:?} in {lines:#?}"));
        let value = &line[field];
        match shape {
            Shape::Duration => {
                let s = value
                    .as_str()
                    .unwrap_or_else(|| panic!("{field}: {value} is not a string"));
                let d = spotguard::duration::parse(s).unwrap_or_else(|e| {
                    panic!("{field}={s:?} is not in the settings' format: {e}")
                });
                // "whole milliseconds from a second up"
                assert!(
                    d < Duration::from_secs(1) || d.subsec_nanos() % 1_000_000 == 0,
                    "{field}={s:?}: not whole milliseconds"
                );
            }
            Shape::Millis => assert!(
                value.is_u64() || value.is_i64(),
                "{field}: {value} is not a whole number"
            ),
            Shape::NoticeId => assert_eq!(
                value, &written["notice_id"],
                "{field} differs from notice.json's"
            ),
        }
    }
    for (field, at) in documented_log_fields(root) {
        assert!(
            LOG_FIELDS.iter().any(|(f, _, _)| *f == field)
                || LOG_FIELDS_ELSEWHERE.iter().any(|(f, _)| *f == field),
            "{at} names the log field {field:?}, which no test checks: add it to LOG_FIELDS"
        );
    }
}

/// The messages a table cell quotes: its code spans (`` `…` `` or ``` ``…`` ```, the second for a
/// message that holds backticks); a `verdict` or `warning` word before one is not part of it.
fn quoted(cell: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = cell;
    while let Some(i) = rest.find('`') {
        let fence = if rest[i..].starts_with("``") {
            "``"
        } else {
            "`"
        };
        let body = &rest[i + fence.len()..];
        let Some(j) = body.find(fence) else { break };
        out.push(body[..j].trim().to_string());
        rest = &body[j + fence.len()..];
    }
    out
}

/// Every message troubleshooting.md's `spotguard drill` table quotes is one the binary prints:
/// split at what varies (`…`, `{name}`, `N`, `M`, a signal's name), each fixed piece is text of
/// the source under src/. A user who searches the docs for the line in front of them finds it.
#[test]
fn drill_messages_in_troubleshooting_are_the_binarys() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    let source: String = files
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap())
        .collect();
    let doc = std::fs::read_to_string(root.join("docs/troubleshooting.md")).unwrap();
    let (_, section) = doc
        .split_once("### `spotguard drill`\n")
        .expect("troubleshooting.md has no `spotguard drill` section");
    let section = section.split("\n#").next().unwrap();
    let varies = regex::Regex::new(r"…|\{[a-z_]+\}|\bN\b|\bM\b|\bSIG[A-Z0-9]+\b").unwrap();
    let mut checked = 0;
    let mut missing = Vec::new();
    for row in section.lines().filter(|l| l.starts_with("| ")) {
        let cell = row[2..].split(" | ").next().unwrap();
        for message in quoted(cell) {
            if message == "message" {
                continue;
            }
            checked += 1;
            for piece in varies.split(&message).map(str::trim) {
                if piece.chars().count() >= 3 && !source.contains(piece) {
                    missing.push(format!("{message:?}: {piece:?}"));
                }
            }
        }
    }
    assert!(checked >= 20, "only {checked} messages quoted");
    assert!(
        missing.is_empty(),
        "troubleshooting.md quotes text the binary does not print:\n{}",
        missing.join("\n")
    );
}

/// Where the chart's install notes send a reader (`docs/FILE.md ("Section")`), that section is.
#[test]
fn the_charts_notes_point_to_sections_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let notes = std::fs::read_to_string(root.join("charts/spotguard/templates/NOTES.txt")).unwrap();
    let reference = regex::Regex::new(r#"(docs/[a-z-]+\.md) \("([^"]+)"\)"#).unwrap();
    let mut checked = 0;
    for c in reference.captures_iter(&notes) {
        checked += 1;
        let doc = std::fs::read_to_string(root.join(&c[1]))
            .unwrap_or_else(|e| panic!("NOTES.txt names {}: {e}", &c[1]));
        let heading = doc
            .lines()
            .any(|l| l.starts_with('#') && l.trim_start_matches('#').trim() == &c[2]);
        assert!(
            heading,
            "NOTES.txt points to {} (\"{}\"), which has no such section",
            &c[1], &c[2]
        );
    }
    assert!(checked > 0, "NOTES.txt names no section");
}
