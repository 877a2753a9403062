"""The stand-in torchrun's worker: the elastic DDP recipe without torch.

Every step it runs a file-based all-reduce (MAX) of ``spotguard.should_checkpoint()`` (the local
flag without torch) over the ranks of its rendezvous round (STANDIN_ROUND_DIR), so that all ranks
checkpoint at the same step, like the collective does under torch.distributed. A rank that does
not show up within --peer-timeout means a lost peer: exit 1, as a gloo collective would fail.
Rank 0 saves ``step-<N>.json`` into --ckpt-dir (shared by the nodes), every rank acks ``done`` and
exits 143. On start it resumes from the newest checkpoint and says so with spotguard.resumed().
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import spotguard


def latest(ckpt: Path) -> int:
    steps = [int(p.stem.split("-")[1]) for p in ckpt.glob("step-*.json")] if ckpt.is_dir() else []
    return max(steps, default=0)


def all_reduce_max(round_dir: Path, step: int, rank: int, world: int, flag: bool,
                   timeout: float) -> bool:
    d = round_dir / f"s{step}"
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".r{rank}"
    tmp.write_text("1" if flag else "0")
    os.replace(tmp, d / f"r{rank}")
    end = time.monotonic() + timeout
    while True:
        got = [p for p in d.iterdir() if p.name.startswith("r")]
        if len(got) >= world:
            return any(p.read_text() == "1" for p in got)
        if time.monotonic() > end:
            print(f"rank {rank}: peers lost at step {step} ({len(got)}/{world})", file=sys.stderr,
                  flush=True)
            sys.exit(1)
        time.sleep(0.005)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--peer-timeout", type=float, default=3.0)
    a = p.parse_args()
    spotguard.install()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    round_dir = Path(os.environ["STANDIN_ROUND_DIR"])
    start = latest(a.ckpt_dir)
    spotguard.resumed(start)
    if rank == 0:
        print(f"world size {world}: resumed from step {start}", flush=True)
    for step in range(start + 1, a.steps + 1):
        time.sleep(a.step_time)
        if not all_reduce_max(round_dir, step, rank, world, spotguard.should_checkpoint(),
                              a.peer_timeout):
            continue
        path = a.ckpt_dir / f"step-{step:08d}.json"
        if rank == 0:
            a.ckpt_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps({"step": step}))
            os.replace(tmp, path)
        all_reduce_max(round_dir, -step, rank, world, True, a.peer_timeout)  # rank 0 saved
        spotguard.ack("done", step=step, checkpoint=str(path))
        print(f"rank {rank}: checkpointed step {step}; exiting 143", flush=True)
        spotguard.exit_after_checkpoint()
    return 0


if __name__ == "__main__":
    sys.exit(main())
