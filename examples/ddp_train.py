#!/usr/bin/env python3
"""DistributedDataParallel under torchrun that checkpoints on spotguard's signal.

    torchrun --nproc-per-node 2 examples/ddp_train.py            # gloo on CPU works
    torchrun --nproc-per-node 8 examples/ddp_train.py --backend nccl

Where the helper goes: spotguard.install() runs in every WORKER (rank) process, never in the
torchrun agent. With the default pod annotation `spotguard.io/checkpoint-target: handlers`,
spotguard signals only the processes whose /proc/<pid>/status SigCgt shows they catch SIGUSR1:
the workers. That is what you want:

* The torchrun (elastic) agent does not handle SIGUSR1. Its default action is to terminate, so
  signalling the agent (`pid1` target) would kill it, and with it the workers, before any save.
* The agent does handle SIGTERM (and SIGINT/SIGHUP/SIGQUIT): it shuts the workers down (SIGTERM
  to each, SIGKILL 30 s later) and exits. Keep `spotguard.io/checkpoint-signal` at SIGUSR1 under
  torchrun so that the agent is never a target. A kubelet SIGTERM still works: the workers get
  it from the agent and the helper treats it as "checkpoint now" (within those 30 s).
* DataLoader workers forked from a rank get their old dispositions back (the helper resets them
  after fork), so they are not signalled either and nobody waits for an ack they would never send.

Each rank sees the signal at a slightly different moment; should_checkpoint() is a collective
(all-reduce MAX of the local flag), so every rank takes the same step. Rank 0 saves; all ranks
ack with their own pid (`ack-<pid>.json`) and exit 143.

torchrun itself exits 1 when a worker exits non-zero, so the pod would report 1, which Kubeflow's
`ExitCode` policy and a podFailurePolicy FailJob rule treat as permanent. Start torchrun through
the helper's launcher, which forwards SIGTERM/SIGINT/SIGHUP from the kubelet and turns "failed
after a `done` ack" back into 143:

    python3 -m spotguard launch -- torchrun --nproc-per-node 8 examples/ddp_train.py

torchrun also prints a `ChildFailedError ... exitcode: 143` traceback on every such preemption:
that is expected (its workers exited non-zero on purpose); the launcher's exit code is what counts.

Multi-node: --ckpt-dir must be shared storage (EFS, Filestore, NFS) so every node resumes from it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Optional, Tuple

try:
    import spotguard  # pip install ./clients/python (from a spotguard checkout; PyPI after a release)
except ImportError:  # running from a checkout: the package lives in clients/python
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python"))
    import spotguard

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

DONE, SKIPPED, FAILED = 0, 1, 2
STATES = {DONE: "done", SKIPPED: "skipped", FAILED: "failed"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DDP example that checkpoints on spotguard's signal")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl when CUDA is available, else gloo")
    p.add_argument("--check-every", type=int, default=1,
                   help="run should_checkpoint()'s all-reduce every N steps")
    p.add_argument("--via", choices=spotguard.AGREEMENT_PATHS, default="auto",
                   help="where should_checkpoint()'s all-reduce runs (auto: CPU, no GPU sync)")
    p.add_argument("--ckpt-dir", type=Path, default=None,
                   help="default: $CHECKPOINT_DIR, else ./checkpoints (never SPOTGUARD_DIR, a "
                        "small emptyDir in Kubernetes; shared storage for multi-node)")
    p.add_argument("--min-save-seconds", type=float, default=5.0,
                   help="ack skipped instead of saving when less time than this is left")
    p.add_argument("--log-every", type=int, default=100)
    return p.parse_args()


def latest_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    found = sorted(ckpt_dir.glob("step-*.pt")) if ckpt_dir.is_dir() else []
    return found[-1] if found else None


def save(path: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """Atomic: torch.save to a temp file, fsync, rename. A half-written file is never 'latest'."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint(rank: int, device: torch.device, path: Path, model: nn.Module,
               opt: torch.optim.Optimizer, step: int, min_save: float) -> Tuple[str, str]:
    """Rank 0 decides and saves; the outcome is broadcast so that every rank acks the same."""
    status = torch.tensor([DONE], dtype=torch.int32, device=device)
    detail = ""
    if rank == 0:
        left = spotguard.time_left()
        if left is not None and left < min_save:
            status[0] = SKIPPED
            detail = f"only {left:.1f}s left"
        else:
            try:
                save(path, model, opt, step)
            except (OSError, RuntimeError) as err:
                status[0] = FAILED
                detail = str(err)
    dist.broadcast(status, src=0)
    return STATES[int(status.item())], detail


def main() -> int:
    args = parse_args()
    spotguard.install()  # in this worker; main thread; before the process group and the loop

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if backend == "nccl" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    ckpt_dir = (args.ckpt_dir or Path(os.environ.get("CHECKPOINT_DIR") or "checkpoints")).resolve()
    start = 0
    latest = latest_checkpoint(ckpt_dir)
    if latest is not None:
        state = torch.load(latest, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(state["step"])
        if rank == 0:
            print(f"resumed from step {start} ({latest})", flush=True)
    if rank == 0:
        print(f"{world} ranks, backend {backend}, steps {start + 1}..{args.steps}", flush=True)
    spotguard.resumed(start)  # where training (re)starts; `spotguard drill --elastic` reads it

    data = torch.Generator().manual_seed(1000 * (start + 1) + rank)  # this rank's shard
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(args.batch, 32, generator=data).to(device)
        y = x.sum(dim=1, keepdim=True) * 0.1
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        time.sleep(args.step_time)
        if rank == 0 and args.log_every > 0 and step % args.log_every == 0:
            print(f"step {step}  loss {loss.item():.4f}", flush=True)

        # Collective: every rank calls it at this same point of every step.
        if not spotguard.should_checkpoint(every=args.check_every, via=args.via):
            continue
        path = ckpt_dir / f"step-{step:08d}.pt"
        state, detail = checkpoint(rank, device, path, model, opt, step, args.min_save_seconds)
        spotguard.ack(state, step=step, checkpoint=path if state == "done" else None)
        why = "signalled" if spotguard.requested() else "agreed"
        extra = f" ({detail})" if detail else ""
        print(f"rank {rank} pid {os.getpid()}: {why}, step {step}, acked {state}{extra}", flush=True)
        dist.destroy_process_group()
        spotguard.exit_after_checkpoint()

    dist.destroy_process_group()
    if rank == 0:
        print(f"training finished at step {args.steps}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
