"""Recovery across nodes: a checkpoint made durable after a notice carries the interruption (its
sidecar, or the staged manifest), and ``resumed(step, checkpoint=…, restore_seconds=…)`` on the
next node names it in the resume record, with the first step's time. Real child processes, real
signals, real files."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import spotguard
from conftest import read_json

NOTICE = {
    "notice_id": "aws-i-123-1700000000",
    "source": "aws",
    "kind": "interruption",
    "deadline_unix": None,
    "checkpoint_deadline_unix": 4000000000,
    "signal": "SIGUSR1",
    "node": "spot-a",
}

# Saves a directory and a file checkpoint at the step the signal is seen at, acks the directory
# and declares the file saved, then prints what it did.
SAVER = """
import json, os, sys, time
import spotguard
store = sys.argv[1]
spotguard.install()
spotguard.resumed(0)
step = 0
while True:
    step += 1
    if step == 20:
        print("ready", flush=True)
    if spotguard.should_checkpoint(step=step):
        d = os.path.join(store, f"step-{step}")
        os.makedirs(d)
        open(os.path.join(d, "model.pt"), "w").write("weights")
        f = os.path.join(store, f"opt-{step}.pt")
        open(f, "w").write("optimizer")
        before = time.time()
        spotguard.ack("done", step=step, checkpoint=d)
        spotguard.saved(step, f)
        print(json.dumps({"step": step, "dir": d, "file": f, "before": before,
                          "after": time.time(), "signal_ts": spotguard.received_at()}), flush=True)
        break
    time.sleep(0.002)
"""


def _write_notice(guard_dir: Path, body: dict) -> None:
    guard_dir.mkdir(parents=True, exist_ok=True)
    tmp = guard_dir / ".notice.tmp"
    tmp.write_text(json.dumps(body))
    os.replace(tmp, guard_dir / "notice.json")


def _save_after_notice(guard_dir: Path, store: Path, spawn) -> dict:
    store.mkdir(exist_ok=True)
    child = spawn(SAVER, guard_dir, name="saver.py", args=(str(store),))
    assert child.proc.stdout.readline().strip() == "ready"
    _write_notice(guard_dir, NOTICE)
    child.kill(signal.SIGUSR1)
    rc, out, err = child.wait()
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _resume(guard_dir: Path, spawn, step: int, checkpoint, restore=None, name="resumer.py") -> tuple:
    """A new trainer resumes from ``checkpoint`` and trains three steps; returns its resume
    record before the first step and after the third, and the times around the first step."""
    child = spawn("""
import json, sys, time
import spotguard
step, checkpoint, restore = int(sys.argv[1]), sys.argv[2], sys.argv[3]
spotguard.install()
path = spotguard.resumed(step, checkpoint=checkpoint,
                         restore_seconds=None if restore == "-" else float(restore))
before = json.loads(path.read_text())
t0 = time.time()
spotguard.should_checkpoint()
t1 = time.time()
first = json.loads(path.read_text())
for _ in range(2):
    spotguard.should_checkpoint()
print(json.dumps({"before": before, "first": first, "after": json.loads(path.read_text()),
                  "t0": t0, "t1": t1}))
""", guard_dir, name=name, args=(str(step), str(checkpoint), "-" if restore is None else str(restore)))
    rc, out, err = child.wait()
    assert rc == 0, err
    assert "Traceback" not in err, err
    return json.loads(out)


def test_a_checkpoint_saved_after_a_notice_gets_its_sidecar(tmp_path: Path, guard_dir: Path, spawn) -> None:
    got = _save_after_notice(guard_dir, tmp_path / "store", spawn)
    for ckpt in (got["dir"], got["file"]):
        sidecar = Path(ckpt).parent / ".spotguard" / (Path(ckpt).name + ".json")
        assert spotguard.sidecar_path(ckpt) == sidecar
        body = read_json(sidecar)
        assert body is not None, f"no sidecar for {ckpt}"
        assert {k: body[k] for k in ("v", "notice_id", "node", "kind", "source", "step")} == {
            "v": 1, "notice_id": NOTICE["notice_id"], "node": "spot-a", "kind": "interruption",
            "source": "aws", "step": got["step"]}
        assert body["signal_ts"] == got["signal_ts"]
        assert got["before"] <= body["saved_ts"] <= got["after"]
        assert body["signal_ts"] <= body["saved_ts"]
        # Nothing inside the checkpoint, nothing beside it that a trainer's own listing of its
        # checkpoints (`glob("step-*")`, `*.json`, …) could take for one: only the hidden dir.
        parent = Path(ckpt).parent
        assert [p.name for p in parent.iterdir() if "spotguard" in p.name] == [".spotguard"]
    assert not [n for n in os.listdir(got["dir"]) if "spotguard" in n]


def test_no_sidecar_without_a_notice(tmp_path: Path, guard_dir: Path, spawn) -> None:
    store = tmp_path / "store"
    store.mkdir()
    child = spawn("""
