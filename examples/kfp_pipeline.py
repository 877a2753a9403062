#!/usr/bin/env python3
"""Kubeflow Pipelines (KFP v2): a training step on preemptible nodes, retried after a preemption
and resuming from its checkpoint.

    pip install 'kfp>=2.17,<3' 'kfp-kubernetes>=1.2,<3'   # 2.17: kfp.local honours set_retry
    python3 examples/kfp_pipeline.py --out pipeline.yaml     # compile; upload it to KFP
    # Rehearse the step's own code with KFP's local runner (kfp.local.SubprocessRunner, which
    # honours set_retry from kfp 2.17 on), under the drill:
    spotguard drill --exit-timeout 120s -- python3 examples/kfp_pipeline.py --local \
        --ckpt-root /tmp/kfp-ckpt --steps 3000

What makes the step survive a preemption:

* It runs on the spot / preemptible pool (node selector + toleration), where spotguard runs as a
  DaemonSet. The pod's annotations opt it in (`spotguard.io/checkpoint`) and name its notice dir
  (`spotguard.io/checkpoint-dir`), an emptyDir mounted there, `SPOTGUARD_DIR` set to it.
* Checkpoints go to a PersistentVolumeClaim (ReadWriteMany network storage) that outlives the pod.
* The step (`train`, a Python component: its function is the training code) is a spotguard
  recipe (docs/training-integration.md): on the notice it saves, acks and exits 143; on start it
  resumes from the newest checkpoint in the PVC.
* `set_retry`: KFP runs the step again when it fails. A preempted step fails (exit 143 after its
  checkpoint, or its pod evicted by spotguard's drain); the retry lands on another node (the
  preempted one is cordoned) and resumes from the checkpoint. A step that finished exits 0 and
  is not retried. Give it more retries than the preemptions you expect: KFP cannot tell a
  preemption from a failure, so each one uses a retry.

`--local` runs the same pipeline with KFP's local runner: the step as a local process of this
Python (kfp.local.SubprocessRunner), the notice dir the one in `$SPOTGUARD_DIR` (the drill's),
checkpoints under `--ckpt-root`. The Kubernetes settings (node selector, annotations, volumes)
have no local effect. Exit 0 when the pipeline succeeded (after its retries), 1 when it failed.
"""

import argparse
import os
import sys
from pathlib import Path

from kfp import compiler, dsl, kubernetes

NOTICE_DIR = "/var/run/spotguard"
CKPT_ROOT = "/ckpt"
# Your image, with python3, torch and `pip install spotguard` (packages_to_install would install
# torch again in every attempt).
IMAGE = "registry.example.com/team/python-train:latest"


@dsl.component(base_image=IMAGE)
def train(ckpt_root: str, run_name: str, steps: int, step_time: float) -> int:
    """One training run: resumes from the newest checkpoint under <ckpt_root>/<run_name>, trains
    to `steps`, returns the last step. On spotguard's notice: saves, acks `done`, exits 143."""
    import os
    import time
    from pathlib import Path

    import spotguard
    import torch
    from torch import nn

    spotguard.install()  # SIGUSR1 (the agent) and SIGTERM (the drain's eviction)
    ckpt = Path(ckpt_root) / run_name
    ckpt.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    t0 = time.monotonic()
    found = sorted(ckpt.glob("step-*.pt"))
    if found:
        state = torch.load(found[-1], weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        print(f"resumed from step {step} ({found[-1]})", flush=True)
    # The checkpoint and its load time: the agent reports the recovery from its interruption.
    spotguard.resumed(step, checkpoint=found[-1] if found else None,
                      restore_seconds=time.monotonic() - t0)
    while step < steps:
        batch = torch.Generator().manual_seed(step)  # step N's batch, whichever attempt runs it
        x = torch.randn(64, 16, generator=batch)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) * 0.1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        time.sleep(step_time)
        if spotguard.should_checkpoint():
            path = ckpt / f"step-{step:08d}.pt"
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            with open(tmp, "wb") as f:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # never a torn "latest" checkpoint
            spotguard.ack("done", step=step, checkpoint=path)
            print(f"saved {path} at step {step}; exiting 143", flush=True)
            spotguard.exit_after_checkpoint()  # 143: the step fails, KFP retries it
    print(f"trained to step {step}", flush=True)
    return step


