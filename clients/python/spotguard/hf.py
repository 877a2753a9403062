"""A Hugging Face ``transformers`` ``TrainerCallback`` that checkpoints when spotguard asks.

Needs ``transformers`` (and torch): importing this module where it is absent raises ImportError.
``import spotguard`` itself needs neither.

    from spotguard.hf import SpotguardCallback

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[SpotguardCallback()])
    trainer.train(resume_from_checkpoint=SpotguardCallback.resume_from(args.output_dir))

The save goes through the Trainer itself (``control.should_save``), so the checkpoint is an
ordinary ``<output_dir>/checkpoint-<global_step>`` directory with the model, optimizer, scheduler,
RNG and ``trainer_state.json``, and ``trainer.train(resume_from_checkpoint=…)`` resumes it.
Put ``output_dir`` on storage that outlives the node (a PVC on network storage, an object-store
mount), not in ``SPOTGUARD_DIR``.

What it does, in every rank:
  on_train_begin  spotguard.install() (SIGUSR1 + SIGTERM); main thread
  on_step_end     should_checkpoint() (all ranks agree on one step) -> control.should_save and
                  control.should_training_stop
  on_save         ack ``done`` with the global step and the checkpoint directory
  on_train_end    exit 143 (SystemExit) so the job is retried rather than "succeeded"

Mid-epoch resume: the Trainer skips the batches of the interrupted epoch it already trained on
(``ignore_data_skip=False``, the default), so with a seeded sampler no sample is seen twice; the
skipping itself replays the data loader up to that point, which takes time on large datasets.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import spotguard

__all__ = ["SpotguardCallback"]

#: The Trainer's checkpoint directory prefix (transformers.trainer_utils.PREFIX_CHECKPOINT_DIR).
PREFIX = "checkpoint"


class SpotguardCallback(TrainerCallback):  # type: ignore[misc]
    """Save through the Trainer, ack and stop when spotguard signals (see the module docstring).

    Args:
        every: run ``should_checkpoint``'s all-reduce every N steps (the save starts up to N-1
            steps after the signal).
        via: where that all-reduce runs (:func:`spotguard.should_checkpoint`; ``"auto"`` keeps
            it on the CPU: no per-step GPU sync).
        exit_code: the exit code after a spotguard checkpoint (``None``: ``train()`` returns and
            your script decides; check :attr:`checkpointed`).
        signals: what :func:`spotguard.install` catches.
    """

    def __init__(
        self,
        every: int = 1,
        via: str = "auto",
        exit_code: Optional[int] = spotguard.EXIT_CODE,
        signals: Iterable[int] = (signal.SIGUSR1, signal.SIGTERM),
    ) -> None:
        self.every = every
        self.via = via
        self.exit_code = exit_code
        self.signals = tuple(signals)
        self._pending = False
        #: The checkpoint directory once saved (``<output_dir>/checkpoint-<step>``).
        self.checkpointed: Optional[Path] = None

    @staticmethod
    def resume_from(output_dir: Union[str, "os.PathLike[str]"]) -> Optional[str]:
        """The newest ``checkpoint-<step>`` directory in ``output_dir`` holding a
        ``trainer_state.json`` (a complete save), for ``train(resume_from_checkpoint=…)``; None on
        the first attempt."""
        d = Path(output_dir)
        best = None
        if d.is_dir():
            for p in d.glob(f"{PREFIX}-*"):
                tail = p.name[len(PREFIX) + 1 :]
                if tail.isdigit() and (p / "trainer_state.json").is_file():
                    if best is None or int(tail) > best[0]:
                        best = (int(tail), p)
        return str(best[1]) if best else None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        spotguard.install(self.signals)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        # Every rank reaches this hook after the same optimizer step: the collective is safe.
        if not self._pending and self.checkpointed is None:
            if spotguard.should_checkpoint(every=self.every, via=self.via):
                self._pending = True
                control.should_save = True
                control.should_training_stop = True
        return control

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if not self._pending:
            return
        self._pending = False
        path = Path(args.output_dir) / f"{PREFIX}-{state.global_step}"
        if not (path / "trainer_state.json").is_file() and state.is_world_process_zero:
            spotguard.ack("failed", step=state.global_step)
            return
        spotguard.ack("done", step=state.global_step, checkpoint=path)
        self.checkpointed = path
        if state.is_world_process_zero:
            print(f"spotguard: saved {path} at step {state.global_step}; stopping", flush=True)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.checkpointed is not None and self.exit_code is not None:
            spotguard.exit_after_checkpoint(self.exit_code, hard=False)
