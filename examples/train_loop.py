#!/usr/bin/env python3
"""A plain training loop that checkpoints when spotguard asks, then exits 143 to be retried.

Standard library only: a "step" is a short sleep, a "checkpoint" is a small JSON file. Swap in
your model, optimizer and torch.save; the control flow stays the same.

    spotguard drill -- python3 examples/train_loop.py     # rehearse a preemption
    SPOTGUARD_DIR=$(mktemp -d) python3 examples/train_loop.py & sleep 2; kill -USR1 $!; wait

What happens:
  start   resume from the newest checkpoint in --ckpt-dir (default $CHECKPOINT_DIR, else
          ./checkpoints: storage that outlives the node, never SPOTGUARD_DIR's small emptyDir);
          tell the helper the step, the checkpoint and how long loading it took (the agent
          reports the recovery from the interruption that saved it)
  signal  SIGUSR1 (spotguard) or SIGTERM (kubelet): the helper sets a flag and acks "received"
  step    the current step finishes; the loop sees the flag at the step boundary
  save    write the checkpoint atomically, ack "done" with the step and path (or "skipped" when
          the save cannot fit before the notice's checkpoint deadline)
  exit    143, so Kubeflow's ExitCode restart policy / a Job podFailurePolicy retries elsewhere

With --timeline it also prints each of these moments on its own clock ("timeline saved
at=1764316800.123456 step=57"), to check what `spotguard goodput` reports against.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional, Tuple

try:
    import spotguard  # pip install ./clients/python (from a spotguard checkout; PyPI after a release)
except ImportError:  # running from a checkout: the package lives in clients/python
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python"))
    import spotguard

CKPT_PREFIX = "step-"
CKPT_SUFFIX = ".ckpt.json"


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600, help="total steps to train (default 600)")
    p.add_argument("--step-time", type=float, default=0.1, help="seconds per simulated step")
    p.add_argument("--save-time", type=float, default=0.3, help="seconds a simulated save takes")
    p.add_argument("--load-time", type=float, default=0.2, help="seconds a simulated restore takes")
    p.add_argument(
        "--ckpt-dir",
        type=Path,
        default=None,
        help="where checkpoints go (default: $CHECKPOINT_DIR, else ./checkpoints). Not "
        "SPOTGUARD_DIR: in Kubernetes that is a small emptyDir that dies with the pod; use a PVC "
        "on network storage or an object-store mount",
    )
    p.add_argument("--log-every", type=int, default=50, help="print progress every N steps")
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also print the run's timeline on the trainer's own clock, one line per event: "
        "'timeline EVENT at=UNIX_SECONDS key=value ...' (restored, first_step, signal, saved, "
        "exit, finished): the ground truth to check `spotguard goodput` against",
    )
    return p.parse_args(argv)


_timeline = False


def mark(event: str, at: Optional[float] = None, **fields: object) -> None:
    """One timeline line (with --timeline): the event, its wall-clock time, its fields."""
    if _timeline:
        extra = "".join(f" {k}={v}" for k, v in fields.items())
        print(f"timeline {event} at={time.time() if at is None else at:.6f}{extra}")


def latest_checkpoint(ckpt_dir: Path, load_time: float = 0.0) -> Optional[Tuple[int, Path, dict]]:
    """The newest readable checkpoint as (step, path, state), or None."""
    best: Optional[Tuple[int, Path, dict]] = None
    if not ckpt_dir.is_dir():
        return None
    for path in ckpt_dir.glob(f"{CKPT_PREFIX}*{CKPT_SUFFIX}"):
        try:
            state = json.loads(path.read_text())
            step = int(state["step"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"ignoring unreadable checkpoint {path.name}: {err}", file=sys.stderr)
            continue
        if best is None or step > best[0]:
            best = (step, path, state)
    if best is not None:
        time.sleep(load_time)  # stands in for torch.load of a real model
    return best


def save_checkpoint(ckpt_dir: Path, state: dict, save_time: float) -> Path:
    """Write the checkpoint atomically (temp + fsync + rename): a crash mid-save leaves the
    previous checkpoint as the newest one, never a torn file."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"{CKPT_PREFIX}{state['step']:08d}{CKPT_SUFFIX}"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    time.sleep(save_time)  # stands in for torch.save of a real model
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def loss_at(step: int) -> float:
    return 2.5 / (1.0 + 0.02 * step)


def main(argv: Optional[list] = None) -> int:
    global _timeline
    args = parse_args(argv)
    _timeline = args.timeline
    guard_dir = spotguard.install()  # SIGUSR1 + SIGTERM; main thread, before the loop
    ckpt_dir = (args.ckpt_dir or Path(os.environ.get("CHECKPOINT_DIR") or "checkpoints")).resolve()

    start, loaded = 0, None
    began = time.monotonic()
    found = latest_checkpoint(ckpt_dir, args.load_time)
    restore_seconds = time.monotonic() - began
    if found is not None:
        start, loaded = found[0], found[1]
        print(f"resumed from step {start} ({loaded})")
        mark("restored", step=start, seconds=f"{restore_seconds:.6f}")
    if start >= args.steps:
        print(f"already trained {start} steps; nothing to do")
        return 0
    print(f"training steps {start + 1}..{args.steps} (pid {os.getpid()}, SPOTGUARD_DIR={guard_dir})")
    # Training starts here: from now on SIGTERM means "checkpoint" (before, it ends the process at
    # once: nothing to save yet). The resume record tells `spotguard drill --elastic` the step,
    # and, naming the checkpoint and how long loading it took, lets the agent of this node report
    # the recovery from the interruption that saved it (`spotguard goodput`).
    if loaded is None:
        spotguard.resumed(start)
    else:
        spotguard.resumed(start, checkpoint=loaded, restore_seconds=restore_seconds)

    for step in range(start + 1, args.steps + 1):
        time.sleep(args.step_time)  # forward, backward, optimizer.step()
        if step == start + 1:
            mark("first_step", step=step)
        if args.log_every > 0 and step % args.log_every == 0:
            print(f"step {step}  loss {loss_at(step):.3f}")

        if not spotguard.should_checkpoint():
            continue

        signum = spotguard.received_signal()
        name = signal.Signals(signum).name if signum is not None else "signal"
        left = spotguard.time_left()
        budget = f"{left:.0f}s left" if left is not None else "no notice.json"
        print(f"{name} received; checkpointing after step {step} ({budget})")
        mark("signal", at=spotguard.received_at(), step=step)
        if left is not None and left < args.save_time:
            spotguard.ack("skipped", step=step)
            print("no time to save before the deadline: acked skipped; exiting 143")
            spotguard.exit_after_checkpoint()
        try:
            path = save_checkpoint(ckpt_dir, {"step": step, "loss": loss_at(step)}, args.save_time)
        except OSError as err:
            spotguard.ack("failed", step=step)
            print(f"checkpoint failed: {err}; acked failed; exiting 143", file=sys.stderr)
            spotguard.exit_after_checkpoint()
        spotguard.ack("done", step=step, checkpoint=path)
        mark("saved", step=step)
        print(f"saved {path}; acked done; exiting 143 so the job is retried")
        mark("exit", code=143)
        spotguard.exit_after_checkpoint()

    mark("finished", step=args.steps)
    print(f"training finished at step {args.steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
