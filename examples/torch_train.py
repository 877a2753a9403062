#!/usr/bin/env python3
"""A real single-process PyTorch loop that checkpoints when spotguard asks, and resumes.

    pip install ./clients/python torch   # the helper, from a spotguard checkout
    spotguard drill -- python3 examples/torch_train.py --ckpt-dir /tmp/ckpt     # rehearse
    python3 examples/torch_train.py --ckpt-dir /tmp/ckpt                        # resumes

A tiny regression model on synthetic data, a DataLoader with a seeded sampler, AdamW. On the signal
the step finishes, the model, optimizer, step and sampler position are saved atomically (temp file
+ rename), the ack says `done` and the process exits 143. On start it resumes from the newest
checkpoint, mid-epoch included: the sampler's permutation is a function of (seed, epoch), so the
loop skips the batches of the interrupted epoch it already trained on and sees no sample twice.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional

try:
    import spotguard  # pip install ./clients/python (from a spotguard checkout; PyPI after a release)
except ImportError:  # running from a checkout: the package lives in clients/python
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python"))
    import spotguard

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset


def latest(ckpt_dir: Path) -> Optional[Path]:
    found = sorted(ckpt_dir.glob("step-*.pt")) if ckpt_dir.is_dir() else []
    return found[-1] if found else None


def save(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # never a torn "latest" checkpoint


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", type=Path,
                   default=Path(os.environ.get("CHECKPOINT_DIR") or "checkpoints"),
                   help="storage that outlives the node (default $CHECKPOINT_DIR or ./checkpoints)")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--step-time", type=float, default=0.01, help="extra seconds per step")
    args = p.parse_args()

    spotguard.install()  # main thread, before the loop
    torch.manual_seed(0)
    x = torch.randn(4096, 32)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    epoch, batch_in_epoch, step = 0, 0, 0
    t0 = time.monotonic()
    found = latest(args.ckpt_dir)
    if found is not None:
        state = torch.load(found, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        epoch, batch_in_epoch, step = state["epoch"], state["batch_in_epoch"], state["step"]
        print(f"resumed from step {step} (epoch {epoch}, batch {batch_in_epoch}) {found}", flush=True)
    # Where training restarts, from which checkpoint, and how long its load took: the agent
    # reports the recovery from the interruption that saved it (docs/goodput.md).
    spotguard.resumed(step, checkpoint=found, restore_seconds=time.monotonic() - t0)
    print(f"training (pid {os.getpid()}, SPOTGUARD_DIR={spotguard.checkpoint_dir()})", flush=True)

    while epoch < args.epochs:
        gen = torch.Generator().manual_seed(1000 + epoch)  # the epoch's order, reproducible
        loader = DataLoader(data, batch_size=64, sampler=RandomSampler(data, generator=gen))
        for i, (xb, yb) in enumerate(loader):
            if i < batch_in_epoch:
                continue  # trained on before the preemption
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            time.sleep(args.step_time)
            if spotguard.should_checkpoint():
                left = spotguard.time_left()
                if left is not None and left < 2.0:
                    spotguard.ack("skipped", step=step)
                    spotguard.exit_after_checkpoint()
                path = args.ckpt_dir.resolve() / f"step-{step:08d}.pt"
                save(path, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                            "epoch": epoch, "batch_in_epoch": i + 1})
                spotguard.ack("done", step=step, checkpoint=path)
                print(f"saved {path} at step {step} (loss {loss.item():.4f}); exiting 143", flush=True)
                spotguard.exit_after_checkpoint()
        epoch, batch_in_epoch = epoch + 1, 0
    print(f"training finished at step {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
