//! Kubernetes peers (docs/relay.md, "Kubernetes"): each receiving agent advertises itself in a
//! `coordination.k8s.io/v1` Lease of its own in the agent's namespace, `spotguard-relay-<node>`
//! (the own-node policy lets only that node's agent write it), and every sender keeps the list
//! of peers those Leases describe, read in the background, so that picking peers at a notice
//! needs no API call.
//!
//! - [`Advertiser`]: this agent's Lease, renewed every [`RENEW`]: its address and port, the
//!   staging volume's free bytes (less what is reserved), its zone and capacity type (from its
//!   Node's labels), its certificate's fingerprint, and whether it is under notice — marked
//!   after the checkpoint signal, by the Lease's own task, never before or in the signal's way;
//! - [`PeerList`]: the Leases read every [`REFRESH`]; [`PeerList::peers`] drops stale Leases
//!   (not renewed for their duration, as this agent observes it: clock skew does not count), its
//!   own, and those under notice, and orders the rest: on-demand capacity first (a reclaim takes
//!   a spot pool at once), then its own zone, then the most free space;
//! - [`Peers`]: what the sender tries, in order: the configured ones (host mode) or the list.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use kube::api::{ListParams, Patch, PatchParams};
use kube::Api;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::send::Peer;

/// Every Lease's name: this, then the node's name (cut to the API's 253 characters, as the
/// own-node policy cuts it).
pub const NAME_PREFIX: &str = "spotguard-relay-";
/// The label every relay Lease carries (the list's selector).
pub const LABEL: &str = "spotguard.io/relay";
/// The annotations a Lease advertises.
pub const ADDRESS: &str = "relay.spotguard.io/address";
pub const FINGERPRINT: &str = "relay.spotguard.io/fingerprint";
pub const FREE_BYTES: &str = "relay.spotguard.io/free-bytes";
pub const ZONE: &str = "relay.spotguard.io/zone";
pub const CAPACITY: &str = "relay.spotguard.io/capacity-type";
pub const UNDER_NOTICE: &str = "relay.spotguard.io/under-notice";
/// The Lease is renewed this often …
pub const RENEW: Duration = Duration::from_secs(10);
/// … and is stale when not renewed for this long.
pub const DURATION: Duration = Duration::from_secs(30);
/// Senders read the Leases this often.
pub const REFRESH: Duration = Duration::from_secs(10);
/// An API call of the Lease's or the list's is done within this.
const CALL: Duration = Duration::from_secs(10);
/// The node's zone label.
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// The Lease name of `node`'s agent.
pub fn lease_name(node: &str) -> String {
    let mut name = format!("{NAME_PREFIX}{node}");
    name.truncate(253);
    name
}

/// Whether a node is on capacity that a provider may reclaim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Capacity {
    OnDemand,
    Unknown,
    Spot,
}

impl Capacity {
    pub fn as_str(self) -> &'static str {
        match self {
            Capacity::OnDemand => "on-demand",
            Capacity::Unknown => "unknown",
            Capacity::Spot => "spot",
        }
    }

    fn parse(text: &str) -> Capacity {
        match text {
            "on-demand" => Capacity::OnDemand,
            "spot" => Capacity::Spot,
            _ => Capacity::Unknown,
        }
    }

    /// From the well-known labels: Karpenter, GKE (spot and preemptible, and its provisioning
    /// model), EKS managed node groups, AKS scale sets.
    pub fn of(labels: &BTreeMap<String, String>) -> Capacity {
        let get = |k: &str| labels.get(k).map(String::as_str);
        if let Some(v) = get("karpenter.sh/capacity-type") {
            return match v {
                "spot" => Capacity::Spot,
                "on-demand" | "reserved" => Capacity::OnDemand,
                _ => Capacity::Unknown,
            };
        }
        if get("cloud.google.com/gke-spot") == Some("true")
            || get("cloud.google.com/gke-preemptible") == Some("true")
        {
            return Capacity::Spot;
        }
        if let Some(v) = get("cloud.google.com/gke-provisioning") {
            return match v {
                "spot" | "preemptible" => Capacity::Spot,
                "standard" => Capacity::OnDemand,
                _ => Capacity::Unknown,
            };
        }
        if let Some(v) = get("eks.amazonaws.com/capacityType") {
            return match v {
                "SPOT" => Capacity::Spot,
                "ON_DEMAND" => Capacity::OnDemand,
                _ => Capacity::Unknown,
            };
        }
        if let Some(v) = get("kubernetes.azure.com/scalesetpriority") {
            return match v {
                "spot" => Capacity::Spot,
                "regular" => Capacity::OnDemand,
                _ => Capacity::Unknown,
            };
        }
        Capacity::Unknown
    }
}

