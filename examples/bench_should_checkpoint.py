#!/usr/bin/env python3
"""What `spotguard.should_checkpoint()` costs per training step, measured against the same loop
without it, in the same run (CPU; 1 process and 2 gloo ranks started with torch.multiprocessing).

    python3 examples/bench_should_checkpoint.py [--steps 2000] [--rounds 5]

Prints one row per configuration: median and p99 of ms/step over all measured steps, and the
median's difference to the baseline of the same world size. The variants run interleaved in
`--rounds` rounds so that machine load drifts affect them alike.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

try:
    import spotguard  # pip install ./clients/python (from a spotguard checkout; PyPI after a release)
except ImportError:  # running from a checkout: the package lives in clients/python
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python"))
    import spotguard

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

VARIANTS: List[Tuple[str, Dict]] = [
    ("without", {}),
    ("every=1", {"every": 1}),
    ("every=10", {"every": 10}),
]


def loop(steps: int, kw: Dict, distributed: bool) -> List[float]:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64)
    times = []
    for i in range(steps + 50):
        t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if kw and spotguard.should_checkpoint(**kw):
            raise RuntimeError("no signal was sent: should_checkpoint must stay False")
        if i >= 50:  # warm-up excluded
            times.append((time.perf_counter() - t0) * 1000.0)
    return times


def rank_main(rank: int, world: int, port: int, steps: int, rounds: int, out: Dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spotguard.install()
    res: Dict[str, List[float]] = {name: [] for name, _ in VARIANTS}
    for _ in range(rounds):
        for name, kw in VARIANTS:
            dist.barrier()
            res[name] += loop(steps, kw, True)
    if rank == 0:
        out.update(res)
    dist.destroy_process_group()


def summary(name: str, times: List[float], base: float) -> str:
    times = sorted(times)
    med = statistics.median(times)
    p99 = times[int(len(times) * 0.99) - 1]
    delta = "" if name == "without" else f"{med - base:+.3f} ms ({(med - base) / base * 100:+.0f}%)"
    return f"| {name:<9} | {med:8.3f} | {p99:8.3f} | {delta} |"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    spotguard.install()
    single: Dict[str, List[float]] = {name: [] for name, _ in VARIANTS}
    for _ in range(a.rounds):
        for name, kw in VARIANTS:
            single[name] += loop(a.steps, kw, False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(rank_main, args=(2, port, a.steps, a.rounds, out), nprocs=2, join=True)
    print(f"torch {torch.__version__}, {a.rounds} rounds x {a.steps} steps per variant, "
          f"1 thread per process, CPU")
    for title, res in (("1 process", single), ("2 ranks, gloo (DDP)", dict(out))):
        base = statistics.median(res["without"])
        print(f"\n{title}\n\n| variant   | median ms/step | p99 ms/step | median vs without |\n|---|---|---|---|")
        for name, _ in VARIANTS:
            print(summary(name, res[name], base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
