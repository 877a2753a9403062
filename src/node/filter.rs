//! Which pods a drain evicts: a pure function over k8s-openapi Pods.
//!
//! Skipped, in this order of precedence: spotguard's own pod, mirror (static) pods, pods whose
//! controller is a DaemonSet (the DaemonSet controller would recreate them on this node at once,
//! and they tolerate the unschedulable taint), and finished pods (Succeeded / Failed: nothing
//! runs, nothing to stop). Everything else is evicted, including pods already terminating (the
//! drain waits for them) and bare pods without a controller.

use k8s_openapi::api::core::v1::Pod;

/// Annotation the kubelet sets on the API-server mirror of a static pod.
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// Why a pod is left alone by a drain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SkipReason {
    /// spotguard's own pod (it must outlive the drain to report it).
    Own,
    /// Mirror of a static pod: the API server cannot delete the real one.
    Mirror,
    /// Controlled by a DaemonSet.
    DaemonSet,
    /// Phase Succeeded or Failed.
    Finished,
}

impl SkipReason {
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::Own => "own",
            SkipReason::Mirror => "mirror",
            SkipReason::DaemonSet => "daemonset",
            SkipReason::Finished => "finished",
        }
    }
}

/// What a drain does with one pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Evict,
    Skip(SkipReason),
}

/// `namespace/name` of a pod (empty parts when the API left them out).
pub fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}

/// Decide what to do with one pod. `own` is spotguard's own pod as `(namespace, name)`.
pub fn classify(pod: &Pod, own: Option<(&str, &str)>) -> Decision {
    if let Some((own_ns, own_name)) = own {
        if pod.metadata.namespace.as_deref() == Some(own_ns)
            && pod.metadata.name.as_deref() == Some(own_name)
        {
            return Decision::Skip(SkipReason::Own);
        }
    }
    if pod
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(MIRROR_ANNOTATION))
    {
        return Decision::Skip(SkipReason::Mirror);
    }
    // Like kubectl drain: the controller reference (controller == true), kind DaemonSet.
    let daemonset_controlled = pod.metadata.owner_references.as_ref().is_some_and(|refs| {
        refs.iter()
            .any(|r| r.controller == Some(true) && r.kind == "DaemonSet")
    });
    if daemonset_controlled {
        return Decision::Skip(SkipReason::DaemonSet);
    }
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Succeeded") | Some("Failed")) {
        return Decision::Skip(SkipReason::Finished);
    }
    Decision::Evict
}