/// Where this node is: its zone and capacity type.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    pub zone: Option<String>,
    pub capacity: Option<Capacity>,
    /// The Node's uid: the Lease is the Node's dependent (gone with it).
    pub uid: Option<String>,
}

impl Placement {
    /// Read from `node`'s labels (one `get` of the Node the agent already may read).
    pub async fn of_node(client: &kube::Client, node: &str) -> Result<Placement, kube::Error> {
        let n = Api::<Node>::all(client.clone()).get(node).await?;
        let labels = n.metadata.labels.unwrap_or_default();
        Ok(Placement {
            zone: labels.get(ZONE_LABEL).cloned(),
            capacity: Some(Capacity::of(&labels)),
            uid: n.metadata.uid,
        })
    }
}

/// What a Lease advertises.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Advert {
    pub addr: SocketAddr,
    pub fingerprint: [u8; 32],
    pub free_bytes: u64,
    pub zone: Option<String>,
    pub capacity: Capacity,
    pub under_notice: bool,
}

impl Advert {
    fn annotations(&self) -> BTreeMap<String, String> {
        let mut a = BTreeMap::new();
        a.insert(ADDRESS.into(), self.addr.to_string());
        a.insert(FINGERPRINT.into(), super::tls::hex(&self.fingerprint));
        a.insert(FREE_BYTES.into(), self.free_bytes.to_string());
        if let Some(z) = &self.zone {
            a.insert(ZONE.into(), z.clone());
        }
        a.insert(CAPACITY.into(), self.capacity.as_str().into());
        a.insert(UNDER_NOTICE.into(), self.under_notice.to_string());
        a
    }

    /// A Lease's advert; `None` when it does not hold one (every value is checked: a Lease is
    /// input like any other).
    pub fn parse(annotations: &BTreeMap<String, String>) -> Option<Advert> {
        let get = |k: &str| annotations.get(k);
        Some(Advert {
            addr: get(ADDRESS)?.parse().ok()?,
            fingerprint: super::tls::parse_fingerprint(get(FINGERPRINT)?).ok()?,
            free_bytes: get(FREE_BYTES)?.parse().ok()?,
            zone: get(ZONE)
                .filter(|z| !z.is_empty() && z.len() <= 253)
                .cloned(),
            capacity: get(CAPACITY).map_or(Capacity::Unknown, |c| Capacity::parse(c)),
            under_notice: get(UNDER_NOTICE).is_some_and(|v| v == "true"),
        })
    }
}

/// This agent's Lease.
pub struct Advertiser {
    api: Api<Lease>,
    client: kube::Client,
    node: String,
    addr: SocketAddr,
    fingerprint: [u8; 32],
    /// Read from the Node by the Lease's task (until then the Lease says no zone, `unknown`).
    placement: Mutex<Option<Placement>>,
    /// The free bytes to advertise now.
    free: Box<dyn Fn() -> u64 + Send + Sync>,
    under_notice: AtomicBool,
    changed: Notify,
}

