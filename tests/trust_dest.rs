//! Trust, round three (issue 29): where a staged checkpoint may go, and whose it is.
//!
//! - the allowed base is trusted only as the operator made it: a user who can write the base's
//!   parent swaps it for a symlink to the agent's own directory while the agent runs (the real
//!   `spotguard run` in host mode, every capability dropped but KILL and SYS_PTRACE, a uid-1000
//!   trainer): refused before `taken`, nothing written there;
//! - a root trainer's staged tree gets the owner check anyone's gets;
//! - destinations are bound to the job and a location has one writer: uid 1001 cannot publish
//!   under uid 1000's location (its upload fails `foreign_location`, nothing sent) nor forge a
//!   step, and uid 1000's own upload and latest checkpoint are unaffected — on a directory, on
//!   s3s-fs and on moto (whose create-only `PUT`, `If-None-Match: *`, is checked here);
//! - `taken` means it can be published: a prefix the store cannot hold is refused before it.
//!
//! Needs root (trainers as uid 1000 / 1001 via `setpriv`), python3, `s3s-fs` and `moto_server`
//! (`scripts/deps/prefetch.sh`).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use object_store::aws::AmazonS3;
use serde_json::Value;
use spotguard::checkpoint::ack::{AckFile, CheckpointDir};
use spotguard::checkpoint::procfs::ProcFs;
use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
use spotguard::store::StoreOptions;
use spotguard::upload::ack::{self, Acker, Answer, AnswerState, Binding, StagedRequest};
use spotguard::upload::dest::{AllowUpload, Location, UploadPolicy};
use spotguard::upload::engine::{self, Job, Meta, Options};
use spotguard::upload::latest;
use spotguard::upload::owner::{Marker, Writer, MARKER_NAME};
use spotguard::upload::staged::Limits;
use spotguard::upload::target::{StoreTarget, Target};
use spotguard::upload::Outcome;
use spotguard_testkit::assets::repo_root;
use spotguard_testkit::free_port;
use spotguard_testkit::process::shipped_command;
use spotguard_testkit::process::{catches_usr1, with_shipped_capabilities, Kid};
use spotguard_testkit::s3::{create_bucket, S3Server};
use tokio_util::sync::CancellationToken;

const BUCKET: &str = "ckpt";

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn chown_tree(p: &Path, uid: u32) {
    std::os::unix::fs::lchown(p, Some(uid), Some(uid)).unwrap();
    if p.is_dir() {
        for e in std::fs::read_dir(p).unwrap() {
            chown_tree(&e.unwrap().path(), uid);
        }
    }
}

fn files_under(p: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd {
            let path = e.unwrap().path();
            if path.is_dir() {
                out.extend(files_under(&path));
            }
            out.push(path);
        }
    }
    out
}

// ---- the allowed base, swapped while the agent runs ------------------------------------------

/// The trainer (uid 1000): on the signal it stages `$STAGED` (one file whose name is an ack's),
/// then — it can write the allowed base's parent — swaps the base for a symlink to `$TO`, acks
/// staged and records the agent's answer.
const SWAPPER: &str = r#"
import json, os, time
import spotguard
spotguard.install()
open(os.environ["READY"], "w").close()
while not spotguard.should_checkpoint():
    time.sleep(0.002)
path = os.environ["STAGED"]
os.makedirs(path)
with open(os.path.join(path, "ack-1.json"), "w") as f:
    f.write('{"state":"done"}')
base = os.environ["BASE"]
os.rename(base, base + ".old")
os.symlink(os.environ["TO"], base)
answer = spotguard.ack_staged(path, wait=20)
# Written aside, then renamed: the test reads the file while it waits.
with open(os.environ["RESULT"] + ".t", "w") as f:
    json.dump({"answer": answer.state, "error": answer.error}, f)
