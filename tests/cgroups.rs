//! Kubernetes-shaped cgroups, for real: cgroups created under the v1 hierarchies (name=systemd,
//! cpu, pids, memory) and the v2 `unified` mount with kubelet paths for both drivers, real
//! processes moved in through `cgroup.procs`, then one [`ProcIndex`] scan.
//!
//! Every test puts its tree under its own top-level `sg-test-<random>` cgroup (the parser accepts
//! any prefix before the kubepods hierarchy, as on kind or a nested kubelet), so parallel tests and
//! other users of the hierarchies never share a directory; each tree is removed afterwards.
//!
//! Also the container-root confinement: processes chrooted into a temp root, whose checkpoint dir
//! is resolved inside that root — symlinks planted there must never make the agent write or read
//! host files.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use jiff::Timestamp;
use prometheus_client::registry::Registry;
use spotguard::checkpoint::cgroup::{
    cgroup_mounts, find_containers, ContainerCgroups, FoundBy, ProcIndex,
};
use spotguard::checkpoint::pods;
use spotguard::checkpoint::procfs::ProcFs;
use spotguard::checkpoint::run::{deliver, wait, CheckpointRequest, DeliveryState, NoticeStatus};
use spotguard::checkpoint::{
    Outcome, PodRef, Signal, TargetContainer, TargetGroup, TargetMode, TargetProcess,
};
use spotguard::metrics::Metrics;
use spotguard_testkit::process::Kid;
use spotguard_testkit::wait::eventually_blocking;
use tokio_util::sync::CancellationToken;

const CG: &str = "/sys/fs/cgroup";

/// SIGUSR1 handler that writes `marker-$$` and, with `$STATE`, `ack-$$.json` (plain redirection:
/// it also runs in a chroot with nothing but `sh` and `sleep`).
const HANDLER: &str = r#"
trap 'echo got > "$DIR/marker-$$"
  if [ -n "$STATE" ]; then printf "{\"state\":\"%s\",\"step\":3}" "$STATE" > "$DIR/ack-$$.json"; fi' USR1
sleep 1000 & S=$!
while :; do wait $S; done
"#;

