//! A restart never publishes less than was taken: an upload is interrupted by SIGKILL in the
//! middle (the store holds every part after the first, so the kill finds it exactly there),
//! then the files, the journal or the clock move on while nothing runs, and the agent — the
//! real `spotguard run`, every capability dropped but KILL and SYS_PTRACE as shipped — starts
//! on the same state directory. What it finds it must not resume: it publishes nothing, reports
//! the upload `interrupted` (with the error's metric), aborts every multipart upload the
//! interrupted run left in the store (s3s-fs keeps them as `.upload*` files in its root) and
//! removes the journal.
//!
//! The interrupted run is `spotguard upload --state-dir` (the same engine and journal as the
//! agent's own uploads; its staged tree is on the host's filesystem, as a host-mode trainer's).
//!
//! Needs root, `setpriv` and `s3s-fs` (`scripts/deps/prefetch.sh`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::request::Parts;
use serde_json::Value;
use spotguard::emulator::{self, Cloud, EmulatorConfig};
use spotguard_testkit::free_port;
use spotguard_testkit::process::shipped_command;
use spotguard_testkit::process::Kid;
use spotguard_testkit::s3::proxy::{paced, Body, Faults, Proxy};
use spotguard_testkit::s3::S3Server;

const BUCKET: &str = "ckpt";
const MIB: usize = 1 << 20;

/// The store takes the first `after` parts, then holds every other one (its body never
/// arrives), so the interrupted upload stays where the test wants it however busy the machine.
#[derive(Default)]
struct Hold {
    after: AtomicUsize,
    parts: AtomicUsize,
}

impl Faults for Hold {
    fn request_body(self: &Arc<Self>, req: &Parts, body: Body) -> Body {
        let is_part =
            req.method == http::Method::PUT && req.uri.query().unwrap_or("").contains("partNumber");
        if is_part && self.parts.fetch_add(1, Ordering::SeqCst) >= self.after.load(Ordering::SeqCst)
        {
            return paced(body, 1);
        }
        body
    }
}

/// A staged checkpoint `step-5` of four files: two of 12 MiB (3 parts of 5 MiB each), two
/// small.
fn stage() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("step-5");
    std::fs::create_dir(&dir).unwrap();
    for i in 0..2u8 {
        std::fs::write(dir.join(format!("__{i}_0.distcp")), vec![i + 1; 12 * MIB]).unwrap();
        std::fs::write(
            dir.join(format!("meta-{i}.json")),
            format!("{{\"rank\": {i}}}"),
        )
        .unwrap();
    }
    (tmp, dir)
}

/// The journals under `state` (not a write's temp file), with their paths.
fn journals(state: &Path) -> Vec<(PathBuf, Value)> {
    std::fs::read_dir(state.join("uploads"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "json")
                && !p.file_name().unwrap().to_string_lossy().starts_with('.')
        })
        .filter_map(|p| {
            let v = serde_json::from_slice(&std::fs::read(&p).ok()?).ok()?;
            Some((p, v))
        })
        .collect()
}

fn journaled_parts(state: &Path) -> usize {
    journals(state)
        .iter()
        .flat_map(|(_, j)| j["files"].as_object().cloned().unwrap_or_default())
        .map(|(_, f)| f["parts"].as_object().map_or(0, |p| p.len()))
        .sum()
}

/// Multipart uploads s3s-fs holds open (its `.upload-<id>.json` and `.upload_id-<id>.part-N`
/// files).
fn open_uploads(server: &S3Server) -> Vec<String> {
    let root = server.object_path(BUCKET, "x");
    let root = root.parent().unwrap().parent().unwrap();
    let mut names: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".upload"))
        .collect();
    names.sort();
    names
}

