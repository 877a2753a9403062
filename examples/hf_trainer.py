#!/usr/bin/env python3
"""Hugging Face Trainer with spotguard's callback: save through the Trainer, exit 143, resume.

    pip install ./clients/python transformers accelerate torch   # the helper, from a spotguard checkout
    spotguard drill -- python3 examples/hf_trainer.py --output-dir /tmp/hf-run

`SpotguardCallback` (spotguard.hf) asks the Trainer to save at the step where every rank agreed
(`control.should_save`), so the checkpoint is a normal `checkpoint-<step>` directory and
`trainer.train(resume_from_checkpoint=...)` resumes it (model, optimizer, scheduler, RNG, the
position in the epoch). A tiny model built here: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Dict

try:
    import spotguard  # pip install ./clients/python (from a spotguard checkout; PyPI after a release)
except ImportError:  # running from a checkout: the package lives in clients/python
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python"))
    import spotguard

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

from spotguard.hf import SpotguardCallback


class Regression(Dataset):
    def __init__(self, n: int = 20_000) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) * 0.1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", type=Path,
                   default=Path(os.environ.get("CHECKPOINT_DIR") or "hf-run"),
                   help="storage that outlives the node")
    p.add_argument("--epochs", type=int, default=5)
    a = p.parse_args()
    args = TrainingArguments(output_dir=str(a.output_dir), num_train_epochs=a.epochs,
                             per_device_train_batch_size=8, learning_rate=1e-2,
                             save_strategy="no",  # only spotguard's save (add your own cadence)
                             report_to=[], logging_strategy="no", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=Tiny(), args=args, train_dataset=Regression(),
                      callbacks=[SpotguardCallback()])
    resume = SpotguardCallback.resume_from(a.output_dir)
    print(f"training (pid {os.getpid()}); resume from {resume}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    print("training finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