impl Advertiser {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        node: &str,
        addr: SocketAddr,
        fingerprint: [u8; 32],
        free: Box<dyn Fn() -> u64 + Send + Sync>,
    ) -> Advertiser {
        Advertiser {
            api: Api::namespaced(client.clone(), namespace),
            client,
            node: node.to_string(),
            addr,
            fingerprint,
            placement: Mutex::new(None),
            free,
            under_notice: AtomicBool::new(false),
            changed: Notify::new(),
        }
    }

    /// Mark this node under notice (or no longer): the Lease says so at its next write, made at
    /// once by the Lease's task. Never waits.
    pub fn under_notice(&self, yes: bool) {
        if self.under_notice.swap(yes, Ordering::SeqCst) != yes {
            self.changed.notify_one();
        }
    }

    fn advert(&self) -> Advert {
        let placement = crate::sync::lock(&self.placement)
            .clone()
            .unwrap_or_default();
        Advert {
            addr: self.addr,
            fingerprint: self.fingerprint,
            free_bytes: (self.free)(),
            zone: placement.zone,
            capacity: placement.capacity.unwrap_or(Capacity::Unknown),
            under_notice: self.under_notice.load(Ordering::SeqCst),
        }
    }

    /// Write the Lease now (server-side apply: created or renewed), reading the Node's
    /// placement first while it is not known.
    pub async fn write(&self) -> Result<(), kube::Error> {
        if crate::sync::lock(&self.placement).is_none() {
            let p = Placement::of_node(&self.client, &self.node).await?;
            *crate::sync::lock(&self.placement) = Some(p);
        }
        let name = lease_name(&self.node);
        let uid = crate::sync::lock(&self.placement)
            .as_ref()
            .and_then(|p| p.uid.clone());
        // Owned by its Node: the garbage collector removes it with the Node.
        let owner = uid.map(|uid| {
            vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: self.node.clone(),
                uid,
                ..OwnerReference::default()
            }]
        });
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(BTreeMap::from([(LABEL.to_string(), "agent".to_string())])),
                annotations: Some(self.advert().annotations()),
                owner_references: owner,
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.node.clone()),
                lease_duration_seconds: Some(DURATION.as_secs() as i32),
                renew_time: Some(MicroTime(jiff::Timestamp::now())),
                ..LeaseSpec::default()
            }),
        };
        let mut value = serde_json::to_value(&lease).unwrap_or_default();
        value["apiVersion"] = "coordination.k8s.io/v1".into();
        value["kind"] = "Lease".into();
        self.api
            .patch(
                &name,
                &PatchParams::apply("spotguard-relay").force(),
                &Patch::Apply(value),
            )
            .await
            .map(|_| ())
    }

    /// Renew the Lease every [`RENEW`], and at once when the notice mark changes, until
    /// `cancel`. A failed write is logged and tried again at the next turn.
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        let mut failing = false;
        loop {
            match tokio::time::timeout(CALL, self.write()).await {
                Ok(Ok(())) => {
                    if failing {
                        info!(node = %self.node, "relay Lease renewed again");
                    }
                    failing = false;
                }
                Ok(Err(e)) => {
                    if !failing {
                        warn!(node = %self.node, error = %e, "cannot write the relay Lease; retrying");
                    }
                    failing = true;
                }
                Err(_) => {
                    if !failing {
                        warn!(node = %self.node, "the relay Lease's write did not finish in time; retrying");
                    }
                    failing = true;
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(RENEW) => {}
                _ = self.changed.notified() => {}
            }
        }
    }
}

/// One peer as its Lease says.
#[derive(Clone, Debug)]
struct Entry {
    node: String,
    advert: Advert,
    renew: Option<jiff::Timestamp>,
    duration: Duration,
    /// When this agent saw the Lease's renewal last change (at first sight, backdated by the
    /// renewal's age on this clock).
    seen: Instant,
}

/// The peers the Leases advertise, kept by a background task.
pub struct PeerList {
    api: Api<Lease>,
    node: String,
    placement: Mutex<Option<Placement>>,
    client: kube::Client,
    entries: Mutex<HashMap<String, Entry>>,
}

