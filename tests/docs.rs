//! Documentation drift: every metric family registered in the source appears in docs/metrics.md.

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
