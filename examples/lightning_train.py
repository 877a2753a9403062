#!/usr/bin/env python3
"""PyTorch Lightning with spotguard's callback: checkpoint on the signal, exit 143, resume.

    pip install ./clients/python lightning   # the helper, from a spotguard checkout
    spotguard drill -- python3 examples/lightning_train.py --root /tmp/run1

`SpotguardCheckpoint` (spotguard.lightning) saves through `trainer.save_checkpoint` on every rank
(rank 0 writes), acks `done` and stops; leaving `fit` exits 143. The next start resumes from
`latest_checkpoint(...)`. Lightning warns that a plain DataLoader is not resumable mid-epoch: the
interrupted epoch's batches are drawn again from a fresh iterator (some samples seen twice).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

try:
    import spotguard  # pip install ./clients/python (from a spotguard checkout; PyPI after a release)
except ImportError:  # running from a checkout: the package lives in clients/python
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python"))
    import spotguard

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from spotguard.lightning import SpotguardCheckpoint, latest_checkpoint


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=Path(os.environ.get("CHECKPOINT_DIR") or "lightning-run"),
                   help="trainer.default_root_dir: storage that outlives the node")
    p.add_argument("--epochs", type=int, default=20)
    args = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(20_000, 16)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.1), batch_size=8)
    guard = SpotguardCheckpoint()  # checkpoints into <root>/checkpoints
    resume = latest_checkpoint(args.root / "checkpoints")
    if resume:
        print(f"resuming from {resume}", flush=True)
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1,
                         default_root_dir=str(args.root), callbacks=[guard], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    print(f"training (pid {os.getpid()}); send SIGUSR1 or SIGTERM to checkpoint", flush=True)
    trainer.fit(Tiny(), data, ckpt_path=resume)
    print("training finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
