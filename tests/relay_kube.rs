//! The relay in Kubernetes (docs/relay.md, "Kubernetes") against a real control plane, with the
//! shipped permissions (the relay component's roles, the own-node policy): a receiver accepts
//! only a relay token of the agents' ServiceAccount bound to a node (TokenReview) and refuses
//! forged senders (no token, another ServiceAccount's, the API's audience, a wrong
//! fingerprint); an agent writes its own relay Lease with its node's placement and notice mark,
//! and the policy refuses it another node's; a sender's peers, read from real Leases, are
//! filtered (stale, its own, under notice, a Lease not named for its holder) and ordered
//! (on-demand, same zone, most free space); end to end, a peer found through its Lease takes a
//! relay under the doomed node's agent's token and publishes it to s3s-fs.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, Patch, PatchParams};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStoreExt};
use prometheus_client::registry::Registry;
use serde_json::json;
use spotguard::emulator::EmulatedNotice;
use spotguard::relay::auth::{Bearer, Reviewer, AUDIENCE};
use spotguard::relay::lease::{self, Advertiser, PeerList, Peers};
use spotguard::relay::metrics::RelayMetrics;
use spotguard::relay::receive::{self, Receiver, Settings};
use spotguard::relay::send::{self, Peer, Source};
use spotguard::relay::tls::{self, Identity};
use spotguard::relay::wire::{self, Checkpoint, Reserve};
use spotguard::store::manifest::Origin;
use spotguard::store::url::StoreOptions;
use spotguard::upload::dest::{AllowUpload, UploadPolicy};
use spotguard::upload::handoff;
use spotguard::upload::relayed::RelayPublisher;
use spotguard::upload::staged::{self, Limits, Root};
use spotguard_testkit::k8s::agents::{AgentSpec, NodeAgent};
use spotguard_testkit::k8s::controlplane::{
    mint_pod_token, mint_pod_token_for, AGENT_NAMESPACE, AGENT_SERVICE_ACCOUNT,
    FORCE_DELETE_SERVICE_ACCOUNT,
};
use spotguard_testkit::k8s::fixtures::TestPod;
use spotguard_testkit::k8s::TestCluster;
use spotguard_testkit::s3::{create_bucket, in_child, S3Server};
use spotguard_testkit::wait::until;
use tokio_util::sync::CancellationToken;

/// A pod of `service_account` in the agent's namespace bound to `node`.
async fn pod_on(k: &TestCluster, node: &str, service_account: &str, base: &str) -> Pod {
    let mut pod = TestPod::new(AGENT_NAMESPACE, &k.name(base), node)
        .daemonset()
        .build();
    pod.spec.as_mut().unwrap().service_account_name = Some(service_account.into());
    k.create_pod(&pod).await
}

