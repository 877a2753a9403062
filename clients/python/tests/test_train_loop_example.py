"""examples/train_loop.py driven the way `spotguard drill` drives it: notice.json, then a real
SIGUSR1 once the process catches it, then the ack and the exit code; and resuming afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Tuple

from conftest import REPO_ROOT, WAIT_S, read_json, sig_caught, wait_for

EXAMPLE = REPO_ROOT / "examples" / "train_loop.py"


def start(guard_dir: Path, *args: str) -> subprocess.Popen:
    # Checkpoints go to CHECKPOINT_DIR (storage that outlives the node), never into SPOTGUARD_DIR.
    env = {"SPOTGUARD_DIR": str(guard_dir), "CHECKPOINT_DIR": str(guard_dir.parent / "ckpt"),
           "PATH": "/usr/bin:/bin"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.Popen(
        [sys.executable, "-u", str(EXAMPLE), "--step-time", "0.02", "--save-time", "0.05", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> tuple:
    try:
        out, err = proc.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"example did not exit\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err


def signal_when_caught(proc: subprocess.Popen, signum: int,
                       notice: Optional[Tuple[Path, float]] = None) -> None:
    """Like the agent: wait until the process catches the signal, write notice.json (if given:
    dir and seconds until the checkpoint deadline), then signal."""
    wait_for("the example to install its handler",
             lambda: proc.poll() is None and sig_caught(proc.pid, signal.SIGUSR1))
    if notice is not None:
        write_notice(*notice)
    proc.send_signal(signum)


def write_notice(guard_dir: Path, checkpoint_in: float) -> None:
    now = time.time()
    guard_dir.mkdir(parents=True, exist_ok=True)
    (guard_dir / "notice.json").write_text(json.dumps({
        "notice_id": "drill-1", "source": "aws", "kind": "interruption",
        "deadline_unix": now + checkpoint_in + 25, "checkpoint_deadline_unix": now + checkpoint_in,
        "signal": "SIGUSR1",
    }))


def test_checkpoints_on_sigusr1_acks_done_and_resumes(tmp_path: Path) -> None:
    guard = tmp_path / "guard"
    proc = start(guard, "--steps", "100000")
    signal_when_caught(proc, signal.SIGUSR1, notice=(guard, 90))
    rc, out, err = finish(proc)
    assert rc == 143, (out, err)
    ack = read_json(guard / f"ack-{proc.pid}.json")
    assert ack is not None and ack["state"] == "done"
    ckpt = Path(ack["checkpoint"])
    assert ckpt.parent == guard.parent / "ckpt"
    assert not (guard / "checkpoints").exists()
    assert json.loads(ckpt.read_text())["step"] == ack["step"]
    assert "SIGUSR1 received; checkpointing after step" in out
    assert "s left)" in out

    # The next attempt resumes where the last one saved and runs to the end.
    steps = ack["step"] + 5
    again = start(guard, "--steps", str(steps), "--log-every", "0")
    rc, out, err = finish(again)
    assert rc == 0, (out, err)
    assert out.splitlines()[0].startswith(f"resumed from step {ack['step']} ")
    assert out.splitlines()[-1] == f"training finished at step {steps}"


def test_sigterm_without_notice_checkpoints_too(tmp_path: Path) -> None:
    guard = tmp_path / "guard"
    # A notice left over from an earlier run (e.g. an emptyDir that survived a container
    # restart) must not be taken for this SIGTERM's budget.
    write_notice(guard, checkpoint_in=-5)
    stale = time.time() - 600
    os.utime(guard / "notice.json", (stale, stale))
    proc = start(guard, "--steps", "100000", "--ckpt-dir", str(tmp_path / "ck"))
    # During training (SIGTERM before it starts ends the process at once: nothing to save yet).
    wait_for("training to start", lambda: (guard / f"resume-{proc.pid}.json").exists())
    signal_when_caught(proc, signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 143, (out, err)
    ack = read_json(guard / f"ack-{proc.pid}.json")
    assert ack is not None and ack["state"] == "done"
    assert Path(ack["checkpoint"]).parent == tmp_path / "ck"
    assert "SIGTERM received" in out and "no notice.json" in out


def test_skips_when_the_save_cannot_fit(tmp_path: Path) -> None:
    guard = tmp_path / "guard"
    proc = start(guard, "--steps", "100000")
    # The checkpoint deadline has already passed.
    signal_when_caught(proc, signal.SIGUSR1, notice=(guard, -5))
    rc, out, err = finish(proc)
    assert rc == 143, (out, err)
    ack = read_json(guard / f"ack-{proc.pid}.json")
    assert ack is not None and ack["state"] == "skipped" and ack["checkpoint"] is None
    assert not (guard / "checkpoints").exists()


def timeline(out: str) -> dict:
    """``--timeline`` lines (``timeline EVENT at=UNIX key=value ...``) by event."""
    events = {}
    for line in out.splitlines():
        words = line.split()
        if words[:1] == ["timeline"]:
            events[words[1]] = dict(w.split("=", 1) for w in words[2:])
    return events


def test_timeline_is_the_runs_own_clock_and_the_resume_names_its_checkpoint(tmp_path: Path) -> None:
    guard = tmp_path / "guard"
    before = time.time()
    proc = start(guard, "--steps", "100000", "--timeline")
    signal_when_caught(proc, signal.SIGUSR1, notice=(guard, 90))
    rc, out, err = finish(proc)
    assert rc == 143, (out, err)
    ack = read_json(guard / f"ack-{proc.pid}.json")
    assert ack is not None and ack["state"] == "done"
    t = timeline(out)
    assert set(t) == {"first_step", "signal", "saved", "exit"}, out
    assert t["first_step"]["step"] == "1" and t["signal"]["step"] == t["saved"]["step"] == str(ack["step"])
    at = {k: float(v["at"]) for k, v in t.items()}
    # The signal's arrival (the helper's; it may come during the first step), then the ack
    # written, then the exit: in order, and the save took at least --save-time (0.05 s).
    assert before <= at["signal"] <= float(ack["ts"]) <= at["saved"] <= at["exit"], t
    assert before <= at["first_step"] <= at["saved"], t
    assert at["saved"] - at["signal"] >= 0.05, t

    # The next run loads that checkpoint (for at least --load-time), times it, and tells the
    # helper: the resume record carries the restore time.
    again = start(guard, "--steps", str(ack["step"] + 3), "--load-time", "0.2", "--timeline")
    rc, out, err = finish(again)
    assert rc == 0, (out, err)
    t = timeline(out)
    assert set(t) == {"restored", "first_step", "finished"}, out
    assert t["restored"]["step"] == str(ack["step"])
    assert t["first_step"]["step"] == str(ack["step"] + 1)
    restore = float(t["restored"]["seconds"])
    assert restore >= 0.2, t
    record = read_json(guard / f"resume-{again.pid}.json")
    assert record is not None and record["step"] == ack["step"], record
    assert abs(record["restore_seconds"] - restore) < 1e-5, (record, t)
    # ... and names the interruption that saved it (the helper's sidecar next to the checkpoint).
    assert record["interruption"]["notice_id"] == "drill-1", record
    assert record["interruption"]["step"] == ack["step"], record
    # Without --timeline the output is unchanged.
    assert timeline(start_and_finish(guard, "--steps", str(ack["step"] + 4))) == {}


def start_and_finish(guard: Path, *args: str) -> str:
    rc, out, err = finish(start(guard, *args))
    assert rc == 0, (out, err)
    return out