impl PeerList {
    /// The Leases in `namespace`, for the agent on `node`.
    pub fn new(client: kube::Client, namespace: &str, node: &str) -> PeerList {
        PeerList {
            api: Api::namespaced(client.clone(), namespace),
            node: node.to_string(),
            placement: Mutex::new(None),
            client,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// This node's own placement, when already known (else it is read with the first list).
    pub fn with_placement(self, placement: Placement) -> PeerList {
        *crate::sync::lock(&self.placement) = Some(placement);
        self
    }

    /// Read the Leases once.
    pub async fn refresh(&self) -> Result<usize, kube::Error> {
        if crate::sync::lock(&self.placement).is_none() {
            let p = Placement::of_node(&self.client, &self.node).await?;
            *crate::sync::lock(&self.placement) = Some(p);
        }
        let leases = self
            .api
            // From the API server's watch cache (`resourceVersion=0`), not a quorum read of etcd:
            // every agent lists every 10 s.
            .list(
                &ListParams::default()
                    .labels(&format!("{LABEL}=agent"))
                    .match_any(),
            )
            .await?;
        let now = Instant::now();
        let wall = jiff::Timestamp::now();
        let mut entries = crate::sync::lock(&self.entries);
        let mut next = HashMap::new();
        for lease in leases {
            let Some(entry) = self.entry(&lease, now, wall, entries.get(&lease_key(&lease))) else {
                continue;
            };
            next.insert(entry.node.clone(), entry);
        }
        *entries = next;
        Ok(entries.len())
    }

    fn entry(
        &self,
        lease: &Lease,
        now: Instant,
        wall: jiff::Timestamp,
        before: Option<&Entry>,
    ) -> Option<Entry> {
        let spec = lease.spec.as_ref()?;
        let node = spec.holder_identity.clone()?;
        // A Lease of another name than its holder's is none of an agent's.
        if lease.metadata.name.as_deref() != Some(lease_name(&node).as_str()) {
            return None;
        }
        let advert = Advert::parse(lease.metadata.annotations.as_ref()?)?;
        let duration = Duration::from_secs(
            spec.lease_duration_seconds
                .filter(|d| *d > 0)
                .map_or(DURATION.as_secs(), |d| (d as u64).min(3600)),
        );
        let renew = spec.renew_time.as_ref().map(|t| t.0);
        let seen = seen_at(
            before.map(|b| (b.renew, b.seen)),
            renew,
            now,
            wall,
            duration,
        );
        Some(Entry {
            node,
            advert,
            renew,
            duration,
            seen,
        })
    }

    /// The peers to try now, best first. No API call.
    pub fn peers(&self) -> Vec<Peer> {
        let now = Instant::now();
        let own = crate::sync::lock(&self.placement)
            .clone()
            .unwrap_or_default();
        let entries = crate::sync::lock(&self.entries);
        let mut live: Vec<&Entry> = entries
            .values()
            .filter(|e| e.node != self.node)
            .filter(|e| !e.advert.under_notice)
            .filter(|e| live(e.seen, e.duration, now))
            .collect();
        live.sort_by(|a, b| {
            let key = |e: &Entry| {
                (
                    e.advert.capacity,
                    own.zone.is_none() || e.advert.zone != own.zone,
                    std::cmp::Reverse(e.advert.free_bytes),
                )
            };
            key(a).cmp(&key(b)).then_with(|| a.node.cmp(&b.node))
        });
        live.iter()
            .map(|e| Peer {
                addr: e.advert.addr.to_string(),
                fingerprint: e.advert.fingerprint,
            })
            .collect()
    }

    /// Read the Leases every [`REFRESH`] until `cancel`; a failed read keeps the last list (its
    /// entries go stale on their own).
    pub async fn follow(self: Arc<Self>, cancel: CancellationToken) {
        let mut failing = false;
        loop {
            match tokio::time::timeout(CALL, self.refresh()).await {
                Ok(Ok(n)) => {
                    if failing {
                        info!(peers = n, "relay peers read again");
                    }
                    debug!(peers = n, "relay peers read");
                    failing = false;
                }
                Ok(Err(e)) => {
                    if !failing {
                        warn!(error = %e, "cannot read the relay peers' Leases; retrying");
                    }
                    failing = true;
                }
                Err(_) => {
                    if !failing {
                        warn!("reading the relay peers' Leases did not finish in time; retrying");
                    }
                    failing = true;
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(REFRESH) => {}
            }
        }
    }
}

/// When this agent counts a Lease's renewal `renew` as seen: when it first saw that renewal
/// (`before`: the renewal it saw last, and when), else `now` less the renewal's age on this
/// clock — a renewal ahead of this clock is new, none at all is stale. Only the first sight
/// reads the wall clock: after it, a Lease is live while its renewal keeps changing, however
/// far the writer's clock is from this one.
fn seen_at(
    before: Option<(Option<jiff::Timestamp>, Instant)>,
    renew: Option<jiff::Timestamp>,
    now: Instant,
    wall: jiff::Timestamp,
    duration: Duration,
) -> Instant {
    match before {
        Some((r, seen)) if r == renew => seen,
        _ => {
            let age = renew.map_or(Duration::MAX, |r| {
                Duration::try_from(wall.duration_since(r)).unwrap_or(Duration::ZERO)
            });
            now.checked_sub(age).unwrap_or_else(|| {
                now.checked_sub(duration + Duration::from_secs(1))
                    .unwrap_or(now)
            })
        }
    }
}

/// A Lease seen renewed at `seen` is live at `now` within its `duration`.
fn live(seen: Instant, duration: Duration, now: Instant) -> bool {
    now.saturating_duration_since(seen) <= duration
}

fn lease_key(lease: &Lease) -> String {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.clone())
        .unwrap_or_default()
}

/// The peers a sender tries, in order.
#[derive(Clone)]
pub enum Peers {
    /// Host mode: `--relay-peers`.
    Fixed(Vec<Peer>),
    /// Kubernetes: the Leases' peers as last read.
    Found(Arc<PeerList>),
}

impl Peers {
    pub fn current(&self) -> Vec<Peer> {
        match self {
            Peers::Fixed(p) => p.clone(),
            Peers::Found(list) => list.peers(),
        }
    }
}

impl From<Vec<Peer>> for Peers {
    fn from(p: Vec<Peer>) -> Peers {
        Peers::Fixed(p)
    }
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peers::Fixed(p) => f.debug_tuple("Fixed").field(p).finish(),
            Peers::Found(_) => f.write_str("Found(Leases)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn capacity_comes_from_each_providers_label() {
        for (pairs, want) in [
            (
                &[("karpenter.sh/capacity-type", "spot")][..],
                Capacity::Spot,
            ),
            (
                &[("karpenter.sh/capacity-type", "on-demand")][..],
                Capacity::OnDemand,
            ),
            (&[("cloud.google.com/gke-spot", "true")][..], Capacity::Spot),
            (
                &[("cloud.google.com/gke-provisioning", "standard")][..],
                Capacity::OnDemand,
            ),
            (
                &[("eks.amazonaws.com/capacityType", "SPOT")][..],
                Capacity::Spot,
            ),
            (
                &[("eks.amazonaws.com/capacityType", "ON_DEMAND")][..],
                Capacity::OnDemand,
            ),
            (
                &[("kubernetes.azure.com/scalesetpriority", "spot")][..],
                Capacity::Spot,
            ),
            (
                &[("kubernetes.azure.com/scalesetpriority", "regular")][..],
                Capacity::OnDemand,
            ),
            (&[("kubernetes.io/os", "linux")][..], Capacity::Unknown),
        ] {
            assert_eq!(Capacity::of(&labels(pairs)), want, "{pairs:?}");
        }
    }

    #[test]
    fn an_advert_round_trips_and_a_broken_one_is_none() {
        let a = Advert {
            addr: "10.0.0.7:7443".parse().unwrap(),
            fingerprint: [7; 32],
            free_bytes: 1 << 40,
            zone: Some("us-east-1a".into()),
            capacity: Capacity::OnDemand,
            under_notice: true,
        };
        assert_eq!(Advert::parse(&a.annotations()), Some(a.clone()));
        let mut broken = a.annotations();
        broken.insert(FINGERPRINT.into(), "zz".into());
        assert_eq!(Advert::parse(&broken), None);
        let mut broken = a.annotations();
        broken.insert(ADDRESS.into(), "not an address".into());
        assert_eq!(Advert::parse(&broken), None);
    }

    #[test]
    fn a_lease_is_stale_when_its_renewal_stops_changing_whatever_the_writers_clock() {
        let d = DURATION;
        let t0 = Instant::now() + Duration::from_secs(7200);
        let wall = jiff::Timestamp::now();
        let secs = |s: i64| jiff::SignedDuration::from_secs(s);
        // First sight: its age on this clock.
        let fresh = Some(wall - secs(5));
        let seen = seen_at(None, fresh, t0, wall, d);
        assert!(live(seen, d, t0));
        assert!(!live(seen, d, t0 + d));
        assert!(!live(
            seen_at(None, Some(wall - secs(3600)), t0, wall, d),
            d,
            t0
        ));
        assert!(!live(seen_at(None, None, t0, wall, d), d, t0));
        // A writer ten minutes ahead: live while it renews, stale once it stops.
        let ahead = Some(wall + secs(600));
        let seen = seen_at(None, ahead, t0, wall, d);
        assert!(live(seen, d, t0));
        let later = t0 + Duration::from_secs(20);
        let again = seen_at(Some((ahead, seen)), ahead, later, wall + secs(20), d);
        assert_eq!(again, seen, "the same renewal keeps its first sight");
        assert!(!live(again, d, t0 + d + Duration::from_secs(1)));
        let renewed = Some(wall + secs(620));
        let seen = seen_at(Some((ahead, seen)), renewed, later, wall + secs(20), d);
        assert_eq!(seen, later);
        assert!(live(seen, d, later + d));
    }

    #[test]
    fn a_lease_name_is_cut_to_the_apis_length() {
        assert_eq!(lease_name("node-a"), "spotguard-relay-node-a");
        assert_eq!(lease_name(&"n".repeat(300)).len(), 253);
    }
}
