#!/usr/bin/env python3
"""Kubeflow Pipelines (KFP v2): a training step on preemptible nodes, retried after a preemption
and resuming from its checkpoint.

    pip install 'kfp>=2.7,<3' 'kfp-kubernetes>=1.2,<3'
    python3 examples/kfp_pipeline.py --out pipeline.yaml     # compile; upload it to KFP

What makes the step survive a preemption:

* It runs on the spot / preemptible pool (node selector + toleration), where spotguard runs as a
  DaemonSet. The pod's annotations opt it in (`spotguard.io/checkpoint`) and name its notice dir
  (`spotguard.io/checkpoint-dir`), an emptyDir mounted there, `SPOTGUARD_DIR` set to it.
* Checkpoints go to a PersistentVolumeClaim (ReadWriteMany network storage) that outlives the pod.
* The training code is a spotguard recipe (docs/training-integration.md): on the notice it saves,
  acks and exits 143; on start it resumes from the newest checkpoint in the PVC.
* `set_retry`: KFP runs the step again when it fails. A preempted step fails (exit 143 after its
  checkpoint, or its pod evicted by spotguard's drain); the retry lands on another node (the
  preempted one is cordoned) and resumes from the checkpoint. A step that finished exits 0 and
  is not retried. Give it more retries than the preemptions you expect: KFP cannot tell a
  preemption from a failure, so each one uses a retry.
* The launcher (`python3 -m spotguard launch`) turns torchrun's 1 back into 143 under torchrun;
  for a single process it changes nothing.
"""

import argparse

from kfp import compiler, dsl, kubernetes

NOTICE_DIR = "/var/run/spotguard"
CKPT_DIR = "/ckpt"


@dsl.container_component
def train(run_name: str, steps: int):
    """One training run: resumes from the newest checkpoint under /ckpt/<run_name>."""
    return dsl.ContainerSpec(
        image="registry.example.com/team/train:latest",  # your image, with `pip install spotguard`
        command=["python3", "-m", "spotguard", "launch", "--", "python3", "/app/train.py"],
        args=["--ckpt-dir", dsl.ConcatPlaceholder([CKPT_DIR + "/", run_name]), "--steps", steps],
    )


@dsl.pipeline(name="train-on-spot")
def pipeline(run_name: str = "run-1", steps: int = 100_000, pvc: str = "train-checkpoints"):
    task = train(run_name=run_name, steps=steps)
    # Retried after a preemption (exit 143 after the checkpoint, or an evicted pod).
    task.set_retry(num_retries=10, backoff_duration="30s", backoff_factor=1.0)
    task.set_caching_options(False)  # a retry must run, not reuse a cached result
    task.set_env_variable("SPOTGUARD_DIR", NOTICE_DIR)
    # Preemptible nodes (GKE's label; EKS: eks.amazonaws.com/capacityType=SPOT).
    kubernetes.add_node_selector(task, "cloud.google.com/gke-spot", "true")
    kubernetes.add_toleration(task, key="cloud.google.com/gke-spot", operator="Equal",
                              value="true", effect="NoSchedule")
    # spotguard: opt in, and the notice dir (an emptyDir; checkpoints never go there).
    kubernetes.add_pod_annotation(task, "spotguard.io/checkpoint", "true")
    kubernetes.add_pod_annotation(task, "spotguard.io/checkpoint-dir", NOTICE_DIR)
    kubernetes.empty_dir_mount(task, volume_name="spotguard", mount_path=NOTICE_DIR,
                               size_limit="1Mi")
    # Checkpoints: storage that outlives the node.
    kubernetes.mount_pvc(task, pvc_name=pvc, mount_path=CKPT_DIR)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="pipeline.yaml")
    args = p.parse_args()
    compiler.Compiler().compile(pipeline, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
