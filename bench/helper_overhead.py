#!/usr/bin/env python3
"""Per-step cost of the training-side helper in a real torch loop on the CPU: today's helper
(with its progress record) against another copy of it (``--baseline DIR``: e.g. the previous
release's ``clients/python``, from ``git archive``) and against no helper at all.

Each variant runs in a fresh interpreter: ``install()``, ``resumed(0)``, then a small MLP's
forward/backward/step with ``should_checkpoint(every=N)`` once per step, for ``--seconds`` of
timed steps after a warm-up. ``every`` only matters under ``torch.distributed``, so each run
sets up a one-rank gloo group (``should_checkpoint`` is then the collective it is in a real job,
every N-th call). Variants are interleaved round by round so that a machine whose load changes
affects them alike; the figures are the median over rounds of each run's median step time
and of its mean (the mean carries the record's refresh every 5 s).

    python3 bench/helper_overhead.py --baseline /tmp/old/clients/python --rounds 7

Needs torch (scripts/test-frameworks.sh installs it in target/frameworks-venv). ``--step python``
runs without torch instead: a fixed pure-Python step of about 10 us and no process group (so
``every`` changes nothing but the argument), which shows the helper's own per-call cost against a
step far shorter than any real one. Prints a table and, with ``--json``, the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLIENT = HERE.parent / "clients" / "python"

CHILD = r"""
import json, os, socket, statistics, sys, time
import torch
import torch.distributed as dist
helper = os.environ.get("BENCH_HELPER")
if helper:
    sys.path.insert(0, helper)
    import spotguard
every = int(os.environ["BENCH_EVERY"])
seconds = float(os.environ["BENCH_SECONDS"])
torch.manual_seed(0)
torch.set_num_threads(1)
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
loss_fn = torch.nn.CrossEntropyLoss()
if helper:
    spotguard.install()
    spotguard.resumed(0)
def step():
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()
for i in range(200):
    step()
    if helper:
        spotguard.should_checkpoint(every=every)
times = []
end = time.monotonic() + seconds
while time.monotonic() < end:
    t0 = time.perf_counter_ns()
    step()
    if helper:
        spotguard.should_checkpoint(every=every)
    times.append(time.perf_counter_ns() - t0)
dist.destroy_process_group()
print(json.dumps({"median_us": statistics.median(times) / 1000, "mean_us": statistics.fmean(times) / 1000, "steps": len(times)}))
"""


CHILD_PYTHON = r"""
import json, os, statistics, sys, time
helper = os.environ.get("BENCH_HELPER")
if helper:
    sys.path.insert(0, helper)
    import spotguard
every = int(os.environ["BENCH_EVERY"])
seconds = float(os.environ["BENCH_SECONDS"])
if helper:
    spotguard.install()
    spotguard.resumed(0)
def step():
    return sum(i * i for i in range(200))
for i in range(2000):
    step()
    if helper:
        spotguard.should_checkpoint(every=every)
times = []
end = time.monotonic() + seconds
while time.monotonic() < end:
    t0 = time.perf_counter_ns()
    step()
    if helper:
        spotguard.should_checkpoint(every=every)
    times.append(time.perf_counter_ns() - t0)
print(json.dumps({"median_us": statistics.median(times) / 1000, "mean_us": statistics.fmean(times) / 1000, "steps": len(times)}))
"""


def run(helper: str | None, every: int, seconds: float, guard: str, child: str = CHILD) -> dict:
    env = dict(os.environ, BENCH_EVERY=str(every), BENCH_SECONDS=str(seconds),
               SPOTGUARD_DIR=guard, OMP_NUM_THREADS="1")
    env.pop("SPOTGUARD_PROGRESS", None)
    if helper:
        env["BENCH_HELPER"] = helper
    else:
        env.pop("BENCH_HELPER", None)
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="another copy of clients/python to compare with")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=12.0,
                    help="timed seconds per run (more than the record's 5 s refresh)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--step", choices=("torch", "python"), default="torch",
                    help="the training step: a small torch MLP (default) or pure Python, no torch")
    args = ap.parse_args()
    variants = [("none", None)]
    if args.baseline:
        variants.append(("baseline", str(Path(args.baseline).resolve())))
    variants.append(("current", str(CLIENT)))
    results: dict = {}
    with tempfile.TemporaryDirectory() as guard:
        for r in range(args.rounds):
            for every in (1, 10):
                for name, helper in variants:
                    got = run(helper, every, args.seconds, guard,
                              CHILD if args.step == "torch" else CHILD_PYTHON)
                    results.setdefault(f"{name} every={every}", []).append(got)
            # Partial results survive an interrupted run.
            print(f"round {r + 1}/{args.rounds}: {json.dumps(results)}", file=sys.stderr, flush=True)
    summary = {
        k: {
            "median_us": statistics.median(x["median_us"] for x in v),
            "mean_us": statistics.median(x["mean_us"] for x in v),
            "runs_us": [x["median_us"] for x in v],
        }
        for k, v in results.items()
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{'variant':<22} {'median step (us)':>17} {'mean step (us)':>15}   runs' medians (us)")
        for k, v in summary.items():
            runs = " ".join(f"{x:.1f}" for x in v["runs_us"])
            print(f"{k:<22} {v['median_us']:>17.1f} {v['mean_us']:>15.1f}   {runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