def build(notice_dir: str = NOTICE_DIR, backoff: str = "30s", retries: int = 10):
    """The pipeline. `--local` passes the drill's notice dir and a short backoff."""

    @dsl.pipeline(name="train-on-spot")
    def pipeline(run_name: str = "run-1", steps: int = 100_000, step_time: float = 0.0,
                 ckpt_root: str = CKPT_ROOT, pvc: str = "train-checkpoints"):
        task = train(ckpt_root=ckpt_root, run_name=run_name, steps=steps, step_time=step_time)
        # Retried after a preemption (exit 143 after the checkpoint, or an evicted pod).
        task.set_retry(num_retries=retries, backoff_duration=backoff, backoff_factor=1.0)
        task.set_caching_options(False)  # a retry must run, not reuse a cached result
        task.set_env_variable("SPOTGUARD_DIR", notice_dir)
        # Preemptible nodes (GKE's label; EKS: eks.amazonaws.com/capacityType=SPOT).
        kubernetes.add_node_selector(task, "cloud.google.com/gke-spot", "true")
        kubernetes.add_toleration(task, key="cloud.google.com/gke-spot", operator="Equal",
                                  value="true", effect="NoSchedule")
        # spotguard: opt in, and the notice dir (an emptyDir; checkpoints never go there).
        kubernetes.add_pod_annotation(task, "spotguard.io/checkpoint", "true")
        kubernetes.add_pod_annotation(task, "spotguard.io/checkpoint-dir", notice_dir)
        kubernetes.empty_dir_mount(task, volume_name="spotguard", mount_path=notice_dir,
                                   size_limit="1Mi")
        # Checkpoints: storage that outlives the node.
        kubernetes.mount_pvc(task, pvc_name=pvc, mount_path=CKPT_ROOT)

    return pipeline


def run_local(args: argparse.Namespace) -> int:
    """The pipeline through KFP's local runner, the step a subprocess of this Python."""
    from kfp import local

    notice_dir = os.environ.get("SPOTGUARD_DIR")
    if not notice_dir:
        print("--local needs SPOTGUARD_DIR (spotguard drill sets it)", file=sys.stderr)
        return 2
    root = args.ckpt_root.resolve()
    local.init(runner=local.SubprocessRunner(use_venv=False),
               pipeline_root=str(root / "kfp-root"), raise_on_error=True)
    pipeline = build(notice_dir=notice_dir, backoff=args.backoff, retries=args.retries)
    try:
        pipeline(run_name=args.run_name, steps=args.steps, step_time=args.step_time,
                 ckpt_root=str(root))
    except RuntimeError as err:
        print(f"the pipeline failed: {err}", file=sys.stderr)
        return 1
    print("the pipeline succeeded", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="pipeline.yaml")
    p.add_argument("--local", action="store_true",
                   help="run the pipeline with KFP's local runner instead of compiling it")
    p.add_argument("--ckpt-root", type=Path, default=Path("checkpoints"), help="--local: checkpoints")
    p.add_argument("--run-name", default="run-1", help="--local")
    p.add_argument("--steps", type=int, default=3000, help="--local")
    p.add_argument("--step-time", type=float, default=0.01, help="--local: extra seconds per step")
    p.add_argument("--retries", type=int, default=10, help="--local: set_retry's num_retries")
    p.add_argument("--backoff", default="1s", help="--local: set_retry's backoff_duration")
    args = p.parse_args()
    if args.local:
        return run_local(args)
    compiler.Compiler().compile(build(), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