/// Split the pods on a node into those to evict and those skipped (`namespace/name`, reason).
pub fn partition(
    pods: Vec<Pod>,
    own: Option<(&str, &str)>,
) -> (Vec<Pod>, Vec<(String, SkipReason)>) {
    let mut evict = Vec::new();
    let mut skipped = Vec::new();
    for pod in pods {
        match classify(&pod, own) {
            Decision::Evict => evict.push(pod),
            Decision::Skip(reason) => skipped.push((pod_key(&pod), reason)),
        }
    }
    (evict, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
    use std::collections::BTreeMap;

    const OWN: Option<(&str, &str)> = Some(("spotguard", "agent-x"));

    fn owner(kind: &str, api_version: &str, controller: Option<bool>) -> OwnerReference {
        OwnerReference {
            api_version: api_version.to_string(),
            kind: kind.to_string(),
            name: "owner".to_string(),
            uid: "u-owner".to_string(),
            controller,
            block_owner_deletion: None,
        }
    }

    fn pod(ns: &str, name: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                namespace: Some(ns.to_string()),
                name: Some(name.to_string()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn with_phase(mut p: Pod, phase: &str) -> Pod {
        p.status = Some(PodStatus {
            phase: Some(phase.to_string()),
            ..Default::default()
        });
        p
    }

    fn with_owner(mut p: Pod, o: OwnerReference) -> Pod {
        p.metadata
            .owner_references
            .get_or_insert_with(Vec::new)
            .push(o);
        p
    }

    fn mirrored(mut p: Pod) -> Pod {
        p.metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(MIRROR_ANNOTATION.to_string(), "abc123".to_string());
        p
    }

    #[test]
    fn plain_pods_are_evicted_whatever_their_phase_before_finishing() {
        for phase in ["Pending", "Running", "Unknown"] {
            assert_eq!(
                classify(&with_phase(pod("a", "b"), phase), OWN),
                Decision::Evict,
                "{phase}"
            );
        }
        // No status at all (just created) and a bare pod without any owner.
        assert_eq!(classify(&pod("a", "b"), OWN), Decision::Evict);
        assert_eq!(classify(&pod("a", "b"), None), Decision::Evict);
    }

    #[test]
    fn replicated_and_job_pods_are_evicted() {
        for (kind, av) in [
            ("ReplicaSet", "apps/v1"),
            ("StatefulSet", "apps/v1"),
            ("Job", "batch/v1"),
            ("PyTorchJob", "kubeflow.org/v1"),
        ] {
            let p = with_owner(
                with_phase(pod("a", "b"), "Running"),
                owner(kind, av, Some(true)),
            );
            assert_eq!(classify(&p, OWN), Decision::Evict, "{kind}");
        }
    }

    #[test]
    fn finished_pods_are_skipped() {
        for phase in ["Succeeded", "Failed"] {
            assert_eq!(
                classify(&with_phase(pod("a", "b"), phase), OWN),
                Decision::Skip(SkipReason::Finished)
            );
        }
    }

    #[test]
    fn daemonset_needs_the_controller_reference() {
        let ds = with_owner(pod("a", "b"), owner("DaemonSet", "apps/v1", Some(true)));
        assert_eq!(classify(&ds, OWN), Decision::Skip(SkipReason::DaemonSet));
        // A non-controller owner reference of kind DaemonSet does not make a DaemonSet pod.
        for controller in [None, Some(false)] {
            let p = with_owner(pod("a", "b"), owner("DaemonSet", "apps/v1", controller));
            assert_eq!(classify(&p, OWN), Decision::Evict);
        }
        // Controller of another kind next to a non-controller DaemonSet reference.
        let p = with_owner(
            with_owner(pod("a", "b"), owner("DaemonSet", "apps/v1", Some(false))),
            owner("ReplicaSet", "apps/v1", Some(true)),
        );
        assert_eq!(classify(&p, OWN), Decision::Evict);
        // Same kind from another API group (e.g. OpenKruise's Advanced DaemonSet): like kubectl,
        // the kind decides.
        let p = with_owner(
            pod("a", "b"),
            owner("DaemonSet", "apps.kruise.io/v1alpha1", Some(true)),
        );
        assert_eq!(classify(&p, OWN), Decision::Skip(SkipReason::DaemonSet));
    }

    #[test]
    fn mirror_annotation_marks_static_pods() {
        assert_eq!(
            classify(&mirrored(pod("kube-system", "etcd-n1")), OWN),
            Decision::Skip(SkipReason::Mirror)
        );
        let mut other = pod("a", "b");
        other
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert("kubernetes.io/config.source".into(), "api".into());
        assert_eq!(classify(&other, OWN), Decision::Evict);
    }

    #[test]
    fn own_pod_matches_namespace_and_name() {
        assert_eq!(
            classify(&pod("spotguard", "agent-x"), OWN),
            Decision::Skip(SkipReason::Own)
        );
        assert_eq!(classify(&pod("default", "agent-x"), OWN), Decision::Evict);
        assert_eq!(classify(&pod("spotguard", "agent-y"), OWN), Decision::Evict);
        assert_eq!(
            classify(&pod("spotguard", "agent-x"), None),
            Decision::Evict
        );
        // A pod with no name or namespace never matches.
        let mut anon = pod("spotguard", "agent-x");
        anon.metadata.namespace = None;
        assert_eq!(classify(&anon, OWN), Decision::Evict);
    }

    /// Every combination of the four properties: the first one in precedence order decides.
    #[test]
    fn every_combination_follows_precedence() {
        for bits in 0u8..16 {
            let (own, mirror, ds, finished) =
                (bits & 1 != 0, bits & 2 != 0, bits & 4 != 0, bits & 8 != 0);
            let mut p = if own {
                pod("spotguard", "agent-x")
            } else {
                pod("team", "trainer-0")
            };
            if mirror {
                p = mirrored(p);
            }
            if ds {
                p = with_owner(p, owner("DaemonSet", "apps/v1", Some(true)));
            }
            p = with_phase(p, if finished { "Failed" } else { "Running" });
            let expected = if own {
                Decision::Skip(SkipReason::Own)
            } else if mirror {
                Decision::Skip(SkipReason::Mirror)
            } else if ds {
                Decision::Skip(SkipReason::DaemonSet)
            } else if finished {
                Decision::Skip(SkipReason::Finished)
            } else {
                Decision::Evict
            };
            assert_eq!(
                classify(&p, OWN),
                expected,
                "own={own} mirror={mirror} ds={ds} finished={finished}"
            );
        }
    }

    #[test]
    fn partition_keeps_order_and_names_skipped_pods() {
        let pods = vec![
            with_phase(pod("a", "p1"), "Running"),
            with_owner(
                pod("kube-system", "fluentd-x"),
                owner("DaemonSet", "apps/v1", Some(true)),
            ),
            with_phase(pod("a", "p2"), "Succeeded"),
            pod("spotguard", "agent-x"),
            with_phase(pod("b", "p3"), "Pending"),
        ];
        let (evict, skipped) = partition(pods, OWN);
        let names: Vec<String> = evict.iter().map(pod_key).collect();
        assert_eq!(names, vec!["a/p1", "b/p3"]);
        assert_eq!(
            skipped,
            vec![
                ("kube-system/fluentd-x".to_string(), SkipReason::DaemonSet),
                ("a/p2".to_string(), SkipReason::Finished),
                ("spotguard/agent-x".to_string(), SkipReason::Own),
            ]
        );
    }
}
