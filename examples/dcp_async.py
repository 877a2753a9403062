#!/usr/bin/env python3
"""torch.distributed.checkpoint (DCP) async save for short windows (GCE: ~20 s to save).

    pip install ./clients/python torch   # the helper, from a spotguard checkout
    spotguard drill --cloud gce -- python3 examples/dcp_async.py --ckpt-dir /tmp/dcp
    spotguard drill --cloud gce -- python3 -m spotguard launch -- \\
        torchrun --nproc-per-node 2 examples/dcp_async.py --ckpt-dir /tmp/dcp

`dcp.async_save` stages the state to host memory (the only part that blocks training) and writes
it from a background thread. Two uses here:

* periodic saves every --every steps overlap with training, so a recent checkpoint always exists;
* on the signal: wait for a save still in flight, start the final save, and wait for its future at
  most until the checkpoint deadline (`spotguard.time_left()`): `done` when it completes, else
  `skipped` (the last periodic save stays the newest complete one: DCP writes `.metadata` last, and
  resume picks only directories that have it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from pathlib import Path
from typing import Optional

try:
    import spotguard  # pip install ./clients/python (from a spotguard checkout; PyPI after a release)
except ImportError:  # running from a checkout: the package lives in clients/python
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python"))
    import spotguard

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def complete(ckpt_dir: Path) -> Optional[Path]:
    """The newest save whose `.metadata` exists (DCP writes it last)."""
    found = [p for p in ckpt_dir.glob("step-*") if (p / ".metadata").is_file()] \
        if ckpt_dir.is_dir() else []
    return max(found, key=lambda p: int(p.name[5:])) if found else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", type=Path,
                   default=Path(os.environ.get("CHECKPOINT_DIR") or "dcp-run"))
    p.add_argument("--every", type=int, default=200, help="periodic async save every N steps")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--step-time", type=float, default=0.01)
    args = p.parse_args()
    spotguard.install()
    if "RANK" not in os.environ:  # a single process: a one-rank gloo group for DCP
        store = tempfile.mkstemp(prefix="dcp-pg-")[1]
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt_dir = args.ckpt_dir.resolve()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    found = complete(ckpt_dir)
    if found is not None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=str(found))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(state["step"])
        if rank == 0:
            print(f"resumed from step {step} ({found})", flush=True)

    def save_async(at: int) -> Future:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": torch.tensor(at)}
        return dcp.async_save(state, checkpoint_id=str(ckpt_dir / f"step-{at}"))

    pending: Optional[Future] = None
    g = torch.Generator().manual_seed(step + rank)
    while step < args.steps:
        xb = torch.randn(32, 64, generator=g)
        loss = nn.functional.mse_loss(model(xb), xb.mean(dim=1, keepdim=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        time.sleep(args.step_time)
        if spotguard.should_checkpoint():
            if pending is not None:
                pending.result()  # one save at a time
            left = spotguard.time_left()
            final = save_async(step)
            try:
                final.result(timeout=None if left is None else max(0.0, spotguard.time_left() or 0.0))
            except FutureTimeout:
                spotguard.ack("skipped", step=step)
                print(f"rank {rank}: save of step {step} did not finish in {left:.1f}s; skipped",
                      flush=True)
                spotguard.exit_after_checkpoint()
            path = ckpt_dir / f"step-{step}"
            spotguard.ack("done", step=step, checkpoint=path)
            print(f"rank {rank}: saved {path} (async) at step {step}; exiting 143", flush=True)
            dist.destroy_process_group()
            spotguard.exit_after_checkpoint()
        if step % args.every == 0:
            if pending is not None:
                pending.result()
            pending = save_async(step)
    if pending is not None:
        pending.result()
    dist.destroy_process_group()
    print(f"training finished at step {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