/// `sh -c 'read x; <script>'` in a process group of its own, held (stdin a pipe) until it has
/// been moved into its cgroups, then released.
fn held_sh(script: &str, env: &[(&str, &str)]) -> Kid {
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(format!("read x\n{script}"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    Kid::spawn_held(cmd)
}

fn children_of(pid: i32) -> Vec<i32> {
    let proc = ProcFs::default();
    proc.pids()
        .unwrap()
        .into_iter()
        .filter(|p| proc.stat(*p).is_ok_and(|s| s.ppid == pid))
        .collect()
}

/// Cgroup directories created by one test, removed bottom-up on drop (declare it before the
/// children, so that they are killed and reaped first).
struct CgroupTree {
    created: Vec<PathBuf>,
    tag: String,
}

impl CgroupTree {
    fn new() -> Self {
        CgroupTree {
            created: Vec::new(),
            tag: format!("sg-test-{:016x}", fastrand::u64(..)),
        }
    }

    /// Create `<hierarchy>[/<under>]/<tag>/<rel>` and return it.
    fn make(&mut self, hierarchy: &str, under: &str, rel: &str) -> PathBuf {
        let base = Path::new(CG)
            .join(hierarchy)
            .join(under.trim_start_matches('/'));
        let mut path = base.join(&self.tag);
        if !path.exists() {
            std::fs::create_dir(&path).expect("create test cgroup");
            self.created.push(path.clone());
        }
        for seg in rel.split('/').filter(|s| !s.is_empty()) {
            path.push(seg);
            if !path.exists() {
                std::fs::create_dir(&path).expect("create test cgroup");
                self.created.push(path.clone());
            }
        }
        path
    }
}

impl Drop for CgroupTree {
    fn drop(&mut self) {
        for dir in self.created.iter().rev() {
            for _ in 0..200 {
                if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn join(cgroup: &Path, pid: i32) {
    std::fs::write(cgroup.join("cgroup.procs"), pid.to_string())
        .unwrap_or_else(|e| panic!("moving {pid} into {}: {e}", cgroup.display()));
}

/// Our own cgroup in a v1 hierarchy (the memory hierarchy must not be left).
fn own_cgroup(controller: &str) -> String {
    std::fs::read_to_string("/proc/self/cgroup")
        .unwrap()
        .lines()
        .find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, ctrl, path) = (parts.next()?, parts.next()?, parts.next()?);
            ctrl.split(',')
                .any(|c| c == controller)
                .then(|| path.to_string())
        })
        .unwrap_or_else(|| "/".to_string())
}

fn uuid() -> String {
    let h = format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..));
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn container_id() -> String {
    (0..4)
        .map(|_| format!("{:016x}", fastrand::u64(..)))
        .collect()
}

fn scan() -> ProcIndex {
    ProcIndex::scan(Path::new("/proc")).expect("scan /proc")
}

/// What a container is, for comparing the two discovery paths.
fn shape(c: &TargetContainer) -> (Vec<TargetProcess>, Option<i32>, Option<i32>) {
    (c.processes.clone(), c.init_pid, c.root_pid)
}

/// The O(targets) path (the containers' own `cgroup.procs`) finds for each of `wanted` exactly
/// what the full scan finds — first by walking the hierarchies, then from the located map — and
/// returns that index. Processes in `stable` are compared; the rest must be equal too unless
/// `churn` (a container forking meanwhile), where each path's extra processes must belong to the
/// container or be gone.
fn same_as_full_scan(wanted: &[(String, String)], churn: bool) -> ProcIndex {
    let mounts = cgroup_mounts();
    assert!(!mounts.is_empty(), "cgroup hierarchies mounted");
    let proc_root = Path::new("/proc");
    let (located_index, how, located) =
        find_containers(proc_root, &mounts, &ContainerCgroups::default(), wanted).unwrap();
    assert_eq!(how, FoundBy::Located);
    let located = located.expect("a walk returns the located map");
    assert!(located.has_all(wanted));
    let (index, how, again) = find_containers(proc_root, &mounts, &located, wanted).unwrap();
    assert_eq!(
        how,
        FoundBy::Cgroups,
        "located containers are read directly"
    );
    assert!(again.is_none());
    let full = scan();
    for (uid, id) in wanted {
        let want = full.container(uid, id).expect("full scan finds it");
        for got in [&located_index, &index] {
            let got = got.container(uid, id).expect("cgroup path finds it");
            if !churn {
                assert_eq!(shape(&got), shape(&want), "container {id}");
                continue;
            }
            assert_eq!(got.init_pid, want.init_pid);
            let proc = ProcFs::default();
            for p in got.processes.iter().chain(&want.processes) {
                let in_both = got.processes.contains(p) && want.processes.contains(p);
                let alive = proc.alive(p.pid, p.start_time).unwrap_or(false);
                assert!(
                    in_both
                        || !alive
                        || std::fs::read_to_string(format!("/proc/{}/cgroup", p.pid))
                            .is_ok_and(|t| t.contains(id.as_str())),
                    "process {} differs between the paths and is neither gone nor the container's",
                    p.pid
                );
            }
        }
    }
    // Nothing outside the wanted containers is read.
    assert!(index.len() <= wanted.len(), "{} containers", index.len());
    index
}

fn pids(c: &TargetContainer) -> Vec<i32> {
    let mut p: Vec<i32> = c.processes.iter().map(|p| p.pid).collect();
    p.sort_unstable();
    p
}

fn request() -> CheckpointRequest {
    let now = Timestamp::now();
    CheckpointRequest {
        notice_id: "n-cg".into(),
        source: "gce".into(),
        kind: "interruption".into(),
        deadline: Some(now + Duration::from_secs(120)),
        checkpoint_deadline: now + Duration::from_secs(60),
        dry_run: false,
    }
}

fn pod_group(
    uid: &str,
    containers: Vec<TargetContainer>,
    dir: &Path,
    timeout: Duration,
) -> TargetGroup {
    TargetGroup {
        name: "ml/trainer-0".into(),
        pod: Some(PodRef {
            namespace: "ml".into(),
            name: "trainer-0".into(),
            uid: uid.to_string(),
        }),
        containers,
        mode: TargetMode::Handlers,
        signal: Signal::USR1,
        dir: dir.to_path_buf(),
        timeout,
        proc_root: "/proc".into(),
    }
}

#[tokio::test]
async fn systemd_driver_burstable_containerd_in_v1_systemd_and_v2() {
    let mut tree = CgroupTree::new();
    let uid = uuid();
    let (app, sandbox) = (container_id(), container_id());
    let pod = format!(
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice",
        uid.replace('-', "_")
    );
    let tmp = tempfile::tempdir().unwrap();
    let mut trainer = held_sh(
        HANDLER,
        &[("DIR", tmp.path().to_str().unwrap()), ("STATE", "done")],
    );
    let mut pause = held_sh("exec sleep 1000", &[]);
    for h in ["systemd", "unified"] {
        join(
            &tree.make(h, "", &format!("{pod}/cri-containerd-{app}.scope")),
            trainer.pid(),
        );
        join(
            &tree.make(h, "", &format!("{pod}/cri-containerd-{sandbox}.scope")),
            pause.pid(),
        );
    }
    trainer.release();
    pause.release();
    // the trainer's `sleep` is forked inside the container's cgroups
    eventually_blocking("the trainer's child", Duration::from_secs(10), || {
        children_of(trainer.pid()).len() == 1
    });
    let worker = children_of(trainer.pid())[0];

    same_as_full_scan(
        &[(uid.clone(), app.clone()), (uid.clone(), sandbox.clone())],
        false,
    );
    let index = scan();
    let c = index
        .container(
            &uid,
            pods::container_id(&format!("containerd://{app}"))
                .unwrap()
                .1,
        )
        .expect("container found");
    let mut want = vec![trainer.pid(), worker];
    want.sort_unstable();
    assert_eq!(pids(&c), want);
    assert!(
        !pids(&c).contains(&pause.pid()),
        "the sandbox is not the container"
    );
    assert_eq!(c.init_pid, Some(trainer.pid()));
    assert_eq!(c.root_pid, Some(trainer.pid()));
    let sandbox_c = index
        .container(&uid, &sandbox)
        .expect("sandbox indexed under its own id");
    assert_eq!(pids(&sandbox_c), vec![pause.pid()]);

    // End to end as a pod: only the process with a handler is signalled, inside its root.
    let worker_start = ProcFs::default().start_time(worker).unwrap();
    let group = pod_group(&uid, vec![c], tmp.path(), Duration::from_secs(20));
    let req = request();
    let m = Metrics::register(&mut Registry::default());
    let deliveries = deliver(&[group], &req, &m);
    assert_eq!(deliveries[0].signalled_pids(), vec![trainer.pid()]);
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert_eq!(results[0].outcome, Outcome::Acked, "{}", results[0].detail);
    assert_eq!(
        results[0].pod.as_ref().map(|p| p.uid.as_str()),
        Some(uid.as_str())
    );
    assert!(pause.running());
    assert!(
        ProcFs::default().alive(worker, worker_start).unwrap(),
        "the worker without a handler lives"
    );
}

#[tokio::test]
async fn systemd_driver_guaranteed_crio_and_docker_scopes_skip_conmon() {
    let mut tree = CgroupTree::new();
    let uid = uuid();
    let (crio, docker) = (container_id(), container_id());
    let pod = format!("kubepods.slice/kubepods-pod{}.slice", uid.replace('-', "_"));
    let mut a = held_sh("exec sleep 1000", &[]);
    let mut conmon = held_sh("exec sleep 1000", &[]);
    let mut b = held_sh("exec sleep 1000", &[]);
    // crun puts the payload in a `container` sub-cgroup on v2; cpu (v1) has the scope itself
    join(
        &tree.make("unified", "", &format!("{pod}/crio-{crio}.scope/container")),
        a.pid(),
    );
    join(
        &tree.make("cpu", "", &format!("{pod}/crio-{crio}.scope")),
        a.pid(),
    );
    join(
        &tree.make("unified", "", &format!("{pod}/crio-conmon-{crio}.scope")),
        conmon.pid(),
    );
    join(
        &tree.make("cpu", "", &format!("{pod}/crio-conmon-{crio}.scope")),
        conmon.pid(),
    );
    join(
        &tree.make("unified", "", &format!("{pod}/docker-{docker}.scope")),
        b.pid(),
    );
    for k in [&mut a, &mut conmon, &mut b] {
        k.release();
    }
    same_as_full_scan(
        &[(uid.clone(), crio.clone()), (uid.clone(), docker.clone())],
        false,
    );
    let index = scan();
    let ca = index
        .container(
            &uid,
            pods::container_id(&format!("cri-o://{crio}")).unwrap().1,
        )
        .expect("cri-o container");
    assert_eq!(
        pids(&ca),
        vec![a.pid()],
        "conmon carries the id but is not the container"
    );
    let cb = index
        .container(
            &uid,
            pods::container_id(&format!("docker://{docker}")).unwrap().1,
        )
        .expect("docker container");
    assert_eq!(pids(&cb), vec![b.pid()]);
    assert_eq!(cb.init_pid, Some(b.pid()));
}

#[tokio::test]
async fn cgroupfs_driver_burstable_and_guaranteed_in_v1_controllers() {
    let mut tree = CgroupTree::new();
    let (uid1, uid2) = (uuid(), uuid());
    let (id1, id2) = (container_id(), container_id());
    let mut a = held_sh("sleep 1000 & sleep 1000 & wait", &[]);
    let mut b = held_sh("exec sleep 1000", &[]);
    let burstable = format!("kubepods/burstable/pod{uid1}/{id1}");
    join(&tree.make("cpu", "", &burstable), a.pid());
    join(&tree.make("pids", "", &burstable), a.pid());
    // memory: below our own memory cgroup, which must not be left
    join(
        &tree.make("memory", &own_cgroup("memory"), &burstable),
        a.pid(),
    );
    let guaranteed = format!("kubepods/pod{uid2}/{id2}");
    join(&tree.make("pids", "", &guaranteed), b.pid());
    a.release();
    b.release();
    eventually_blocking("two workers", Duration::from_secs(10), || {
        children_of(a.pid()).len() == 2
    });

    same_as_full_scan(
        &[(uid1.clone(), id1.clone()), (uid2.clone(), id2.clone())],
        false,
    );
    let index = scan();
    let c1 = index.container(&uid1, &id1).expect("burstable container");
    let mut want = children_of(a.pid());
    want.push(a.pid());
    want.sort_unstable();
    assert_eq!(pids(&c1), want);
    assert_eq!(c1.init_pid, Some(a.pid()));
    let c2 = index.container(&uid2, &id2).expect("guaranteed container");
    assert_eq!(pids(&c2), vec![b.pid()]);
    assert!(index.container(&uid1, &id2).is_none());
    assert!(index.container(&uid2, &id1).is_none());
}

#[tokio::test]
async fn cgroup_namespace_view_with_leading_dotdot() {
    let mut tree = CgroupTree::new();
    let uid = uuid();
    let id = container_id();
    let mut target = held_sh("exec sleep 1000", &[]);
    join(
        &tree.make(
            "unified",
            "",
            &format!(
                "kubepods.slice/kubepods-pod{}.slice/cri-containerd-{id}.scope",
                uid.replace('-', "_")
            ),
        ),
        target.pid(),
    );
    target.release();
    same_as_full_scan(&[(uid.clone(), id.clone())], false);
    // A reader in its own cgroup namespace rooted at a sibling cgroup, as a DaemonSet pod
    // without host cgroupns sees the host: `0::/../kubepods.slice/…`.
    let mut reader = Command::new("sh");
    reader
        .arg("-c")
        .arg(format!(
            "read x; exec unshare --cgroup cat /proc/{}/cgroup",
            target.pid()
        ))
        .stdout(Stdio::piped())
        .stdin(Stdio::piped())
        .process_group(0);
    let mut reader = reader.spawn().unwrap();
    join(&tree.make("unified", "", "agent"), reader.id() as i32);
    reader.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let out = reader.wait_with_output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("0::/../kubepods.slice/"), "{text}");

    // Scan a proc tree holding that view (stat and status are the real ones).
    let fake = tempfile::tempdir().unwrap();
    let pdir = fake.path().join(target.pid().to_string());
    std::fs::create_dir(&pdir).unwrap();
    std::fs::write(pdir.join("cgroup"), &text).unwrap();
    for f in ["stat", "status"] {
        std::fs::copy(format!("/proc/{}/{f}", target.pid()), pdir.join(f)).unwrap();
    }
    let index = ProcIndex::scan(fake.path()).unwrap();
    let c = index
        .container(&uid, &id)
        .expect("found through the namespaced path");
    assert_eq!(pids(&c), vec![target.pid()]);
}

/// The unified-hierarchy cgroup of a Burstable pod's container (systemd driver) in `tree`.
fn container_cgroup(tree: &mut CgroupTree, uid: &str, id: &str) -> PathBuf {
    tree.make(
        "unified",
        "",
        &format!(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{id}.scope",
            uid.replace('-', "_")
        ),
    )
}

/// A container that keeps forking short-lived children while it is discovered and signalled:
/// both paths agree on every process that lives through it, and the signal reaches the one
/// process with a handler, once.
#[tokio::test]
async fn container_forking_mid_notice_gets_what_the_full_scan_gives() {
    let mut tree = CgroupTree::new();
    let uid = uuid();
    let id = container_id();
    let tmp = tempfile::tempdir().unwrap();
    // a subshell forking `true` without end (a subshell does not inherit the trap), then the
    // handler
    let script = format!("( while :; do /bin/true; done ) &\n{HANDLER}");
    let mut trainer = held_sh(
        &script,
        &[("DIR", tmp.path().to_str().unwrap()), ("STATE", "done")],
    );
    join(&container_cgroup(&mut tree, &uid, &id), trainer.pid());
    trainer.release();
    let pid = trainer.pid();
    eventually_blocking(
        "the handler and the forker",
        Duration::from_secs(10),
        || {
            children_of(pid).len() >= 2
                && ProcFs::default()
                    .status(pid)
                    .is_ok_and(|s| s.catches(Signal::USR1))
        },
    );
    let wanted = [(uid.clone(), id.clone())];
    for _ in 0..5 {
        same_as_full_scan(&wanted, true);
    }
    let index = same_as_full_scan(&wanted, true);
    let c = index.container(&uid, &id).unwrap();
    assert!(c.processes.iter().any(|p| p.pid == pid));
    let group = pod_group(&uid, vec![c], tmp.path(), Duration::from_secs(20));
    let req = request();
    let m = Metrics::register(&mut Registry::default());
    let deliveries = deliver(&[group], &req, &m);
    assert_eq!(deliveries[0].signalled_pids(), vec![pid]);
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert_eq!(results[0].outcome, Outcome::Acked, "{}", results[0].detail);
    let markers = std::fs::read_dir(tmp.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("marker-"))
        })
        .count();
    assert_eq!(markers, 1, "one process signalled, once");
}