/// A receiver in Kubernetes mode, reviewing tokens with `client` (the agent's); its peer and
/// `/metrics` registry.
async fn receiver(
    client: kube::Client,
    tmp: &Path,
    endpoint: Option<String>,
    cancel: &CancellationToken,
) -> (Peer, Arc<Registry>) {
    let publisher = RelayPublisher {
        policy: UploadPolicy {
            allow: vec![AllowUpload::parse("s3://ckpt").unwrap()],
            own_dirs: Vec::new(),
        },
        limits: Limits::default(),
        store: StoreOptions {
            endpoint,
            ..StoreOptions::default()
        },
        concurrency: 1,
        part_size: spotguard::upload::engine::MIN_PART_SIZE,
        journal_dir: tmp.join("state/relay"),
        metrics: None,
    };
    let identity = Identity::load_or_create(&tls::dir(&tmp.join("state"))).unwrap();
    let mut registry = Registry::default();
    let metrics = Arc::new(RelayMetrics::register(&mut registry));
    let receiver = Receiver::new(
        Settings {
            key: Vec::new(),
            staging: tmp.join("staging"),
            per_sender: 1 << 40,
            idle: Duration::from_secs(30),
            limits: Limits::default(),
            connections: receive::connection_limits(
                receive::MAX_CONNECTIONS,
                receive::MAX_CONNECTIONS_PER_SENDER,
            ),
            metrics,
        },
        Arc::new(publisher),
    )
    .unwrap()
    .with_tokens(Reviewer::new(
        client,
        AUDIENCE,
        AGENT_NAMESPACE,
        AGENT_SERVICE_ACCOUNT,
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Arc::new(receiver).serve(
        listener,
        identity.server_config().unwrap(),
        cancel.clone(),
    ));
    let peer = Peer {
        addr: addr.to_string(),
        fingerprint: identity.fingerprint,
    };
    (peer, Arc::new(registry))
}

/// A one-file staged tree and what a relay of it to `location` sends.
/// A staged checkpoint of `node`'s, relayed to `location`.
fn outgoing(tmp: &Path, location: &str, node: &str) -> (Reserve, Vec<Source>) {
    let dir = tmp.join("step-100");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("model.bin"), vec![7u8; 4096]).unwrap();
    let tree = staged::capture(&Root::host().unwrap(), &dir, &Limits::default()).unwrap();
    let (files, sources) = handoff::files_of(&tree);
    let reserve = Reserve {
        version: wire::VERSION,
        sender: node.into(),
        location: location.into(),
        namespace: None,
        checkpoint: Checkpoint {
            name: "step-100".into(),
            step: Some(100),
            part: None,
            notice: None,
            origin: Origin {
                staged: dir.display().to_string(),
                node: Some(node.into()),
                pod: None,
            },
            acked_at: None,
            writer: "host:uid:1000".into(),
        },
        files,
    };
    (reserve, sources)
}

fn refusals(registry: &Registry, reason: &str) -> u64 {
    let text = spotguard::metrics::encode(registry);
    let line = format!("spotguard_relay_refusals_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&line))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {line} in\n{text}"))
}

/// Issue 44: a forged sender (no token, another ServiceAccount's token, a token for the API's
/// audience, a wrong fingerprint) is refused; the agents' relay token bound to a node gets past
/// the check (to the receiver's own rules: here its allow-list).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubernetes_receiver_accepts_only_an_agents_relay_token() {
    let k = TestCluster::new().await;
    let node = k.node(k.node_config("relay-auth")).await;
    let node = node.name().to_string();
    let admin = k.admin();
    let agent = pod_on(&k, &node, AGENT_SERVICE_ACCOUNT, "spotguard-relay").await;
    let other = pod_on(&k, &node, FORCE_DELETE_SERVICE_ACCOUNT, "other-sa").await;
    let good = mint_pod_token_for(&admin, &agent, AUDIENCE).await.unwrap();
    let other_sa = mint_pod_token_for(&admin, &other, AUDIENCE).await.unwrap();
    let api_audience = mint_pod_token(&admin, &agent).await.unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let cancel = CancellationToken::new();
    let (peer, registry) = receiver(k.agent_client(), tmp.path(), None, &cancel).await;
    let (reserve, sources) = outgoing(tmp.path(), "s3://elsewhere/run1", &node);
    let relay = |peer: Peer, token: String| {
        let (reserve, sources) = (reserve.clone(), sources.clone());
        async move {
            send::relay(
                &peer,
                &token,
                reserve,
                sources,
                None,
                CancellationToken::new(),
            )
            .await
        }
    };

    let forged = [
        ("no token", String::new()),
        ("another ServiceAccount's token", other_sa),
        ("a token for the API's audience", api_audience),
        ("not a token", "not-a-token".to_string()),
    ];
    for (what, token) in &forged {
        let e = relay(peer.clone(), token.clone()).await.unwrap_err();
        assert!(
            matches!(e, spotguard::relay::Error::Refused { status: 401, .. }),
            "{what}: {e}"
        );
    }
    assert_eq!(refusals(&registry, "auth"), forged.len() as u64);

    // The agents' token: past the check, refused by the allow-list (403), not as a stranger.
    let e = relay(peer.clone(), good.clone()).await.unwrap_err();
    assert!(
        matches!(e, spotguard::relay::Error::Refused { status: 403, .. }),
        "{e}"
    );
    assert_eq!(refusals(&registry, "auth"), forged.len() as u64);
    // The agents' token bound to this node, for another node's checkpoint: an agent relays
    // only its own node's (the manifest's origin would name a node that never sent it).
    let (elsewhere, _) = outgoing(tmp.path(), "s3://elsewhere/run1", "another-node");
    let e = send::relay(
        &peer,
        &good,
        elsewhere,
        sources.clone(),
        None,
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&e, spotguard::relay::Error::Refused { status: 403, reason, .. } if reason.contains("bound to node")),
        "{e}"
    );
    assert_eq!(refusals(&registry, "auth"), forged.len() as u64 + 1);
    let reviewer = Reviewer::new(
        k.agent_client(),
        AUDIENCE,
        AGENT_NAMESPACE,
        AGENT_SERVICE_ACCOUNT,
    );
    assert_eq!(reviewer.review(&good).await, Ok(node.clone()));

    // A receiver the sender does not pin: no TLS, whatever the token.
    let wrong = Peer {
        fingerprint: [0; 32],
        ..peer.clone()
    };
    let e = relay(wrong, good).await.unwrap_err();
    assert!(
        matches!(
            e,
            spotguard::relay::Error::Peer { .. } | spotguard::relay::Error::Tls { .. }
        ),
        "{e}"
    );
    cancel.cancel();
}

