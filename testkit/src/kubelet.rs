//! What the kubelet would make of a pod on this node, for tests that put real processes into
//! pods of the fake API server: random pod uids and container ids, and the cgroup the kubelet
//! creates for a container (systemd cgroup driver, Burstable QoS, containerd).

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