/// A process that had its handler when its container was located and removed it before the
/// notice is not signalled on the cgroup path (nor on the full scan's).
#[tokio::test]
async fn process_that_removed_its_handler_is_not_signalled() {
    let mut tree = CgroupTree::new();
    let uid = uuid();
    let id = container_id();
    let tmp = tempfile::tempdir().unwrap();
    // USR2 removes the USR1 handler and says so
    let script = format!("trap 'trap - USR1; echo > \"$DIR/dropped\"' USR2\n{HANDLER}");
    let mut kid = held_sh(&script, &[("DIR", tmp.path().to_str().unwrap())]);
    join(&container_cgroup(&mut tree, &uid, &id), kid.pid());
    kid.release();
    let pid = kid.pid();
    let proc = ProcFs::default();
    eventually_blocking("the handler", Duration::from_secs(10), || {
        proc.status(pid).is_ok_and(|s| s.catches(Signal::USR1))
    });
    let wanted = [(uid.clone(), id.clone())];
    let mounts = cgroup_mounts();
    let (_, how, located) = find_containers(
        Path::new("/proc"),
        &mounts,
        &ContainerCgroups::default(),
        &wanted,
    )
    .unwrap();
    assert_eq!(how, FoundBy::Located);
    let located = located.unwrap();

    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::USR2,
    )
    .unwrap();
    eventually_blocking("the handler removed", Duration::from_secs(10), || {
        tmp.path().join("dropped").exists()
            && proc.status(pid).is_ok_and(|s| !s.catches(Signal::USR1))
    });
    let (index, how, _) = find_containers(Path::new("/proc"), &mounts, &located, &wanted).unwrap();
    assert_eq!(how, FoundBy::Cgroups);
    let c = index.container(&uid, &id).unwrap();
    assert_eq!(shape(&c), shape(&scan().container(&uid, &id).unwrap()));
    let group = pod_group(&uid, vec![c], tmp.path(), Duration::from_millis(500));
    let req = request();
    let m = Metrics::register(&mut Registry::default());
    let deliveries = deliver(&[group], &req, &m);
    assert!(deliveries[0].signalled_pids().is_empty());
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert_eq!(
        results[0].outcome,
        Outcome::NoHandler,
        "{}",
        results[0].detail
    );
    assert!(!tmp.path().join(format!("marker-{pid}")).exists());
    assert!(
        kid.running(),
        "never signalled: its default action would have killed it"
    );
}

