#!/usr/bin/env python3
"""The agent's footprint, two builds side by side: idle RSS and CPU, then the CPU and peak RSS of
one plan (an EC2 spot interruption, one trainer that acks ``done``), host mode.

    cargo build --release                      # the build to measure, and a peer's, e.g.
    git worktree add /tmp/old <commit> && (cd /tmp/old && cargo build --release)
    python3 bench/agent_footprint.py --bin new=target/release/spotguard \\
        --bin old=/tmp/old/target/release/spotguard --rounds 3 --idle 20

Each round runs every build once, in turn (interleaved, so a machine's drift hits all alike),
against its own emulator (``spotguard emulate``) and its own trainer: a Python loop with the
checkout's helper (``clients/python``). Idle: RSS sampled every second for ``--idle`` seconds
after a 3 s start, CPU (clock ticks) over the same window. Plan: the notice is raised through the
emulator's control endpoint; CPU (the threads' schedstat) from the raise to the agent's ``plan
outcome`` log line, and VmHWM after it.
Medians over the rounds; the machine should be otherwise quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")

TRAINER = r"""
import sys, time
import spotguard
spotguard.install()
spotguard.resumed(0)
step = 0
while True:
    step += 1
    time.sleep(0.01)
    if spotguard.should_checkpoint(step=step):
        spotguard.ack("done", step=step, checkpoint=None)
        sys.exit(143)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def cpu_ns(pid: int) -> int:
    """CPU time of the process's live threads (``/proc/PID/task/*/schedstat``, nanoseconds): finer
    than the clock ticks of ``/proc/PID/stat``, but blind to threads that exited, so it times the
    plan (a few seconds; the runtime's blocking threads live 10 s after their last job)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def wait_http(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def one_run(binary: str, idle: float) -> dict:
    port = free_port()
    emu = subprocess.Popen([binary, "emulate", "--cloud", "aws", "--listen", f"127.0.0.1:{port}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        ckpt.mkdir()
        try:
            wait_http(f"{base}/latest/meta-data/")
        except OSError:
            pass  # IMDSv2 refuses a token-less GET; the listener is up either way
        env = dict(os.environ, PYTHONPATH=str(REPO / "clients" / "python"), SPOTGUARD_DIR=str(ckpt))
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, "footprint_bench_trainer"], env=env)
        agent = subprocess.Popen(
            [binary, "run", "--mode=host", "--cloud=aws", f"--metadata-endpoint={base}",
             "--poll-interval=1s", f"--state-dir={tmp}/state", f"--checkpoint-dir={ckpt}",
             "--checkpoint-cmdline=footprint_bench_trainer", "--metrics-addr=127.0.0.1:0",
             "--gpu=off", "--log-format=json", "--log-level=info"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        done = threading.Event()

        def follow() -> None:
            assert agent.stdout is not None
            for line in agent.stdout:
                if "plan outcome" in line:
                    done.set()

        threading.Thread(target=follow, daemon=True).start()
        try:
            time.sleep(3.0)
            rss = []
            c0, t0 = cpu_seconds(agent.pid), time.monotonic()
            while time.monotonic() - t0 < idle:
                rss.append(status_kib(agent.pid, "VmRSS:"))
                time.sleep(1.0)
            idle_cpu = cpu_seconds(agent.pid) - c0
            idle_wall = time.monotonic() - t0
            anon = status_kib(agent.pid, "RssAnon:")
            c1 = cpu_ns(agent.pid)
            req = urllib.request.Request(f"{base}/spotguard/notice", method="POST",
                                         data=json.dumps({"kind": "interruption", "in": "120s"}).encode())
            urllib.request.urlopen(req, timeout=5).read()
            if not done.wait(60):
                raise RuntimeError(f"{binary}: no plan outcome within 60 s")
            plan_cpu = (cpu_ns(agent.pid) - c1) / 1e9
            hwm = status_kib(agent.pid, "VmHWM:")
            trainer.wait(10)
        finally:
            for p in (agent, trainer, emu):
                p.kill()
                p.wait()
    return {
        "idle_rss_mib": statistics.median(rss) / 1024,
        "idle_anon_mib": anon / 1024,
        "idle_cpu_pct": 100 * idle_cpu / idle_wall,
        "plan_cpu_ms": 1000 * plan_cpu,
        "peak_rss_mib": hwm / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", action="append", required=True, help="NAME=PATH, repeatable")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle", type=float, default=20.0, help="idle seconds sampled per run")
    args = ap.parse_args()
    bins = [b.split("=", 1) for b in args.bin]
    runs: dict = {name: [] for name, _ in bins}
    for r in range(args.rounds):
        for name, path in bins:
            got = one_run(path, args.idle)
            runs[name].append(got)
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
    keys = ["idle_rss_mib", "idle_anon_mib", "idle_cpu_pct", "plan_cpu_ms", "peak_rss_mib"]
    print("\n| build | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, _ in bins:
        med = [statistics.median(x[k] for x in runs[name]) for k in keys]
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in med) + " |")


if __name__ == "__main__":
    main()