/// A Lease as another node's agent would write it (through the admin client: the policy holds
/// only agents).
#[allow(clippy::too_many_arguments)]
fn peer_lease(
    name: &str,
    holder: &str,
    addr: &str,
    free: u64,
    zone: &str,
    capacity: &str,
    notice: bool,
    renewed: jiff::Timestamp,
) -> serde_json::Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "labels": { lease::LABEL: "agent" },
            "annotations": {
                lease::ADDRESS: addr,
                lease::FINGERPRINT: tls::hex(&[9; 32]),
                lease::FREE_BYTES: free.to_string(),
                lease::ZONE: zone,
                lease::CAPACITY: capacity,
                lease::UNDER_NOTICE: notice.to_string(),
            }
        },
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 30,
            "renewTime": serde_json::to_value(MicroTime(renewed)).unwrap(),
        }
    })
}

/// Issue 44: each agent advertises itself in its own Lease (its node's zone and capacity, its
/// notice mark), which the policy lets only that node's agent write; a sender's peers come from
/// the Leases: stale, its own, under notice and misnamed ones dropped, on-demand first, then its
/// zone, then the most free space.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_leases_are_each_nodes_own_and_give_the_peers_in_order() {
    let k = TestCluster::new().await;
    let a = k
        .node(
            k.node_config("relay-lease-a")
                .label("topology.kubernetes.io/zone", "zone-1")
                .label("karpenter.sh/capacity-type", "on-demand"),
        )
        .await;
    let b = k.node(k.node_config("relay-lease-b")).await;
    let (a, b) = (a.name().to_string(), b.name().to_string());
    let (_, client_a) = k.agent_on(&a).await;
    let leases: Api<Lease> = Api::namespaced(k.admin(), AGENT_NAMESPACE);

    // Its own Lease, with its node's placement.
    let advertiser = Advertiser::new(
        client_a.clone(),
        AGENT_NAMESPACE,
        &a,
        "10.77.0.1:7443".parse().unwrap(),
        [1; 32],
        Box::new(|| 5_000),
    );
    advertiser.write().await.expect("its own Lease");
    let own = leases.get(&lease::lease_name(&a)).await.unwrap();
    let notes = own.metadata.annotations.clone().unwrap_or_default();
    let want = BTreeMap::from([
        (lease::ZONE, "zone-1"),
        (lease::CAPACITY, "on-demand"),
        (lease::FREE_BYTES, "5000"),
        (lease::ADDRESS, "10.77.0.1:7443"),
        (lease::UNDER_NOTICE, "false"),
    ]);
    for (key, value) in want {
        assert_eq!(notes.get(key).map(String::as_str), Some(value), "{key}");
    }
    assert_eq!(
        own.spec.unwrap().holder_identity.as_deref(),
        Some(a.as_str())
    );
    // The Node's dependent: gone with the Node.
    let owners = own.metadata.owner_references.unwrap_or_default();
    assert_eq!(
        owners
            .iter()
            .map(|o| (o.kind.as_str(), o.name.as_str()))
            .collect::<Vec<_>>(),
        [("Node", a.as_str())]
    );

    // Another node's Lease, or its own held by another node: refused by the policy — once the
    // API server enforces it (it loads a new policy on its own time): a probe Lease, which
    // advertises nothing, until it is refused.
    let agent_leases: Api<Lease> = Api::namespaced(client_a.clone(), AGENT_NAMESPACE);
    let probe = lease::lease_name(&k.name("relay-probe"));
    until(
        "the own-node policy enforced",
        Duration::from_secs(60),
        || async {
            let body = json!({
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": { "name": probe },
                "spec": { "holderIdentity": k.name("relay-probe") },
            });
            let r = agent_leases
                .patch(
                    &probe,
                    &PatchParams::apply("probe").force(),
                    &Patch::Apply(body),
                )
                .await;
            matches!(r, Err(e) if e.to_string().contains("spotguard-own-node")).then_some(())
        },
    )
    .await;
    let now = jiff::Timestamp::now();
    for (name, holder) in [
        (lease::lease_name(&b), b.clone()),
        (lease::lease_name(&a), b.clone()),
    ] {
        let body = peer_lease(
            &name,
            &holder,
            "10.77.0.9:7443",
            1,
            "zone-1",
            "spot",
            false,
            now,
        );
        let e = agent_leases
            .patch(
                &name,
                &PatchParams::apply("spotguard-relay").force(),
                &Patch::Apply(body),
            )
            .await
            .expect_err("another node's Lease");
        let e = e.to_string();
        assert!(
            e.contains("spotguard-own-node") && e.contains(&a),
            "{name}: {e}"
        );
    }

    let peer = |n: &str| k.name(&format!("relay-peer-{n}"));
    // A Lease not named for its holder is no agent's.
    let body = peer_lease(
        &k.name("spotguard-relay-misnamed"),
        &peer("misnamed"),
        "10.77.1.8:7443",
        999_999,
        "zone-1",
        "on-demand",
        false,
        now,
    );
    leases
        .patch(
            &k.name("spotguard-relay-misnamed"),
            &PatchParams::apply("test").force(),
            &Patch::Apply(body),
        )
        .await
        .unwrap();

    // Peers as their agents advertise them ("unknown" last).
    let stale = now - jiff::SignedDuration::from_secs(3600);
    let others = [
        (
            "spot-z1",
            "10.77.1.1:7443",
            1_000_000,
            "zone-1",
            "spot",
            false,
            now,
        ),
        (
            "od-z2",
            "10.77.1.2:7443",
            100,
            "zone-2",
            "on-demand",
            false,
            now,
        ),
        (
            "od-z1-small",
            "10.77.1.3:7443",
            10,
            "zone-1",
            "on-demand",
            false,
            now,
        ),
        (
            "od-z1-big",
            "10.77.1.4:7443",
            50,
            "zone-1",
            "on-demand",
            false,
            now,
        ),
        (
            "noticed",
            "10.77.1.5:7443",
            999_999,
            "zone-1",
            "on-demand",
            true,
            now,
        ),
        (
            "stale",
            "10.77.1.6:7443",
            999_999,
            "zone-1",
            "on-demand",
            false,
            stale,
        ),
        ("unknown", "10.77.1.7:7443", 20, "zone-1", "", false, now),
    ];
    for (n, addr, free, zone, cap, notice, renewed) in others {
        let name = lease::lease_name(&peer(n));
        let body = peer_lease(&name, &peer(n), addr, free, zone, cap, notice, renewed);
        leases
            .patch(
                &name,
                &PatchParams::apply("test").force(),
                &Patch::Apply(body),
            )
            .await
            .unwrap();
    }
    // The list is read from the API server's watch cache: until it holds the last Lease written
    // (and so every one before it).
    let list = PeerList::new(client_a.clone(), AGENT_NAMESPACE, &a);
    let mine: Vec<String> = until(
        "the peers' Leases listed",
        Duration::from_secs(30),
        || async {
            list.refresh().await.ok()?;
            let mine: Vec<String> = list
                .peers()
                .into_iter()
                .map(|p| p.addr)
                .filter(|addr| addr.starts_with("10.77."))
                .collect();
            mine.contains(&"10.77.1.7:7443".to_string()).then_some(mine)
        },
    )
    .await;
    assert_eq!(
        mine,
        [
            "10.77.1.4:7443",
            "10.77.1.3:7443",
            "10.77.1.2:7443",
            "10.77.1.7:7443",
            "10.77.1.1:7443"
        ]
    );

    // Under notice: the next write says so, and the peers drop it.
    let from_b = PeerList::new(k.admin(), AGENT_NAMESPACE, &b);
    let listed = |want: bool| {
        let from_b = &from_b;
        async move {
            from_b.refresh().await.ok()?;
            let has = from_b.peers().iter().any(|p| p.addr == "10.77.0.1:7443");
            (has == want).then_some(())
        }
    };
    until("node A among B's peers", Duration::from_secs(30), || {
        listed(true)
    })
    .await;
    advertiser.under_notice(true);
    advertiser.write().await.unwrap();
    let own = leases.get(&lease::lease_name(&a)).await.unwrap();
    assert_eq!(
        own.metadata.annotations.unwrap_or_default()[lease::UNDER_NOTICE],
        "true"
    );
    until(
        "node A dropped from B's peers",
        Duration::from_secs(30),
        || listed(false),
    )
    .await;
}

