"""A PyTorch Lightning callback that checkpoints when spotguard asks.

Needs ``lightning`` (or the older ``pytorch_lightning``) and torch: importing this module where
neither is installed raises ImportError. ``import spotguard`` itself needs neither.

    from spotguard.lightning import SpotguardCheckpoint, latest_checkpoint

    guard = SpotguardCheckpoint(dirpath="/ckpt/run-1")
    trainer = Trainer(callbacks=[guard], ...)
    trainer.fit(model, ckpt_path=latest_checkpoint("/ckpt/run-1"))   # None on the first attempt

What it does, in every rank:
  setup(fit)          spotguard.install() (SIGUSR1 + SIGTERM), in the main thread
  on_train_batch_end  should_checkpoint() (all ranks agree on one step) -> trainer.save_checkpoint
                      (rank 0 writes) -> ack done with the global step and path -> should_stop
  on leaving fit      exit code 143 (Kubeflow ExitCode policy / Job podFailurePolicy: retryable)

Lightning and signals: Lightning registers its own SIGTERM handler when fit starts and chains the
one installed before it (ours). On SIGTERM it raises SIGTERMException (a SystemExit with code 0)
at the next batch; this callback has saved by then and turns the code into 143, so a preempted
job is never reported as succeeded. Do not enable SLURM auto-requeue on the same SIGUSR1.

Mid-epoch resume: the checkpoint records the batch position, but a plain DataLoader is not
resumable (Lightning warns so): after the restart the epoch's batches are drawn again from the
start of a fresh iterator, so some samples of that epoch are seen twice. A runnable demo is
``examples/lightning_train.py``.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import spotguard

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the pre-2.0 package name
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]

__all__ = ["SpotguardCheckpoint", "latest_checkpoint"]

PREFIX = "spotguard-step"
SUFFIX = ".ckpt"


def latest_checkpoint(dirpath: Union[str, Path]) -> Optional[str]:
    """The newest checkpoint this callback wrote in ``dirpath``, for ``fit(ckpt_path=…)``."""
    d = Path(dirpath)
    found = sorted(d.glob(f"{PREFIX}*{SUFFIX}")) if d.is_dir() else []
    return str(found[-1]) if found else None


class SpotguardCheckpoint(Callback):
    """Save a checkpoint, ack it and stop when spotguard signals (see the module docstring).

    Args:
        dirpath: where checkpoints go (default ``<trainer.default_root_dir>/checkpoints``):
            storage that outlives the node (a PVC on network storage, not the small emptyDir of
            ``SPOTGUARD_DIR``), shared when ranks run on several nodes.
        every: run ``should_checkpoint``'s all-reduce every N batches (amortises its cost; the
            save starts up to N-1 batches after the signal).
        via: where that all-reduce runs (see :func:`spotguard.should_checkpoint`; the default
            ``"auto"`` keeps it on the CPU, no per-batch GPU sync).
        exit_code: the process exit code after a spotguard checkpoint (``None``: leave it to
            your script; check :attr:`checkpointed` after ``fit``).
        signals: what :func:`spotguard.install` catches.
    """

    def __init__(
        self,
        dirpath: Union[str, Path, None] = None,
        every: int = 1,
        via: str = "auto",
        exit_code: Optional[int] = spotguard.EXIT_CODE,
        signals: Iterable[int] = (signal.SIGUSR1, signal.SIGTERM),
    ) -> None:
        super().__init__()
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.every = every
        self.via = via
        self.exit_code = exit_code
        self.signals = tuple(signals)
        #: The checkpoint path once saved (also set on ranks that did not write it).
        self.checkpointed: Optional[Path] = None

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            spotguard.install(self.signals)
            if self.dirpath is None:
                self.dirpath = Path(trainer.default_root_dir) / "checkpoints"

    def on_train_batch_end(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        # Every rank reaches this hook at the same batch: the collective inside is safe here.
        if self.checkpointed is not None or not spotguard.should_checkpoint(
            every=self.every, via=self.via
        ):
            return
        assert self.dirpath is not None
        step = trainer.global_step
        path = self.dirpath / f"{PREFIX}{step:010d}{SUFFIX}"
        try:
            trainer.save_checkpoint(path)  # every rank calls it; rank 0 writes (strategy-aware)
        except Exception:
            spotguard.ack("failed", step=step)
            raise
        spotguard.ack("done", step=step, checkpoint=path)
        self.checkpointed = path
        if trainer.is_global_zero:
            print(f"spotguard: saved {path} at step {step}; stopping", flush=True)
        trainer.should_stop = True

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        # Normal end of fit after should_stop (SIGUSR1): leave with 143 instead of 0.
        if stage == "fit" and self.checkpointed is not None and self.exit_code is not None:
            raise SystemExit(self.exit_code)

    def on_exception(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException
    ) -> None:
        # SIGTERM: Lightning raises SIGTERMException (SystemExit, code 0) after our save, and
        # re-raises this very object: give it our exit code so the job is retried, not "succeeded".
        if (
            self.checkpointed is not None
            and self.exit_code is not None
            and isinstance(exception, SystemExit)
            and not exception.code
        ):
            exception.code = self.exit_code
