//! What the kubelet makes of a pod on a node: random container ids, and the cgroup the kubelet
//! creates for a container (systemd cgroup driver, containerd) by QoS class. Used by the kubelet
//! stand-in ([`crate::k8s::kubelet`]) and by tests that place real processes themselves.

use std::path::{Path, PathBuf};

/// `n` random lowercase hex digits.
pub fn hex(n: usize) -> String {
    (0..n)
        .map(|_| char::from_digit(fastrand::u32(0..16), 16).unwrap_or('0'))
        .collect()
}

/// A random pod uid (`8-4-4-4-12` hex digits, like the API server's).
pub fn pod_uid() -> String {
    format!("{}-{}-{}-{}-{}", hex(8), hex(4), hex(4), hex(4), hex(12))
}

/// A random containerd container id (64 hex digits).
pub fn container_id() -> String {
    hex(64)
}

/// The cgroup of container `container_id` of the Burstable pod `uid` under the systemd-driver
/// hierarchy `root` (e.g. `/sys/fs/cgroup/systemd`):
/// `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/cri-containerd-<id>.scope`.
/// Not created.
pub fn burstable_cgroup(root: &Path, uid: &str, container_id: &str) -> PathBuf {
    root.join("kubepods.slice/kubepods-burstable.slice")
        .join(format!(
            "kubepods-burstable-pod{}.slice",
            uid.replace('-', "_")
        ))
        .join(format!("cri-containerd-{container_id}.scope"))
}

/// A pod's QoS class, as the API server computes it (`status.qosClass`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Qos {
    Guaranteed,
    Burstable,
    BestEffort,
}

impl Qos {
    /// From `status.qosClass`; anything unknown is Burstable.
    pub fn parse(s: Option<&str>) -> Qos {
        match s {
            Some("Guaranteed") => Qos::Guaranteed,
            Some("BestEffort") => Qos::BestEffort,
            _ => Qos::Burstable,
        }
    }
}

/// The cgroup the kubelet (systemd driver, containerd) makes for container `container_id` of
/// pod `uid` of QoS class `qos` under `root`. Not created.
pub fn pod_cgroup(root: &Path, qos: Qos, uid: &str, container_id: &str) -> PathBuf {
    let uid = uid.replace('-', "_");
    let pod_slice = match qos {
        Qos::Guaranteed => root
            .join("kubepods.slice")
            .join(format!("kubepods-pod{uid}.slice")),
        Qos::Burstable => root
            .join("kubepods.slice/kubepods-burstable.slice")
            .join(format!("kubepods-burstable-pod{uid}.slice")),
        Qos::BestEffort => root
            .join("kubepods.slice/kubepods-besteffort.slice")
            .join(format!("kubepods-besteffort-pod{uid}.slice")),
    };
    pod_slice.join(format!("cri-containerd-{container_id}.scope"))
}

/// Where this machine keeps the hierarchy the kubelet's systemd driver uses: the cgroup v1
/// `name=systemd` hierarchy when mounted, else the unified (v2) hierarchy.
pub fn cgroup_root() -> PathBuf {
    let v1 = Path::new("/sys/fs/cgroup/systemd");
    if v1.join("cgroup.procs").exists() {
        v1.to_path_buf()
    } else {
        PathBuf::from("/sys/fs/cgroup")
    }
}
