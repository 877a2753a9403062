"""The progress record (``<dir>/progress-<pid>.json``): what the agent reads after a notice to
count the work a process threw away. Real child processes, real signals, real files."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

import spotguard
from conftest import read_json, wait_for


def test_should_checkpoint_refreshes_the_record_at_most_every_interval(guard_dir: Path, spawn) -> None:
    child = spawn("""
import json, time
import spotguard
spotguard.PROGRESS_EVERY = 0.2
spotguard.install()
spotguard.resumed(100)
p = spotguard.progress_path()
first = json.loads(p.read_text())
seen = []
start = time.monotonic()
step = 100
while time.monotonic() - start < 1.0:
    step += 1
    spotguard.should_checkpoint()
    seen.append(json.loads(p.read_text())["step"])
    time.sleep(0.005)
print(json.dumps({"first": first, "steps": step, "distinct": sorted(set(seen)), "name": p.name}))
""", guard_dir)
    rc, out, err = child.wait()
    assert rc == 0, err
    got = json.loads(out)
    assert got["name"] == f"progress-{child.pid}.json"
    first = got["first"]
    assert (first["v"], first["step"], first["durable_step"], first["resumed_step"]) == (1, 100, 100, 100)
    assert first["durable_ts"] == first["resumed_ts"]
    # ~1 s of steps at one refresh per 0.2 s: a handful of distinct values, not one per step.
    assert 3 <= len(got["distinct"]) <= 8, got["distinct"]
    assert got["steps"] > 4 * len(got["distinct"])
    assert max(got["distinct"]) <= got["steps"]


def test_a_process_killed_without_acking_leaves_its_steps_since_the_last_save(guard_dir: Path, spawn) -> None:
    child = spawn("""
import json, os, sys, time
import spotguard
spotguard.install()
spotguard.resumed(0)
truth = os.path.join(os.environ["SPOTGUARD_DIR"], "truth.json")
step = 0
while True:
    step += 1
    time.sleep(0.002)
    if step == 50:
        spotguard.saved(50, "/ckpt/step-50")
        saved_at = time.time()
    if spotguard.should_checkpoint(step=step):
        # Too slow to save: it never acks (and gets killed). Its own ground truth first.
        with open(truth + ".tmp", "w") as f:
            json.dump({"step": step, "saved_at": saved_at, "now": time.time()}, f)
        os.rename(truth + ".tmp", truth)
        time.sleep(600)
    if step == 120:
        print("ready", flush=True)
""", guard_dir)
    assert child.proc.stdout.readline().strip() == "ready"
    child.kill(signal.SIGUSR1)
    truth = wait_for("the trainer's ground truth", lambda: read_json(guard_dir / "truth.json"))
    child.kill(signal.SIGKILL)
    child.wait()
    rec = read_json(guard_dir / f"progress-{child.pid}.json")
    assert rec is not None
    assert rec["durable_step"] == 50 and rec["durable_checkpoint"] == "/ckpt/step-50"
    assert rec["step"] == truth["step"], (rec, truth)
    assert abs(rec["durable_ts"] - truth["saved_at"]) < 0.5
    assert rec["durable_ts"] < rec["ts"] <= truth["now"] + 0.01
    assert len((guard_dir / f"progress-{child.pid}.json").read_bytes()) <= spotguard.MAX_PROGRESS_BYTES


def test_ack_done_makes_the_step_durable(guard_dir: Path, spawn) -> None:
    child = spawn("""
import json
import spotguard
spotguard.install()
spotguard.resumed(10)
for s in range(11, 31):
    spotguard.should_checkpoint(step=s)
spotguard.ack("done", step=30, checkpoint="/ckpt/step-30")
print(spotguard.progress_path().read_text())
""", guard_dir)
    rc, out, err = child.wait()
    assert rc == 0, err
    rec = json.loads(out)
    assert (rec["step"], rec["durable_step"], rec["durable_checkpoint"]) == (30, 30, "/ckpt/step-30")
    assert rec["resumed_step"] == 10


def test_an_unwritable_directory_never_reaches_the_training_loop(tmp_path: Path, spawn) -> None:
    # A directory below a plain file: every write fails (ENOTDIR), for root too.
    (tmp_path / "file").write_text("")
    child = spawn("""
import warnings
import spotguard
warnings.simplefilter("ignore")
spotguard.install()
spotguard.PROGRESS_EVERY = 0.0
for s in range(5):
    spotguard.should_checkpoint(step=s)
spotguard.saved(4)
print("trained", flush=True)
""", tmp_path / "file" / "guard")
    rc, out, err = child.wait()
    assert rc == 0 and out.strip() == "trained", err
    assert not (tmp_path / "file" / "guard").exists()


def test_saved_rejects_a_non_integer_step(guard_dir: Path) -> None:
    for bad in (True, "3", 1.5):
        with pytest.raises(ValueError):
            spotguard.saved(bad)  # type: ignore[arg-type]