import os, sys
import spotguard
d = os.path.join(sys.argv[1], "step-5")
os.makedirs(d)
spotguard.install()
spotguard.resumed(0)
spotguard.saved(5, d)             # a periodic save: no signal came
spotguard.ack("done", step=5, checkpoint=d)
print("ok")
""", guard_dir, args=(str(store),))
    rc, out, err = child.wait()
    assert rc == 0 and out.strip() == "ok", err
    assert not (store / ".spotguard").exists()


def test_resumed_names_the_interruption_and_the_first_step_once(tmp_path: Path, guard_dir: Path, spawn) -> None:
    saved = _save_after_notice(guard_dir / "a", tmp_path / "store", spawn)
    for ckpt in (saved["dir"], saved["file"]):
        got = _resume(guard_dir / "b", spawn, saved["step"], ckpt, restore=1.25,
                      name=f"resumer-{Path(ckpt).name}.py")
        sidecar = read_json(spotguard.sidecar_path(ckpt))
        want = {"notice_id": NOTICE["notice_id"], "node": "spot-a", "kind": "interruption",
                "source": "aws", "step": saved["step"], "saved_ts": sidecar["saved_ts"]}
        assert got["before"]["interruption"] == want
        assert got["before"]["restore_seconds"] == 1.25
        assert "first_step_ts" not in got["before"]
        # Stamped at the first should_checkpoint(), and only then.
        assert got["t0"] <= got["first"]["first_step_ts"] <= got["t1"]
        assert got["after"]["first_step_ts"] == got["first"]["first_step_ts"]
        assert got["after"]["interruption"] == want


def test_a_checkpoint_of_another_step_names_no_interruption(tmp_path: Path, guard_dir: Path, spawn) -> None:
    saved = _save_after_notice(guard_dir / "a", tmp_path / "store", spawn)
    got = _resume(guard_dir / "b", spawn, saved["step"] + 1, saved["dir"])
    assert "interruption" not in got["after"] and "restore_seconds" not in got["after"]
    assert "first_step_ts" in got["after"]


def test_hostile_sidecars_are_ignored_without_raising(tmp_path: Path, guard_dir: Path, spawn) -> None:
    good = {"v": 1, "notice_id": "n-1", "node": "spot-a", "kind": "interruption", "source": "aws",
            "step": 7, "signal_ts": 1700000000.0, "saved_ts": 1700000001.0}
    cases = {
        "not-json": b"{not json",
        "huge": json.dumps(dict(good, node="x" * 8000)).encode(),
        "wrong-step-type": json.dumps(dict(good, step="7")).encode(),
        "bool-step": json.dumps(dict(good, step=True)).encode(),
        "wrong-id-type": json.dumps(dict(good, notice_id=5)).encode(),
        "not-a-time": json.dumps(dict(good, saved_ts=1e300)).encode(),
        "version": json.dumps(dict(good, v=2)).encode(),
        "a-list": b"[1, 2, 3]",
        "deep": b"[" * 4000,
        "not-utf8": b"\xff\xfe\x00",
    }
    store = tmp_path / "store"
    store.mkdir()
    (store / ".spotguard").mkdir()
    for name, data in cases.items():
        (store / name).mkdir()
        spotguard.sidecar_path(store / name).write_bytes(data)
    # A symlink to a valid sidecar elsewhere, and a FIFO (a blocking open would hang resumed()).
    (store / "elsewhere.json").write_text(json.dumps(good))
    (store / "symlink").mkdir()
    os.symlink(store / "elsewhere.json", spotguard.sidecar_path(store / "symlink"))
    (store / "fifo").mkdir()
    os.mkfifo(spotguard.sidecar_path(store / "fifo"))
    # The control: the same content as a plain file is taken.
    (store / "control").mkdir()
    spotguard.sidecar_path(store / "control").write_text(json.dumps(good))
    names = sorted(cases) + ["symlink", "fifo", "control"]
    child = spawn("""
import json, sys, warnings
import spotguard
warnings.simplefilter("ignore")
spotguard.install()
out = {}
for name in sys.argv[2:]:
    path = spotguard.resumed(7, checkpoint=sys.argv[1] + "/" + name)
    out[name] = json.loads(path.read_text()).get("interruption")
print(json.dumps(out))
""", guard_dir, args=(str(store), *names))
    rc, out, err = child.wait(timeout=30)
    assert rc == 0, err
    got = json.loads(out)
    assert got["control"] is not None and got["control"]["notice_id"] == "n-1"
    for name in names[:-1]:
        assert got[name] is None, (name, got[name])


def test_a_staged_checkpoint_names_its_interruption_from_the_manifest(guard_dir: Path, spawn) -> None:
    child = spawn("""