os.rename(os.environ["RESULT"] + ".t", os.environ["RESULT"])
spotguard.exit_after_checkpoint()
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_base_swapped_for_a_symlink_to_the_agents_own_dir_while_it_runs_is_refused_before_taken()
{
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    chmod(t, 0o755);
    // The agent's own dirs; the operator's allowed base, root's, in a directory uid 1000 can
    // write (a shared filesystem's top); the trainer's local disk.
    let agent = t.join("agent");
    let ckpt = agent.join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    // As the agent makes it for trainers of every user (sticky, like /tmp).
    chmod(&ckpt, 0o1777);
    let state = agent.join("state");
    let shared = t.join("shared");
    let base = shared.join("base");
    std::fs::create_dir_all(&base).unwrap();
    std::os::unix::fs::chown(&shared, Some(1000), Some(1000)).unwrap();
    let local = t.join("local");
    std::fs::create_dir(&local).unwrap();
    std::os::unix::fs::chown(&local, Some(1000), Some(1000)).unwrap();
    let ready = local.join("ready");
    let result = local.join("result.json");

    let mut cmd = Command::new("python3");
    cmd.arg("-c")
        .arg(SWAPPER)
        .env("PYTHONPATH", repo_root().join("clients/python"))
        .env("SPOTGUARD_DIR", &ckpt)
        // Named like the agent's checkpoint dir: it would land in it.
        .env("STAGED", local.join("ckpt"))
        .env("BASE", &base)
        .env("TO", &agent)
        .env("RESULT", &result)
        .env("READY", &ready)
        .uid(1000)
        .gid(1000)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    let trainer = Kid::spawn(cmd);
    let started = Instant::now();
    while !(ready.exists() && catches_usr1(trainer.pid())) {
        assert!(started.elapsed() < Duration::from_secs(20), "no handler");
        std::thread::sleep(Duration::from_millis(10));
    }
    let pidfile = t.join("trainer.pid");
    std::fs::write(&pidfile, trainer.pid().to_string()).unwrap();

    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let port = free_port();
    let log = std::fs::File::create(t.join("agent.log")).unwrap();
    let mut cmd = shipped_command(env!("CARGO_BIN_EXE_spotguard"));
    cmd.args([
        "run".to_string(),
        "--mode=host".into(),
        "--cloud=aws".into(),
        format!("--metadata-endpoint={}", emu.base_url()),
        "--poll-interval=200ms".into(),
        "--checkpoint-timeout=30s".into(),
        format!("--checkpoint-dir={}", ckpt.display()),
        format!("--state-dir={}", state.display()),
        format!("--checkpoint-pidfile={}", pidfile.display()),
        format!("--metrics-addr=127.0.0.1:{port}"),
        "--gpu=off".into(),
        format!("--upload-allow={}", base.display()),
        format!("--checkpoint-upload={}", base.display()),
    ])
    .env("AWS_EC2_METADATA_DISABLED", "true")
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(log);
    let _agent = Kid::spawn(cmd);
    // The agent is up (it polls the metadata) before the notice.
    let polls = format!("http://127.0.0.1:{port}/metrics");
    let up = Instant::now();
    loop {
        let text = reqwest::get(&polls).await.ok();
        let text = match text {
            Some(r) => r.text().await.unwrap_or_default(),
            None => String::new(),
        };
        if text.contains("spotguard_metadata_polls_total") {
            break;
        }
        assert!(
            up.elapsed() < Duration::from_secs(30),
            "the agent never polled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    emu.raise(EmulatedNotice::interruption()).unwrap();
    let said: Value = tokio::task::block_in_place(|| {
        let t0 = Instant::now();
        loop {
            if let Ok(d) = std::fs::read(&result) {
                if let Ok(v) = serde_json::from_slice(&d) {
                    return v;
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the trainer never answered"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let log = std::fs::read_to_string(t.join("agent.log")).unwrap_or_default();
    assert_eq!(said["answer"], "refused", "{said}\n{log}");
    assert!(
        said["error"].as_str().unwrap_or("").contains("symlink"),
        "{said}"
    );
    // Nothing of the trainer's reached the agent's own directory.
    assert!(
        !ckpt.join("ack-1.json").exists() && !ckpt.join("manifest.json").exists(),
        "{:?}",
        files_under(&ckpt)
    );
}

// ---- a root trainer's staged tree --------------------------------------------------------

#[test]
fn a_root_trainers_staged_tree_must_be_roots_like_anyones_must_be_theirs() {
    let tmp = tempfile::tempdir().unwrap();
    let staged = tmp.path().join("step-3");
    std::fs::create_dir(&staged).unwrap();
    std::fs::write(staged.join("mine.bin"), b"root's").unwrap();
    // A file another user planted (or owns) in the root trainer's tree.
    let planted = staged.join("secret.bin");
    std::fs::write(&planted, b"uid 1000's").unwrap();
    std::os::unix::fs::chown(&planted, Some(1000), Some(1000)).unwrap();
    let cdir_path = tmp.path().join("sg");
    let cdir = CheckpointDir::host(&cdir_path).unwrap();
    let dest = tmp.path().join("dest");
    std::fs::create_dir(&dest).unwrap();
    let proc = ProcFs::default();
    let me = std::process::id() as i32;
    let acker = Acker {
        pid: me,
        start_time: proc.start_time(me).unwrap(),
        ns_pid: 77,
    };
    let req = StagedRequest {
        staged: staged.clone(),
        upload: None,
        step: Some(3),
        part: None,
    };
    let policy = UploadPolicy {
        allow: vec![AllowUpload::parse(&dest.display().to_string()).unwrap()],
        own_dirs: vec![cdir_path.clone()],
    };
    let binding = Binding {
        location: Some(dest.join("run").display().to_string()),
        writer: None,
        namespace: None,
    };
    drop(cdir);
    let sg = cdir_path.clone();
    let e = with_shipped_capabilities(move || {
        let cdir = CheckpointDir::host(&sg).unwrap();
        ack::take(
            &ProcFs::default(),
            acker,
            &cdir,
            &req,
            &binding,
            &policy,
            &Limits::default(),
            &StoreOptions::default(),
        )
        .map(|_| ())
    })
    .unwrap_err();
    assert_eq!(e.metric_label(), "staged_owner", "{e}");
    let answer: Answer =
        serde_json::from_slice(&std::fs::read(cdir_path.join("upload-77.json")).unwrap()).unwrap();
    assert_eq!(answer.state, AnswerState::Refused);
}

// ---- one writer per location -------------------------------------------------------------

/// A trainer process as `uid` (it only has to live while its checkpoint is taken).
fn trainer_as(uid: u32) -> Kid {
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid", &uid.to_string(), "--regid", &uid.to_string()])
        .args(["--clear-groups", "sleep", "120"])
        .stdin(Stdio::null());
    let kid = Kid::spawn(cmd);
    let proc = ProcFs::default();
    let t = Instant::now();
    while proc.status(kid.pid()).map(|s| s.uid).ok() != Some(uid) {
        assert!(t.elapsed() < Duration::from_secs(10), "never ran as {uid}");
        std::thread::sleep(Duration::from_millis(10));
    }
    kid
}

/// A host: one bound location (`--checkpoint-upload`) under one allow pattern, trainers of
/// several users staging into their own local dirs.
struct Host {
    tmp: tempfile::TempDir,
    location: String,
    policy: UploadPolicy,
    store: StoreOptions,
    /// An S3 location's store, signed with the test servers' keys (in-process code cannot be
    /// given the `AWS_*` environment the agent reads).
    s3: Option<Arc<AmazonS3>>,
}

impl Host {
    fn new(allow: &str, location: &str, store: StoreOptions) -> Host {
        Host::with(|_| (allow.to_string(), location.to_string()), store)
    }

    /// `paths` gives the allow pattern and the location, from the host's temp dir.
    fn with(paths: impl FnOnce(&Path) -> (String, String), store: StoreOptions) -> Host {
        let tmp = tempfile::tempdir().unwrap();
        chmod(tmp.path(), 0o755);
        let (allow, location) = paths(tmp.path());
        let (allow, location) = (allow.as_str(), location.as_str());
        Host {
            location: location.to_string(),
            policy: UploadPolicy {
                allow: vec![AllowUpload::parse(allow).unwrap()],
                own_dirs: vec![tmp.path().join("sg")],
            },
            store,
            tmp,
            s3: None,
        }
    }

    fn on(mut self, server: &S3Server) -> Host {
        self.s3 = Some(s3_store(server));
        self
    }

    /// The target the agent opens for `taken`, signed with the test keys for S3.
    fn target(&self, resolved: &ack::Resolved, opened: Target) -> Target {
        match (&self.s3, &resolved.destination) {
            (Some(s), Location::Store(url)) => Target::Store(StoreTarget::new(
                s.clone(),
                s.clone(),
                &url.prefix,
                url.normalized(),
            )),
            _ => opened,
        }
    }

    /// `uid` stages `name` and acks it (`step`, `upload`); the checkpoint is taken (or
    /// refused) as the agent takes it, and uploaded as the agent uploads it.
    async fn stage_and_upload(
        &self,
        uid: u32,
        name: &str,
        content: &[u8],
        step: Option<u64>,
        upload: Option<&str>,
    ) -> Result<engine::Report, spotguard::upload::Error> {
        let trainer = trainer_as(uid);
        let dir = self.tmp.path().join(format!("local-{uid}")).join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("weights.pt"), content).unwrap();
        chown_tree(dir.parent().unwrap(), uid);
        let mut ack = serde_json::json!({"state": "done", "staged": dir.display().to_string()});
        if let Some(s) = step {
            ack["step"] = s.into();
        }
        if let Some(u) = upload {
            ack["upload"] = u.into();
        }
        let ack: AckFile = serde_json::from_value(ack).unwrap();
        let req = StagedRequest::from_ack(&ack).unwrap().unwrap();
        let sg = self.tmp.path().join("sg");
        let pid = trainer.pid();
        let acker = Acker {
            pid,
            start_time: ProcFs::default().start_time(pid).unwrap(),
            ns_pid: pid,
        };
        let binding = Binding {
            location: Some(self.location.clone()),
            writer: None,
            namespace: None,
        };
        let (policy, store) = (self.policy.clone(), self.store.clone());
        let taken = with_shipped_capabilities(move || {
            let cdir = CheckpointDir::host(&sg).unwrap();
            ack::take(
                &ProcFs::default(),
                acker,
                &cdir,
                &req,
                &binding,
                &policy,
                &Limits::default(),
                &store,
            )
        })?;
        let ack::Taken {
            tree,
            resolved,
            root,
            target,
            writer,
        } = taken;
        assert_eq!(writer, Writer::host(uid));
        drop(trainer);
        Ok(engine::run(Job {
            meta: Meta {
                name: resolved.name.clone(),
                step: resolved.step,
                writer: Some(writer),
                ..Meta::default()
            },
            target: self.target(&resolved, target),
            tree,
            root,
            options: Options::default(),
            progress: Default::default(),
            metrics: None,
            cancel: CancellationToken::new(),
            relayed: Default::default(),
        })
        .await)
    }
}

/// uid 1000 (job A) owns the location; uid 1001 tries to publish under it first with the same
/// checkpoint name, then with an absurd step: neither reaches A's location, and A's own upload
/// and its latest checkpoint are A's.
async fn one_writer_per_location(host: &Host, check: impl Fn(&str) -> bool) {
    let a = host
        .stage_and_upload(1000, "step-100", b"A at 100", Some(100), None)
        .await
        .unwrap();
    assert_eq!(a.outcome, Outcome::Published, "{a:?}");
    assert_eq!(
        a.manifest.as_ref().unwrap().writer.as_deref(),
        Some("host:uid:1000")
    );

    // uid 1001 publishes "first" under A's location the checkpoint A is about to save.
    let b = host
        .stage_and_upload(1001, "step-200", b"B's weights", Some(200), None)
        .await
        .unwrap();
    assert_eq!(b.outcome, Outcome::Failed, "{b:?}");
    assert_eq!(b.error_label, Some("foreign_location"), "{b:?}");
    assert!(!check("step-200/weights.pt"), "uid 1001 sent a file");
    // … and with an absurd step: refused before `taken`.
    let e = host
        .stage_and_upload(1001, "step-300", b"B's", Some(u64::MAX), None)
        .await
        .unwrap_err();
    assert_eq!(e.metric_label(), "step", "{e}");
    let e = host
        .stage_and_upload(1001, "step-18446744073709551615", b"B's", None, None)
        .await
        .unwrap_err();
    assert_eq!(e.metric_label(), "step", "{e}");
    // … or somewhere the ack names outside the job's location: refused before `taken`.
    let outside = format!("{}-evil", host.location);
    let e = host
        .stage_and_upload(1001, "step-400", b"B's", Some(400), Some(&outside))
        .await
        .unwrap_err();
    assert_eq!(e.metric_label(), "not_allowed", "{e}");

    // A's own upload of step-200 is unaffected, and A's is the latest.
    let a = host
        .stage_and_upload(1000, "step-200", b"A at 200", Some(200), None)
        .await
        .unwrap();
    assert_eq!(a.outcome, Outcome::Published, "{a:?}");
    assert_eq!(
        a.manifest.as_ref().unwrap().writer.as_deref(),
        Some("host:uid:1000")
    );
    assert!(check("step-200/weights.pt"));
    match &host.s3 {
        None => {
            let found = latest::latest(&Location::parse(&host.location).unwrap(), &host.store)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(found.manifest.name, "step-200");
            assert_eq!(found.manifest.writer.as_deref(), Some("host:uid:1000"));
        }
        Some(store) => {
            let url = Location::parse(&host.location).unwrap();
            let Location::Store(url) = url else { panic!() };
            let marker = object_store::path::Path::from(format!("{}/{MARKER_NAME}", url.prefix));
            let data = object_store::ObjectStoreExt::get(&**store, &marker)
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap();
            assert_eq!(Marker::parse(&data).unwrap().writer, Writer::host(1000));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_user_cannot_take_or_poison_a_directory_location() {
    let host = Host::with(
        |t| {
            let base = t.join("efs");
            std::fs::create_dir(&base).unwrap();
            (
                base.display().to_string(),
                base.join("run-a").display().to_string(),
            )
        },
        StoreOptions::default(),
    );
    let location = PathBuf::from(&host.location);
    one_writer_per_location(&host, |rel| location.join(rel).exists()).await;
    let marker = Marker::parse(&std::fs::read(location.join(MARKER_NAME)).unwrap()).unwrap();
    assert_eq!(marker.writer, Writer::host(1000));
}

fn s3_opts(server: &S3Server) -> StoreOptions {
    StoreOptions {
        endpoint: Some(server.endpoint()),
        ..StoreOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_user_cannot_take_or_poison_an_s3s_fs_location() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let host = Host::new(
        &format!("s3://{BUCKET}/runs"),
        &format!("s3://{BUCKET}/runs/a"),
        s3_opts(&server),
    )
    .on(&server);
    one_writer_per_location(&host, |rel| {
        server
            .object_path(BUCKET, &format!("runs/a/{rel}"))
            .exists()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_user_cannot_take_or_poison_a_moto_location() {
    let server = S3Server::moto();
    create_bucket(&server.endpoint(), BUCKET).await;
    let host = Host::new(
        &format!("s3://{BUCKET}/runs"),
        &format!("s3://{BUCKET}/runs/a"),
        s3_opts(&server),
    )
    .on(&server);
    let store = s3_store(&server);
    one_writer_per_location(&host, |rel| {
        let key = object_store::path::Path::from(format!("runs/a/{rel}"));
        let store = store.clone();
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current()
                .block_on(async move { object_store::ObjectStoreExt::head(&*store, &key).await })
                .is_ok()
        })
    })
    .await;
}

fn s3_store(server: &S3Server) -> Arc<AmazonS3> {
    Arc::new(
        object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(BUCKET)
            .with_endpoint(server.endpoint())
            .with_allow_http(true)
            .with_region(spotguard_testkit::s3::REGION)
            .with_access_key_id(spotguard_testkit::s3::ACCESS_KEY)
            .with_secret_access_key(spotguard_testkit::s3::SECRET_KEY)
            .with_virtual_hosted_style_request(false)
            .build()
            .unwrap(),
    )
}

/// The stores' create-only `PUT` (`PutMode::Create`, `If-None-Match: *`) is what keeps two
/// first uploads from both owning a location: a second create finds the first marker there
/// and leaves it as it was.
async fn create_only(target: &Target) {
    let a = Writer::host(1000);
    let b = Writer::host(1001);
    assert_eq!(target.claim(Some(&a)).await.unwrap(), Some(a.clone()));
    let Target::Store(s) = target else {
        panic!("a store")
    };
    assert!(!s
        .create_marker(Marker::new(b.clone()).to_bytes())
        .await
        .unwrap());
    let e = target.claim(Some(&b)).await.unwrap_err();
    assert_eq!(e.metric_label(), "foreign_location");
    assert_eq!(target.claim(Some(&a)).await.unwrap(), Some(a));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3s_fs_and_moto_honour_the_create_only_marker() {
    let s3s = S3Server::s3s_fs(&[BUCKET]);
    let moto = S3Server::moto();
    create_bucket(&moto.endpoint(), BUCKET).await;
    for server in [&s3s, &moto] {
        let store = s3_store(server);
        let target = Target::Store(StoreTarget::new(
            store.clone(),
            store,
            "runs/x/step-1",
            format!("s3://{BUCKET}/runs/x/step-1"),
        ));
        create_only(&target).await;
    }
}

// ---- taken means it can be published -------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_the_store_cannot_hold_is_refused_before_taken() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let long = "p".repeat(1100);
    let host = Host::new(
        &format!("s3://{BUCKET}"),
        &format!("s3://{BUCKET}/{long}"),
        s3_opts(&server),
    );
    let e = host
        .stage_and_upload(1000, "step-1", b"w", Some(1), None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("1024"), "{e}");
    let answer = std::fs::read_dir(host.tmp.path().join("sg"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("upload-"))
        .unwrap();
    let answer: Answer = serde_json::from_slice(&std::fs::read(answer).unwrap()).unwrap();
    assert_eq!(answer.state, AnswerState::Refused);
    assert!(answer.error.unwrap().contains("1024"));
}
