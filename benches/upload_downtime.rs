//! Benchmark: the trainer's downtime (save start → the trainer may exit) when it saves a
//! checkpoint to local disk and acks it staged, against saving the same bytes to the destination
//! itself; and what the staged upload then takes, after the trainer is gone.
//!
//! The trainer is a Python process using the repo's helper (`clients/python`): it writes the
//! checkpoint (8 × 256 MiB shards + 1 000 × 32 KiB files by default, as torch DCP lays one out)
//! from memory with buffered writes, then
//! - `staged`: `spotguard.ack_staged(...)` and waits for the answer. The agent's side is the
//!   real one, minus the responder's wiring: the ack polled every 50 ms (the agent's ack poll),
//!   `upload::ack::take` (resolve, open every file through the trainer's root, answer), then the
//!   upload on an `Uploader` to the same loopback s3s-fs (timed separately);
//! - `direct`: uploads its own files before it exits (`s5cmd cp` of the directory it just wrote,
//!   the fastest client measured by bench/upload.sh: a lower bound of writing to the store).
//!
//! `cargo bench --bench upload_downtime` (needs s3s-fs and s5cmd: bench/deps.sh; env:
//! SPOTGUARD_BENCH_ROUNDS=5, SPOTGUARD_BENCH_LARGE=8, SPOTGUARD_BENCH_LARGE_MIB=256,
//! SPOTGUARD_BENCH_SMALL=1000, SPOTGUARD_BENCH_SMALL_KIB=32). bench/downtime.sh runs it. The two
//! modes alternate in order round by round, each after a sync(2), and the local save is buffered
//! writes without fsync in both (what torch.save and DCP do).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use object_store::aws::{AmazonS3Builder, AwsAuthorizer, AwsCredential};
use object_store::ClientOptions;
use spotguard::checkpoint::ack::CheckpointDir;
use spotguard::checkpoint::procfs::ProcFs;
use spotguard::upload::ack::{self, Acker, StagedRequest};
use spotguard::upload::dest::{AllowUpload, UploadPolicy};
use spotguard::upload::engine::{Job, Meta, Options};
use spotguard::upload::target::{StoreTarget, Target};
use spotguard::upload::{Limits, Uploader};
use tokio_util::sync::CancellationToken;

const KEY: &str = "benchkey";
const SECRET: &str = "benchsecretkey";
const BUCKET: &str = "bench";

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Server(std::process::Child, String);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_s3s_fs(root: &Path) -> Server {
    let mut child = Command::new("s3s-fs")
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--access-key",
            KEY,
            "--secret-key",
            SECRET,
        ])
        .arg(root)
        .env("RUST_LOG", "s3s_fs=info")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("s3s-fs (bench/deps.sh)");
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("server is running at http://").nth(1) {
                let addr: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
                    .collect();
                let _ = tx.send(addr);
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("s3s-fs address");
    Server(child, format!("http://{addr}"))
}

async fn create_bucket(endpoint: &str) {
    let cred = AwsCredential {
        key_id: KEY.into(),
        secret_key: SECRET.into(),
        token: None,
    };
    let mut req = object_store::client::HttpRequest::new(Vec::<u8>::new().into());
    *req.method_mut() = http::Method::PUT;
    *req.uri_mut() = format!("{endpoint}/{BUCKET}").parse().expect("uri");
    let host = req.uri().authority().expect("host").to_string();
    req.headers_mut()
        .insert(http::header::HOST, host.parse().expect("host"));
    AwsAuthorizer::new(&cred, "s3", "us-east-1").authorize(&mut req, None);
    let mut r = reqwest::Client::new().put(req.uri().to_string());
    for (k, v) in req.headers() {
        r = r.header(k, v);
    }
    assert!(r.send().await.expect("create bucket").status().is_success());
}