/// Issue 44, end to end against the control plane and s3s-fs: the peer advertises itself in its
/// Lease; the doomed node's agent finds it there, presents its relay token (read from the
/// projected file) and relays; the peer reviews the token and publishes the checkpoint, which
/// is then the latest complete checkpoint a resumed job restores from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_found_through_its_lease_publishes_the_relayed_checkpoint() {
    if in_child("a_peer_found_through_its_lease_publishes_the_relayed_checkpoint").await {
        return;
    }
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), "ckpt").await;
    let k = TestCluster::new().await;
    let doomed = k.node(k.node_config("relay-doomed")).await;
    let peer_node = k.node(k.node_config("relay-peer")).await;
    let (doomed, peer_node) = (doomed.name().to_string(), peer_node.name().to_string());
    let (_, client_doomed) = k.agent_on(&doomed).await;
    let (_, client_peer) = k.agent_on(&peer_node).await;

    // The peer: its receiver, and its Lease.
    let tmp = tempfile::tempdir().unwrap();
    let cancel = CancellationToken::new();
    let (peer, registry) = receiver(
        client_peer.clone(),
        &tmp.path().join("peer"),
        Some(server.endpoint()),
        &cancel,
    )
    .await;
    let advertiser = Advertiser::new(
        client_peer,
        AGENT_NAMESPACE,
        &peer_node,
        peer.addr.parse().unwrap(),
        peer.fingerprint,
        Box::new(|| 1 << 40),
    );
    advertiser.write().await.unwrap();

    // The doomed node's agent: its peers from the Leases, its projected relay token.
    let list = Arc::new(PeerList::new(client_doomed, AGENT_NAMESPACE, &doomed));
    let peers = Peers::Found(list.clone());
    until(
        "the peer's Lease listed",
        Duration::from_secs(30),
        || async {
            list.refresh().await.ok()?;
            peers.current().contains(&peer).then_some(())
        },
    )
    .await;
    let agent = pod_on(&k, &doomed, AGENT_SERVICE_ACCOUNT, "spotguard-doomed").await;
    let token_file = tmp.path().join("token");
    std::fs::write(
        &token_file,
        mint_pod_token_for(&k.admin(), &agent, AUDIENCE)
            .await
            .unwrap(),
    )
    .unwrap();
    let bearer = Bearer::TokenFile(token_file).read().unwrap();
    let (reserve, sources) = outgoing(tmp.path(), "s3://ckpt/run1", &doomed);
    let status = send::relay(
        &peer,
        &bearer,
        reserve,
        sources,
        None,
        CancellationToken::new(),
    )
    .await
    .unwrap();
    assert_eq!(status.state, wire::State::Published, "{status:?}");
    assert_eq!(refusals(&registry, "auth"), 0);

    let store = AmazonS3Builder::from_env()
        .with_endpoint(server.endpoint())
        .with_bucket_name("ckpt")
        .with_client_options(ClientOptions::new().with_allow_http(true))
        .build()
        .unwrap();
    let manifest = store
        .get(&ObjectPath::from("run1/step-100/manifest.json"))
        .await
        .expect("the peer published the manifest")
        .bytes()
        .await
        .unwrap();
    let manifest: serde_json::Value = serde_json::from_slice(&manifest).unwrap();
    assert_eq!(manifest["origin"]["node"], doomed.as_str(), "{manifest}");
    let model = store
        .get(&ObjectPath::from("run1/step-100/model.bin"))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(model.as_ref(), vec![7u8; 4096].as_slice());
    // A Job resumed elsewhere restores from it: the latest complete checkpoint at the location
    // (what `prefetch --latest-checkpoint` and the client's `latest_checkpoint()` read) is the
    // one the peer published, naming the doomed node as its origin.
    let found = spotguard::upload::latest::latest(
        &spotguard::upload::dest::Location::parse("s3://ckpt/run1").unwrap(),
        &StoreOptions {
            endpoint: Some(server.endpoint()),
            ..StoreOptions::default()
        },
    )
    .await
    .unwrap()
    .expect("the relayed checkpoint is the latest complete one");
    assert_eq!(found.manifest.step, Some(100));
    assert_eq!(found.manifest.origin.node.as_deref(), Some(doomed.as_str()));
    cancel.cancel();
}