/// `spotguard upload` of `staged` with `--state-dir state` through a store that takes one part
/// and holds the rest, killed (SIGKILL) once its journal names that part. Returns the journal
/// as it was left.
async fn interrupted_upload(
    server: &S3Server,
    staged: &Path,
    state: &Path,
    extra: &[&str],
) -> (PathBuf, Value) {
    let proxy = Proxy::start(server, Hold::default()).await;
    proxy.state.after.store(1, Ordering::SeqCst);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_spotguard"));
    cmd.arg("upload")
        .arg(staged)
        .arg(format!("s3://{BUCKET}/run1"))
        .args(["--step", "5", "--part-size", "5MiB", "--concurrency", "2"])
        .arg("--state-dir")
        .arg(state)
        .args(["--endpoint", &proxy.endpoint(), "--progress", "none"])
        .args(extra)
        .envs(S3Server::client_env())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = Kid::spawn(cmd);
    let t = Instant::now();
    while journaled_parts(state) < 1 {
        assert!(t.elapsed() < Duration::from_secs(120), "no part journaled");
        assert!(child.running(), "the upload ended before it was killed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.signal(libc::SIGKILL);
    child.wait();
    let mut found = journals(state);
    assert_eq!(found.len(), 1);
    assert!(
        !open_uploads(server).is_empty(),
        "the interrupted run left its multipart upload open"
    );
    found.remove(0)
}

/// The agent as shipped (KILL and SYS_PTRACE only) on `state`, its metrics on `port`; its log
/// in `log`.
fn agent(server: &S3Server, state: &Path, emu: &str, port: u16, log: &Path) -> Kid {
    let mut cmd = shipped_command(env!("CARGO_BIN_EXE_spotguard"));
    cmd.args([
        "run".to_string(),
        "--mode=host".into(),
        "--cloud=aws".into(),
        format!("--metadata-endpoint={emu}"),
        "--poll-interval=200ms".into(),
        format!(
            "--checkpoint-dir={}",
            state.parent().unwrap().join("ckpt").display()
        ),
        format!("--state-dir={}", state.display()),
        "--checkpoint-cmdline=^no-such-trainer$".into(),
        format!("--metrics-addr=127.0.0.1:{port}"),
        "--gpu=off".into(),
        "--log-level=info".into(),
        format!("--upload-allow=s3://{BUCKET}/run1"),
        format!("--upload-endpoint={}", server.endpoint()),
    ])
    .env("AWS_EC2_METADATA_DISABLED", "true")
    .envs(S3Server::client_env())
    .stdout(Stdio::null())
    .stderr(std::fs::File::create(log).unwrap());
    Kid::spawn(cmd)
}

/// Start the agent on `state` and wait until it reported the interrupted upload (or, on a
/// defect, published it); the agent's `/metrics` then.
async fn restart(server: &S3Server, state: &Path) -> String {
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let port = free_port();
    let log = state.parent().unwrap().join("agent.log");
    let _agent = agent(server, state, &emu.base_url(), port, &log);
    let url = format!("http://127.0.0.1:{port}/metrics");
    let t = Instant::now();
    loop {
        if let Ok(r) = reqwest::get(&url).await {
            let text = r.text().await.unwrap_or_default();
            let ended = ["interrupted", "published", "failed"].iter().any(|o| {
                text.lines().any(|l| {
                    l.starts_with(&format!(
                        "spotguard_checkpoint_upload_total{{outcome=\"{o}\"}}"
                    )) && !l.ends_with(" 0")
                })
            });
            if ended {
                // Give a resumed upload's abort/cleanup no chance to be missed: the journal is
                // removed after the report is counted.
                let t2 = Instant::now();
                while !journals(state).is_empty() && t2.elapsed() < Duration::from_secs(30) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                return text;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the agent reported nothing; its log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What every abandoned upload leaves: `interrupted` with `error`'s metric, no manifest, no
/// journal, nothing open in the store.
fn assert_abandoned(server: &S3Server, state: &Path, metrics: &str, error: &str) {
    let lines: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("spotguard_checkpoint_upload") && !l.ends_with(" 0"))
        .collect();
    assert!(
        lines.contains(&"spotguard_checkpoint_upload_total{outcome=\"interrupted\"} 1"),
        "{lines:#?}"
    );
    assert!(
        lines.contains(
            &format!("spotguard_checkpoint_upload_errors_total{{error=\"{error}\"}} 1").as_str()
        ),
        "{lines:#?}"
    );
    assert!(
        !server
            .object_path(BUCKET, "run1/step-5/manifest.json")
            .exists(),
        "a partial checkpoint was published"
    );
    assert_eq!(
        std::fs::read_dir(state.join("uploads")).unwrap().count(),
        0,
        "journal files left"
    );
    assert_eq!(
        open_uploads(server),
        Vec::<String>::new(),
        "uploads left open"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_after_taken_files_were_deleted_publishes_nothing_and_aborts_the_upload() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let (_t, staged) = stage();
    let work = tempfile::tempdir().unwrap();
    let state = work.path().join("state");
    let (_, journal) = interrupted_upload(&server, &staged, &state, &[]).await;
    assert_eq!(journal["files"].as_object().unwrap().len(), 4);
    // The protocol lets the trainer delete its staged files once they are taken.
    std::fs::remove_file(staged.join("__1_0.distcp")).unwrap();
    std::fs::remove_file(staged.join("meta-1.json")).unwrap();
    let metrics = restart(&server, &state).await;
    assert_abandoned(&server, &state, &metrics, "resume");
    let log = std::fs::read_to_string(work.path().join("agent.log")).unwrap();
    assert!(log.contains("2 taken file(s) are gone"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_after_a_taken_file_was_rewritten_publishes_nothing() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let (_t, staged) = stage();
    let work = tempfile::tempdir().unwrap();
    let state = work.path().join("state");
    interrupted_upload(&server, &staged, &state, &[]).await;
    // Another file under the same name and size.
    let shard = staged.join("__0_0.distcp");
    std::fs::remove_file(&shard).unwrap();
    std::fs::write(&shard, vec![9u8; 12 * MIB]).unwrap();
    let metrics = restart(&server, &state).await;
    assert_abandoned(&server, &state, &metrics, "resume");
    let log = std::fs::read_to_string(work.path().join("agent.log")).unwrap();
    assert!(
        log.contains("not the files that were taken (__0_0.distcp)"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_that_passed_while_the_agent_was_down_abandons_the_upload() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let (_t, staged) = stage();
    let work = tempfile::tempdir().unwrap();
    let state = work.path().join("state");
    let (path, mut journal) =
        interrupted_upload(&server, &staged, &state, &["--timeout", "600s"]).await;
    // The journal keeps the deadline as wall-clock time…
    let deadline: jiff::Timestamp = journal["deadline"]
        .as_str()
        .unwrap_or_else(|| panic!("no deadline journaled: {journal}"))
        .parse()
        .unwrap();
    let left = deadline
        .duration_since(jiff::Timestamp::now())
        .as_secs_f64();
    assert!((500.0..=600.0).contains(&left), "{left}");
    // …and the agent is down until after it.
    journal["deadline"] =
        Value::String((jiff::Timestamp::now() - jiff::SignedDuration::from_secs(1)).to_string());
    std::fs::write(&path, serde_json::to_vec(&journal).unwrap()).unwrap();
    let metrics = restart(&server, &state).await;
    assert_abandoned(&server, &state, &metrics, "resume");
    let log = std::fs::read_to_string(work.path().join("agent.log")).unwrap();
    assert!(log.contains("passed while the agent was down"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_journal_has_its_multipart_uploads_aborted_at_the_restart() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let (_t, staged) = stage();
    let work = tempfile::tempdir().unwrap();
    let state = work.path().join("state");
    let (path, _) = interrupted_upload(&server, &staged, &state, &[]).await;
    // Torn: half a record.
    let data = std::fs::read(&path).unwrap();
    std::fs::write(&path, &data[..data.len() / 2]).unwrap();
    let metrics = restart(&server, &state).await;
    assert_abandoned(&server, &state, &metrics, "journal");
}
