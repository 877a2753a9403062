#!/usr/bin/env python3
"""Hugging Face Accelerate: checkpoint with `accelerator.save_state` when spotguard asks.

    pip install ./clients/python accelerate torch   # the helper, from a spotguard checkout
    spotguard drill -- python3 examples/accelerate_train.py --ckpt-dir /tmp/acc
    spotguard drill -- python3 -m spotguard launch -- accelerate launch --multi_gpu \\
        --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        examples/accelerate_train.py --ckpt-dir /tmp/acc

Two processes on CPU: `--multi_gpu --num_processes 2` (accelerate runs them under torchrun; the
script's Accelerator(cpu=True) makes them gloo CPU processes). `accelerate launch --cpu` runs ONE
process whatever --num_processes says; the drill warns when fewer processes caught the signal
than the launcher was asked for. On GPUs: `--multi_gpu --num_processes <GPUs>`.

Every process calls `should_checkpoint()` at the same point (a collective when distributed),
`save_state` writes model, optimizer, RNG and sampler state (main process writes, all wait), every
process acks `done`, and all exit 143. `load_state` resumes; `skip_first_batches` skips the part
of the interrupted epoch already trained on.
"""

from __future__ import annotations

import argparse
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

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def latest(ckpt_dir: Path) -> Optional[Tuple[Path, int, int, int]]:
    """(dir, step, epoch, batch) of the newest complete save (its `meta` file is written last)."""
    best = None
    for meta in ckpt_dir.glob("step-*/meta") if ckpt_dir.is_dir() else []:
        step, epoch, batch = (int(v) for v in meta.read_text().split())
        if best is None or step > best[1]:
            best = (meta.parent, step, epoch, batch)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", type=Path,
                   default=Path(os.environ.get("CHECKPOINT_DIR") or "accelerate-run"))
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.01)
    args = p.parse_args()
    spotguard.install()
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    x = torch.randn(8192, 16)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.1), batch_size=16,
                        shuffle=True)
    model = nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, loader = acc.prepare(model, opt, loader)
    step, epoch, skip = 0, 0, 0
    found = latest(args.ckpt_dir.resolve())
    if found is not None:
        acc.load_state(str(found[0]))
        _, step, epoch, skip = found
        acc.print(f"resumed from step {step} (epoch {epoch}, batch {skip}) {found[0]}")
    acc.print(f"training (pid {os.getpid()}, {acc.num_processes} process(es))")
    spotguard.resumed(step)  # training starts here (SIGTERM now means "checkpoint")
    while epoch < args.epochs:
        batches = acc.skip_first_batches(loader, skip) if skip else loader
        for i, (xb, yb) in enumerate(batches, start=skip):
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            acc.backward(loss)
            opt.step()
            step += 1
            time.sleep(args.step_time)
            if spotguard.should_checkpoint():
                out = args.ckpt_dir.resolve() / f"step-{step:08d}"
                acc.save_state(str(out))
                acc.wait_for_everyone()
                if acc.is_main_process:
                    (out / "meta").write_text(f"{step} {epoch} {i + 1}")  # marks it complete
                acc.wait_for_everyone()
                spotguard.ack("done", step=step, checkpoint=out)
                acc.print(f"saved {out} at step {step}; exiting 143")
                acc.end_training()
                spotguard.exit_after_checkpoint()
        epoch, skip = epoch + 1, 0
    acc.print(f"training finished at step {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