fn s5cmd() -> String {
    let out = Command::new("python3")
        .args([
            "-c",
            "import os, s5cmd; print(os.path.join(os.path.dirname(s5cmd.__file__), 'bin', 's5cmd'))",
        ])
        .output()
        .expect("python3");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

const TRAINER: &str = r#"
import json, os, subprocess, sys, time
helper, mode, root, step, large, large_mib, small, small_kib, endpoint, s5 = sys.argv[1:11]
sys.path.insert(0, helper)
import spotguard
large, large_mib, small, small_kib = int(large), int(large_mib), int(small), int(small_kib)
block = os.urandom(1 << 20)
t0 = time.monotonic()
d = os.path.join(root, f"step-{step}")
os.makedirs(os.path.join(d, "extra"))
for i in range(large):
    with open(os.path.join(d, f"__{i}_0.distcp"), "wb") as f:
        for _ in range(large_mib):
            f.write(block)
for i in range(small):
    with open(os.path.join(d, "extra", f"state-{i:04d}.pt"), "wb") as f:
        f.write(block[: small_kib << 10])
saved = time.monotonic() - t0
if mode == "staged":
    a = spotguard.ack_staged(d, step=int(step), upload="s3://bench/staged", wait=120)
    state = a.state
else:
    env = dict(os.environ, AWS_ACCESS_KEY_ID="benchkey", AWS_SECRET_ACCESS_KEY="benchsecretkey",
               AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    subprocess.run([s5, "--endpoint-url", endpoint, "cp", d + "/", f"s3://bench/direct/step-{step}/"],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    state = "uploaded"
print(json.dumps({"saved": saved, "downtime": time.monotonic() - t0, "state": state}), flush=True)
"#;

struct Trial {
    saved: f64,
    downtime: f64,
    upload: Option<f64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let rounds = env_num("SPOTGUARD_BENCH_ROUNDS", 5);
    let large = env_num("SPOTGUARD_BENCH_LARGE", 8);
    let large_mib = env_num("SPOTGUARD_BENCH_LARGE_MIB", 256);
    let small = env_num("SPOTGUARD_BENCH_SMALL", 1000);
    let small_kib = env_num("SPOTGUARD_BENCH_SMALL_KIB", 32);
    let gib =
        (large * large_mib * (1 << 20) + small * small_kib * 1024) as f64 / (1u64 << 30) as f64;
    let work = tempfile::tempdir().expect("work dir");
    let server_root = work.path().join("s3root");
    std::fs::create_dir_all(&server_root).expect("server root");
    let server = start_s3s_fs(&server_root);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(create_bucket(&server.1));
    let uploader = Uploader::new(2, 8).expect("uploader");
    let s5 = s5cmd();
    let helper = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python");
    println!(
        "checkpoint: {large} x {large_mib} MiB + {small} x {small_kib} KiB ({gib:.2} GiB); s3s-fs at {}; {rounds} rounds",
        server.1
    );
    let mut staged = Vec::new();
    let mut direct = Vec::new();
    for round in 0..rounds {
        let order = if round % 2 == 0 {
            ["staged", "direct"]
        } else {
            ["direct", "staged"]
        };
        for mode in order {
            // Start every trial with nothing dirty in the page cache (the previous trial's files
            // and the server's copy written back), so that no trial pays for another's writeback.
            // SAFETY: sync(2) takes no arguments and cannot fail.
            unsafe { libc::sync() };
            let local = work.path().join(format!("local-{round}-{mode}"));
            let ckdir = work.path().join(format!("sg-{round}-{mode}"));
            std::fs::create_dir_all(&local).expect("local");
            let trial = run_trial(
                &rt,
                &uploader,
                &server.1,
                &s5,
                &helper,
                mode,
                &local,
                &ckdir,
                round,
                [large, large_mib, small, small_kib],
            );
            println!(
                "  round {} {mode:6}: saved locally {:5.2}s  trainer downtime {:6.2}s{}",
                round + 1,
                trial.saved,
                trial.downtime,
                trial
                    .upload
                    .map(|u| format!("  upload after the trainer left {u:6.2}s"))
                    .unwrap_or_default()
            );
            let _ = std::fs::remove_dir_all(&local);
            if mode == "staged" {
                staged.push(trial);
            } else {
                direct.push(trial);
            }
        }
    }
    let sd = median(staged.iter().map(|t| t.downtime).collect());
    let dd = median(direct.iter().map(|t| t.downtime).collect());
    let up = median(staged.iter().filter_map(|t| t.upload).collect());
    println!();
    println!("| trainer | median downtime (s) | of which the local save (s) | upload after it left (s) |");
    println!("|---|---:|---:|---:|");
    println!(
        "| staged (local save + ack_staged) | {sd:.2} | {:.2} | {up:.2} |",
        median(staged.iter().map(|t| t.saved).collect())
    );
    println!(
        "| direct (save, then its own upload) | {dd:.2} | {:.2} | — |",
        median(direct.iter().map(|t| t.saved).collect())
    );
    println!("\ndowntime staged / direct: {:.2}", sd / dd);
}

#[allow(clippy::too_many_arguments)]
fn run_trial(
    rt: &tokio::runtime::Runtime,
    uploader: &Uploader,
    endpoint: &str,
    s5: &str,
    helper: &Path,
    mode: &str,
    local: &Path,
    ckdir: &Path,
    round: u64,
    sizes: [u64; 4],
) -> Trial {
    let mut cmd = Command::new("python3");
    cmd.arg("-c")
        .arg(TRAINER)
        .arg(helper)
        .arg(mode)
        .arg(local)
        .arg(round.to_string())
        .args(sizes.iter().map(|n| n.to_string()))
        .arg(endpoint)
        .arg(s5)
        .env("SPOTGUARD_DIR", ckdir)
        .stdout(Stdio::piped());
    let child = cmd.spawn().expect("trainer");
    let mut upload = None;
    if mode == "staged" {
        let pid = child.id() as i32;
        let proc = ProcFs::default();
        let start_time = proc.start_time(pid).expect("start time");
        let cdir = CheckpointDir::host(ckdir).expect("checkpoint dir");
        // The agent's ack poll.
        let req = loop {
            if let Ok(Some(a)) = cdir.read_ack(pid) {
                if let Ok(Some(req)) = StagedRequest::from_ack(&a.file) {
                    break req;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let policy = UploadPolicy {
            allow: vec![AllowUpload::parse("s3://bench").expect("pattern")],
            own_dirs: vec![ckdir.to_path_buf()],
        };
        // The job's location: the ack's `upload` is at or below it.
        let binding = ack::Binding {
            location: Some("s3://bench".into()),
            writer: None,
            namespace: None,
        };
        let store_opts = spotguard::store::StoreOptions {
            endpoint: Some(endpoint.to_string()),
            ..Default::default()
        };
        let acker = Acker {
            pid,
            start_time,
            ns_pid: pid,
        };
        let taken = ack::take(
            &proc,
            acker,
            &cdir,
            &req,
            &binding,
            &policy,
            &Limits::default(),
            &store_opts,
        )
        .expect("taken");
        let store = Arc::new(
            AmazonS3Builder::new()
                .with_endpoint(endpoint)
                .with_bucket_name(BUCKET)
                .with_access_key_id(KEY)
                .with_secret_access_key(SECRET)
                .with_region("us-east-1")
                .with_http_connector(spotguard::store::checksum::ChecksumConnector)
                .with_client_options(ClientOptions::new().with_allow_http(true))
                .build()
                .expect("store"),
        );
        let prefix = format!("staged/{}", taken.resolved.name);
        let target = Target::Store(StoreTarget::new(
            store.clone(),
            store,
            &prefix,
            taken.resolved.destination.display(),
        ));
        let started = Instant::now();
        let handle = uploader.submit(Job {
            tree: taken.tree,
            target,
            meta: Meta {
                name: taken.resolved.name.clone(),
                step: req.step,
                ..Meta::default()
            },
            root: taken.root,
            options: Options::default(),
            progress: Default::default(),
            metrics: None,
            cancel: CancellationToken::new(),
            relayed: Default::default(),
        });
        let report = rt.block_on(handle).expect("upload task");
        assert!(report.outcome.is_published(), "{report:?}");
        upload = Some(started.elapsed().as_secs_f64());
    }
    let out = child.wait_with_output().expect("trainer output");
    assert!(out.status.success(), "trainer failed");
    let v: serde_json::Value =
        serde_json::from_slice(out.stdout.trim_ascii()).expect("trainer's report");
    if mode == "staged" {
        assert_eq!(v["state"], "taken", "{v}");
    }
    Trial {
        saved: v["saved"].as_f64().unwrap_or(f64::NAN),
        downtime: v["downtime"].as_f64().unwrap_or(f64::NAN),
        upload,
    }
}