import json
import spotguard
from spotguard.staged import LatestCheckpoint
manifest = {"name": "step-40", "step": 40,
            "notice": {"id": "gce-9", "source": "gce", "kind": "interruption", "deadline": None},
            "origin": {"staged": "/local/step-40", "node": "spot-b", "pod": None},
            "timings": {"acked_at": "2026-11-28T07:00:00.5Z", "started_at": "x", "completed_at": "y"}}
latest = LatestCheckpoint(location="/ckpt/step-40", name="step-40", step=40, manifest=manifest)
spotguard.install()
path = spotguard.resumed(40, checkpoint=latest, restore_seconds=3)
print(path.read_text())
""", guard_dir)
    rc, out, err = child.wait()
    assert rc == 0, err
    rec = json.loads(out)
    assert rec["interruption"] == {"notice_id": "gce-9", "node": "spot-b", "kind": "interruption",
                                   "source": "gce", "step": 40, "saved_ts": 1795849200.5}
    assert rec["restore_seconds"] == 3.0


def test_old_calls_are_unchanged(guard_dir: Path, spawn) -> None:
    child = spawn("""
import spotguard
spotguard.install()
print(spotguard.resumed(3).read_text())
""", guard_dir)
    rc, out, err = child.wait()
    assert rc == 0, err
    rec = json.loads(out)
    assert set(rec) == {"step", "ts", "rank", "world_size", "last_step", "last_ts"}
    assert rec["step"] == 3


# Another local user (uid 1001) plants files as `setpriv` runs it; the test itself runs as root.
PLANTER = """
import json, os, sys
store, body = sys.argv[1], json.loads(sys.argv[2])
d = os.path.join(store, ".spotguard")
os.makedirs(d, exist_ok=True)
os.chmod(d, 0o777)
for step in range(1, 1000):
    with open(os.path.join(d, f"step-{step}.json"), "w") as f:
        f.write(json.dumps(dict(body, step=step)))
"""


def _as_uid(uid: int, script: str, *args: str) -> None:
    import subprocess
    import sys

    subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                    sys.executable, "-c", script, *args], check=True, timeout=30)


def test_a_sidecar_planted_by_another_user_is_not_taken(guard_dir: Path, spawn) -> None:
    """The attack as run: in a shared 1777 checkpoint dir uid 1001 created
    `.spotguard/<name>.json` first, with a forged interruption; the victim saves its checkpoint
    there after a real notice and resumes from it. The forged interruption is not taken, and the
    victim's own sidecar is not written into the other user's directory."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp") as top:
        os.chmod(top, 0o755)
        store = Path(top) / "shared"
        store.mkdir()
        os.chmod(store, 0o1777)
        forged = {"v": 1, "notice_id": "forged-1", "node": "spot-x", "kind": "interruption",
                  "source": "aws", "step": 20, "signal_ts": 1000000000.0,
                  "saved_ts": 1000000001.0}
        # First: the other user's directory, a forged sidecar for every step the victim may save.
        _as_uid(1001, PLANTER, str(store), json.dumps(forged))
        saved = _save_after_notice(guard_dir / "a", store, spawn)
        assert 20 <= saved["step"] < 1000
        # The victim did not write into the other user's directory (it warned instead).
        assert read_json(spotguard.sidecar_path(saved["dir"]))["notice_id"] == "forged-1"
        got = _resume(guard_dir / "b", spawn, saved["step"], saved["dir"])
        assert "interruption" not in got["after"], got["after"]
        # The control: the same forged body in the victim's own directory is taken (the check is
        # the owner, not the content).
        own = Path(top) / "own"
        own.mkdir()
        (own / "step-20").mkdir()
        (own / ".spotguard").mkdir(mode=0o755)
        spotguard.sidecar_path(own / "step-20").write_text(json.dumps(forged))
        got = _resume(guard_dir / "c", spawn, 20, own / "step-20", name="control.py")
        assert got["after"]["interruption"]["notice_id"] == "forged-1"
        # The victim's own directory made writable by others, or the sidecar another user's:
        # not taken either.
        os.chmod(own / ".spotguard", 0o775)
        got = _resume(guard_dir / "d", spawn, 20, own / "step-20", name="group.py")
        assert "interruption" not in got["after"]
        os.chmod(own / ".spotguard", 0o755)
        os.chown(spotguard.sidecar_path(own / "step-20"), 1001, 1001)
        got = _resume(guard_dir / "e", spawn, 20, own / "step-20", name="owner.py")
        assert "interruption" not in got["after"]