// === container root confinement ===

/// A minimal root: `sh` (dash) and `sleep` with their libraries, and `/dev/null`.
fn chroot_dir(base: &Path) -> PathBuf {
    let root = base.join("root");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::create_dir_all(root.join("dev")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        root.join("dev/null"),
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::Mode::from_raw_mode(0o666),
        rustix::fs::makedev(1, 3),
    )
    .unwrap();
    std::fs::copy("/usr/bin/dash", root.join("bin/sh")).unwrap();
    std::fs::copy("/usr/bin/sleep", root.join("bin/sleep")).unwrap();
    let ldd = Command::new("ldd")
        .args(["/usr/bin/dash", "/usr/bin/sleep"])
        .output()
        .unwrap();
    for lib in String::from_utf8_lossy(&ldd.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/') && !w.ends_with(':'))
    {
        let dest = root.join(lib.trim_start_matches('/'));
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(lib, &dest).unwrap();
    }
    root
}

/// A chrooted handler shell; its `/proc/<pid>/root` is `root`. `dir` is as the process sees it.
fn chrooted(root: &Path, dir: &str, state: Option<&str>) -> Kid {
    // absolute: `PATH` below is the one inside the root
    let mut cmd = Command::new("/usr/sbin/chroot");
    cmd.arg(root)
        .args(["/bin/sh", "-c", &format!("read x\n{HANDLER}")])
        .env("DIR", dir)
        .env("PATH", "/bin")
        // the symlink test's shells cannot write their markers: expected, not worth the noise
        .stderr(Stdio::null());
    if let Some(s) = state {
        cmd.env("STATE", s);
    }
    let mut kid = Kid::spawn_held(cmd);
    kid.release();
    let pid = kid.pid();
    eventually_blocking("the chrooted handler", Duration::from_secs(10), || {
        ProcFs::default()
            .status(pid)
            .is_ok_and(|s| s.catches(Signal::USR1))
            && std::fs::read_link(format!("/proc/{pid}/root")).is_ok_and(|r| r == root)
    });
    kid
}

fn container(kid: &Kid) -> TargetContainer {
    TargetContainer {
        name: "trainer".into(),
        root_pid: Some(kid.pid()),
        init_pid: Some(kid.pid()),
        processes: vec![TargetProcess {
            pid: kid.pid(),
            start_time: ProcFs::default().start_time(kid.pid()).unwrap(),
        }],
    }
}

#[tokio::test]
async fn notice_and_acks_are_resolved_inside_the_container_root() {
    let tmp = tempfile::tempdir().unwrap();
    let root = chroot_dir(tmp.path());
    // The checkpoint dir, as the container sees it, also exists on the host under that name.
    let host_dir = tmp.path().join("ckpt");
    std::fs::create_dir(&host_dir).unwrap();
    let dir = host_dir.to_str().unwrap().to_string();
    let inside = root.join(dir.trim_start_matches('/'));

    let acker = chrooted(&root, &dir, Some("done"));
    let req = request();
    let m = Metrics::register(&mut Registry::default());
    let group = pod_group(
        "u1",
        vec![container(&acker)],
        Path::new(&dir),
        Duration::from_secs(20),
    );
    let deliveries = deliver(&[group], &req, &m);
    assert_eq!(deliveries[0].containers[0].notice, NoticeStatus::Written);
    assert!(
        inside.join("notice.json").exists(),
        "notice.json is created inside the root"
    );
    assert!(!host_dir.join("notice.json").exists(), "never on the host");
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert_eq!(results[0].outcome, Outcome::Acked, "{}", results[0].detail);
    assert!(inside.join(format!("ack-{}.json", acker.pid())).exists());

    // A host-side ack under the same path is not the container's ack.
    let silent = chrooted(&root, &dir, None);
    let group = pod_group(
        "u2",
        vec![container(&silent)],
        Path::new(&dir),
        Duration::from_millis(1500),
    );
    let deliveries = deliver(&[group], &req, &m);
    std::fs::write(host_dir.join("ack"), b"").unwrap();
    std::fs::write(
        host_dir.join(format!("ack-{}.json", silent.pid())),
        r#"{"state":"done"}"#,
    )
    .unwrap();
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert_eq!(
        results[0].outcome,
        Outcome::Timeout,
        "{}",
        results[0].detail
    );
    assert!(inside.join(format!("marker-{}", silent.pid())).exists());
}

#[tokio::test]
async fn symlinks_planted_in_the_container_never_reach_the_host() {
    let tmp = tempfile::tempdir().unwrap();
    let root = chroot_dir(tmp.path());
    let host_target = tmp.path().join("host-target");
    std::fs::create_dir(&host_target).unwrap();
    let tag = format!("sg-ckpt-{:016x}", fastrand::u64(..));
    // /<tag>-abs -> host path (absolute), /<tag>-rel -> ../../../../host path (relative)
    std::os::unix::fs::symlink(&host_target, root.join(format!("{tag}-abs"))).unwrap();
    let up = "../".repeat(host_target.components().count() + 3);
    std::os::unix::fs::symlink(
        format!(
            "{up}{}",
            host_target.to_str().unwrap().trim_start_matches('/')
        ),
        root.join(format!("{tag}-rel")),
    )
    .unwrap();
    // a real dir whose `ack` is a symlink to a fresh host file
    let host_ack = tmp.path().join("host-ack");
    std::fs::create_dir(root.join(format!("{tag}-dir"))).unwrap();
    std::os::unix::fs::symlink(&host_ack, root.join(format!("{tag}-dir/ack"))).unwrap();

    let req = request();
    let m = Metrics::register(&mut Registry::default());
    let mut kids = Vec::new();
    let mut groups = Vec::new();
    for suffix in ["abs", "rel", "dir"] {
        let dir = format!("/{tag}-{suffix}");
        let kid = chrooted(&root, &dir, None);
        groups.push(pod_group(
            &format!("u-{suffix}"),
            vec![container(&kid)],
            Path::new(&dir),
            Duration::from_millis(1500),
        ));
        kids.push(kid);
    }
    let deliveries = deliver(&groups, &req, &m);
    std::fs::write(&host_ack, b"").unwrap();
    for d in &deliveries {
        // signalled anyway: the checkpoint matters more than the notice
        assert_eq!(d.state, DeliveryState::Signalled);
    }
    // the symlinked dirs resolve inside the root, where their target does not exist
    assert!(matches!(
        deliveries[0].containers[0].notice,
        NoticeStatus::Failed(_)
    ));
    assert!(matches!(
        deliveries[1].containers[0].notice,
        NoticeStatus::Failed(_)
    ));
    assert_eq!(deliveries[2].containers[0].notice, NoticeStatus::Written);
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    for r in &results {
        assert_eq!(r.outcome, Outcome::Timeout, "{}: {}", r.group, r.detail);
    }
    assert!(
        results[0].detail.contains("notice.json not written"),
        "{}",
        results[0].detail
    );
    assert_eq!(
        std::fs::read_dir(&host_target).unwrap().count(),
        0,
        "host dir untouched"
    );
    assert!(!Path::new(&format!("/{tag}-abs")).exists());
    assert!(!Path::new(&format!("/{tag}-dir")).exists());
    assert_eq!(std::fs::read(&host_ack).unwrap(), b"");
}