/// The agent as the DaemonSet runs it (its own process, the shipped privileges and permissions)
/// with the relay on: it advertises its receiver in its Lease (its address, its certificate's
/// fingerprint, its node's zone) and, once a spot interruption's plan has signalled, marks it
/// under notice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_agent_advertises_its_receiver_and_marks_its_notice() {
    let k = TestCluster::new().await;
    let node = k
        .node(
            k.node_config("relay-agent")
                .label("topology.kubernetes.io/zone", "zone-9")
                .label("cloud.google.com/gke-spot", "true"),
        )
        .await;
    let node = node.name().to_string();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("agent.kubeconfig");
    std::fs::write(&kubeconfig, k.agent_kubeconfig()).unwrap();
    let port = spotguard_testkit::k8s::child::free_port().unwrap();
    let mut spec = AgentSpec::new(env!("CARGO_BIN_EXE_spotguard"), &node, &kubeconfig);
    spec.args = vec![
        "--relay=auto".into(),
        format!("--relay-listen=127.0.0.1:{port}"),
    ];
    spec.env = vec![
        ("POD_NAMESPACE".into(), AGENT_NAMESPACE.into()),
        ("POD_SERVICE_ACCOUNT".into(), AGENT_SERVICE_ACCOUNT.into()),
    ];
    let agent = NodeAgent::start(&spec).await.expect("the agent");
    let leases: Api<Lease> = Api::namespaced(k.admin(), AGENT_NAMESPACE);
    let name = lease::lease_name(&node);
    let advert = |want_notice: &'static str| {
        let (leases, name) = (leases.clone(), name.clone());
        async move {
            let l = leases.get_opt(&name).await.ok()??;
            let notes = l.metadata.annotations?;
            (notes.get(lease::UNDER_NOTICE).map(String::as_str) == Some(want_notice))
                .then_some(notes)
        }
    };
    let notes = until("the agent's relay Lease", Duration::from_secs(60), || {
        advert("false")
    })
    .await;
    let identity = Identity::load_or_create(&tls::dir(&agent.dir().join("state"))).unwrap();
    assert_eq!(notes[lease::ADDRESS], format!("127.0.0.1:{port}"));
    assert_eq!(notes[lease::FINGERPRINT], tls::hex(&identity.fingerprint));
    assert_eq!(notes[lease::ZONE], "zone-9");
    assert_eq!(notes[lease::CAPACITY], "spot");

    agent
        .emulator
        .raise(EmulatedNotice::interruption().due_in(Duration::from_secs(120)))
        .expect("raise");
    until(
        "the Lease marked under notice",
        Duration::from_secs(60),
        || advert("true"),
    )
    .await;
    drop(agent);
}
