"""Tests of the spotguard package (clients/python/spotguard): file formats, atomic writes, and real signals delivered to
real Python children (the same way the agent delivers them)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import CLIENT_DIR, FROM_SOURCE, read_json, sig_caught, wait_for

import spotguard

ACK_KEYS = {"state", "step", "checkpoint", "ts"}


# ---------------------------------------------------------------------------------------------
# File formats and atomic writes (in-process)
# ---------------------------------------------------------------------------------------------


def test_ack_writes_protocol_schema(guard_dir: Path) -> None:
    before = time.time()
    path = spotguard.ack("done", step=7, checkpoint=Path("/ckpt/step-7.pt"))
    assert path == guard_dir / f"ack-{os.getpid()}.json"
    body = json.loads(path.read_text())
    assert set(body) == ACK_KEYS
    assert body["state"] == "done"
    assert body["step"] == 7
    assert body["checkpoint"] == "/ckpt/step-7.pt"
    assert before - 1 <= body["ts"] <= time.time() + 1
    # Nothing but the ack itself: the temp file was renamed, not left behind.
    assert sorted(p.name for p in guard_dir.iterdir()) == [path.name]


def test_ack_received_has_null_step_and_checkpoint(guard_dir: Path) -> None:
    body = json.loads(spotguard.ack("received").read_text())
    assert body["state"] == "received"
    assert body["step"] is None and body["checkpoint"] is None


def test_ack_overwrites_previous_state(guard_dir: Path) -> None:
    spotguard.ack("received")
    spotguard.ack("skipped", step=3)
    body = json.loads(spotguard.ack_path().read_text())
    assert (body["state"], body["step"]) == ("skipped", 3)


@pytest.mark.parametrize("state", ["", "ok", "DONE", "timeout", None])
def test_ack_rejects_unknown_state(guard_dir: Path, state) -> None:
    with pytest.raises(ValueError, match="ack state must be one of"):
        spotguard.ack(state)
    assert not guard_dir.exists() or not list(guard_dir.iterdir())


@pytest.mark.parametrize("step", [True, 1.5, "3"])
def test_ack_rejects_non_integer_step(guard_dir: Path, step) -> None:
    with pytest.raises(ValueError, match="step must be an int"):
        spotguard.ack("done", step=step)


def test_ack_accepts_integer_like_step(guard_dir: Path) -> None:
    class Step:
        def __index__(self) -> int:
            return 42

    body = json.loads(spotguard.ack("done", step=Step()).read_text())
    assert body["step"] == 42 and isinstance(body["step"], int)


def test_ack_larger_than_the_agent_reads_is_refused(guard_dir: Path) -> None:
    with pytest.raises(ValueError, match="at most 65536"):
        spotguard.ack("done", step=1, checkpoint="/" + "x" * spotguard.MAX_ACK_BYTES)
    assert not spotguard.ack_path().exists()


def test_ack_container_writes_plain_ack_file(guard_dir: Path) -> None:
    path = spotguard.ack_container(step=5, checkpoint="/ckpt/5")
    assert path == guard_dir / "ack"
    body = json.loads(path.read_text())
    assert body["state"] == "done" and body["step"] == 5 and body["checkpoint"] == "/ckpt/5"


def test_atomic_write_never_shows_a_partial_file(guard_dir: Path) -> None:
    """A reader polling the ack (as the agent does) must always parse a whole document."""
    big = "/ckpt/" + "x" * 60_000
    spotguard.ack("received")
    path = spotguard.ack_path()
    stop = threading.Event()
    bad = []

    def reader() -> None:
        while not stop.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                bad.append("missing")
                continue
            try:
                json.loads(text)
            except ValueError:
                bad.append(len(text))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(60):
            spotguard.ack("done" if i % 2 else "received", step=i, checkpoint=big)
    finally:
        stop.set()
        t.join()
    assert bad == []
    assert [p.name for p in guard_dir.iterdir()] == [path.name]


def test_failed_write_leaves_no_temp_file(guard_dir: Path) -> None:
    # The ack path is a non-empty directory: the rename fails; the temp file must not stay around.
    target = spotguard.ack_path()
    target.mkdir(parents=True)
    (target / "keep").write_text("x")
    with pytest.raises(OSError):
        spotguard.ack("done", step=1)
    assert sorted(p.name for p in guard_dir.iterdir()) == [target.name]


def test_checkpoint_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(spotguard, "_dir", None)
    monkeypatch.delenv("SPOTGUARD_DIR", raising=False)
    assert spotguard.checkpoint_dir() == Path("/tmp/spotguard")
    monkeypatch.setenv("SPOTGUARD_DIR", str(tmp_path / "env"))
    assert spotguard.checkpoint_dir() == tmp_path / "env"
    monkeypatch.setattr(spotguard, "_dir", str(tmp_path / "explicit"))
    assert spotguard.checkpoint_dir() == tmp_path / "explicit"
    assert spotguard.ack_path(1234) == tmp_path / "explicit" / "ack-1234.json"


NOTICE = {
    "notice_id": "i-0abc:instance-action",
    "source": "aws",
    "kind": "interruption",
    "deadline_unix": 1_700_000_120,
    "checkpoint_deadline_unix": 1_700_000_095.5,
    "signal": "SIGUSR1",
}


def test_notice_absent_is_none(guard_dir: Path) -> None:
    assert spotguard.notice() is None
    assert spotguard.time_left() is None


def test_notice_parses_every_field(guard_dir: Path) -> None:
    guard_dir.mkdir()
    (guard_dir / "notice.json").write_text(json.dumps({**NOTICE, "future_field": 1}))
    n = spotguard.notice()
    assert n is not None
    assert n.notice_id == "i-0abc:instance-action"
    assert (n.source, n.kind, n.signal) == ("aws", "interruption", "SIGUSR1")
    assert n.deadline_unix == 1_700_000_120.0
    assert n.checkpoint_deadline_unix == 1_700_000_095.5
    assert n.raw["future_field"] == 1
    assert n.time_left(now=1_700_000_000) == pytest.approx(95.5)
    assert n.time_left(now=1_700_000_000, until="deadline") == pytest.approx(120.0)
    assert n.time_left(now=1_800_000_000) == 0.0
    assert spotguard.time_left(now=1_700_000_090) == pytest.approx(5.5)
    with pytest.raises(ValueError):
        n.time_left(until="soon")


def test_notice_without_deadlines_means_now(guard_dir: Path) -> None:
    guard_dir.mkdir()
    body = dict(NOTICE, deadline_unix=None)
    del body["checkpoint_deadline_unix"]
    (guard_dir / "notice.json").write_text(json.dumps(body))
    n = spotguard.notice()
    assert n is not None and n.deadline_unix is None and n.checkpoint_deadline_unix is None
    assert n.time_left() == 0.0


def test_notice_checkpoint_deadline_falls_back_to_deadline(guard_dir: Path) -> None:
    guard_dir.mkdir()
    body = dict(NOTICE)
    del body["checkpoint_deadline_unix"]
    (guard_dir / "notice.json").write_text(json.dumps(body))
    assert spotguard.time_left(now=1_700_000_100) == pytest.approx(20.0)


@pytest.mark.parametrize(
    "content",
    ["{not json", "[1, 2]", json.dumps(dict(NOTICE, deadline_unix="soon")), ""],
)
def test_notice_unparseable_is_none(guard_dir: Path, content: str) -> None:
    guard_dir.mkdir()
    (guard_dir / "notice.json").write_text(content)
    assert spotguard.notice() is None


def test_install_outside_main_thread_raises() -> None:
    errors = []

    def target() -> None:
        try:
            spotguard.install()
        except RuntimeError as err:
            errors.append(str(err))

    t = threading.Thread(target=target)
    t.start()
    t.join()
    assert len(errors) == 1 and "main thread" in errors[0]
    assert spotguard.installed_signals() == ()
    assert signal.getsignal(signal.SIGUSR1) is not spotguard._handle


@pytest.mark.parametrize("bad", [[], [signal.SIGKILL], [signal.SIGSTOP]])
def test_install_rejects_uncatchable_or_no_signals(bad) -> None:
    with pytest.raises(ValueError):
        spotguard.install(signals=bad)
    assert spotguard.installed_signals() == ()


def test_exit_after_checkpoint_soft_raises_system_exit() -> None:
    with pytest.raises(SystemExit) as info:
        spotguard.exit_after_checkpoint(hard=False)
    assert info.value.code == 143


# ---------------------------------------------------------------------------------------------
# Real signals to real children
# ---------------------------------------------------------------------------------------------

# A tiny training loop using the helper. It waits for a "go" file before saving so that the test
# can observe the "received" ack first, and it gives up on its own after 120 s.
LOOP = """
import os, sys, time, pathlib, signal
import spotguard

d = pathlib.Path(os.environ["SPOTGUARD_DIR"])
spotguard.install()
spotguard.resumed(0)  # training starts: SIGTERM is a checkpoint request from here on
(d / "ready").write_text(str(os.getpid()))
step = 0
give_up = time.monotonic() + 120
while time.monotonic() < give_up:
    step += 1
    time.sleep(0.01)
    if spotguard.should_checkpoint():
        while not (d / "go").exists():
            time.sleep(0.01)
        ckpt = d / f"ckpt-{step}"
        ckpt.write_text("weights")
        spotguard.ack("done", step=step, checkpoint=str(ckpt))
        print("signal", spotguard.received_signal(), "step", step, flush=True)
        spotguard.exit_after_checkpoint()
sys.exit(3)
"""


def _ready(guard_dir: Path):
    return lambda: (guard_dir / "ready").exists()


def _ack_state(path: Path, state: str):
    def probe():
        body = read_json(path)
        return body if body and body.get("state") == state else None

    return probe


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_signal_received_then_done_then_exit_143(guard_dir: Path, spawn, signum) -> None:
    guard_dir.mkdir()
    child = spawn(LOOP, guard_dir)
    wait_for("the child to install the helper", _ready(guard_dir))
    # What the agent's `handlers` mode looks at before it signals.
    assert sig_caught(child.pid, signal.SIGUSR1)
    assert sig_caught(child.pid, signal.SIGTERM)

    sent = time.time()
    child.kill(signum)
    ack_file = guard_dir / f"ack-{child.pid}.json"
    received = wait_for("the received ack", _ack_state(ack_file, "received"))
    assert set(received) == ACK_KEYS
    assert received["step"] is None and received["checkpoint"] is None
    assert received["ts"] >= sent - 1

    (guard_dir / "go").write_text("")
    rc, out, err = child.wait()
    assert rc == 143, (out, err)
    done = read_json(ack_file)
    assert done is not None and done["state"] == "done"
    assert isinstance(done["step"], int) and done["step"] >= 1
    assert done["checkpoint"] == str(guard_dir / f"ckpt-{done['step']}")
    assert Path(done["checkpoint"]).read_text() == "weights"
    assert done["ts"] >= received["ts"]
    assert out.split() == ["signal", str(int(signum)), "step", str(done["step"])]
    # One process, one ack file; no temp files left behind.
    assert sorted(p.name for p in guard_dir.glob("*ack*")) == [ack_file.name]


CHAIN = """
import json, os, signal, sys, time, pathlib
import spotguard

d = pathlib.Path(os.environ["SPOTGUARD_DIR"])
calls = []

def earlier(signum, frame):
    calls.append((signum, spotguard.requested()))

signal.signal(signal.SIGUSR1, earlier)
spotguard.install()
spotguard.install()  # idempotent: must not wrap itself
spotguard.install(signals=[signal.SIGUSR1])
assert signal.getsignal(signal.SIGUSR1) is spotguard._handle
(d / "ready").write_text("")

def wait_calls(n):
    end = time.monotonic() + 60
    while len(calls) < n and time.monotonic() < end:
        time.sleep(0.01)

wait_calls(1)
first = (d / f"ack-{os.getpid()}.json").read_text()
(d / "next").write_text("")
wait_calls(2)
second = (d / f"ack-{os.getpid()}.json").read_text()
print(json.dumps({"calls": calls, "first": first, "second": second,
                  "signals": sorted(spotguard.installed_signals())}))
"""


def test_chains_earlier_handler_after_setting_flag(guard_dir: Path, spawn) -> None:
    guard_dir.mkdir()
    child = spawn(CHAIN, guard_dir)
    wait_for("the child to install the helper", _ready(guard_dir))
    child.kill(signal.SIGUSR1)
    wait_for("the first signal to be handled", lambda: (guard_dir / "next").exists())
    child.kill(signal.SIGUSR1)
    rc, out, err = child.wait()
    assert rc == 0, err
    result = json.loads(out)
    # The earlier handler ran once per signal (not twice: install() did not wrap itself), and the
    # flag was already set when it ran.
    assert result["calls"] == [[signal.SIGUSR1, True], [signal.SIGUSR1, True]]
    assert result["signals"] == sorted([signal.SIGUSR1, signal.SIGTERM])
    # The second signal of the same request does not rewrite the received ack.
    assert json.loads(result["first"])["state"] == "received"
    assert result["second"] == result["first"]


LATE_TERM = """
import json, os, signal, sys, time, pathlib
import spotguard

d = pathlib.Path(os.environ["SPOTGUARD_DIR"])
spotguard.install()
(d / "ready").write_text("")
end = time.monotonic() + 60
while not spotguard.should_checkpoint() and time.monotonic() < end:
    time.sleep(0.01)
spotguard.ack("done", step=11, checkpoint="/ckpt/11")
(d / "saved").write_text("")
while not (d / "termed").exists():
    time.sleep(0.01)
# The kubelet's SIGTERM after the save must neither kill us (SIG_DFL is not chained) nor turn
# the done ack back into received.
print(json.dumps({"ack": json.loads((d / f"ack-{os.getpid()}.json").read_text()),
                  "signal": spotguard.received_signal()}))
spotguard.exit_after_checkpoint()
"""


def test_late_sigterm_after_done_keeps_done(guard_dir: Path, spawn) -> None:
    guard_dir.mkdir()
    child = spawn(LATE_TERM, guard_dir)
    wait_for("the child to install the helper", _ready(guard_dir))
    child.kill(signal.SIGUSR1)
    wait_for("the done ack", lambda: (guard_dir / "saved").exists())
    child.kill(signal.SIGTERM)
    time.sleep(0.5)  # give the SIGTERM time to arrive before releasing the child
    (guard_dir / "termed").write_text("")
    rc, out, err = child.wait()
    assert rc == 143, err
    result = json.loads(out)
    assert result["ack"]["state"] == "done" and result["ack"]["step"] == 11
    assert result["signal"] == signal.SIGUSR1


REBALANCE = """
import json, os, signal, sys, time, pathlib
import spotguard

d = pathlib.Path(os.environ["SPOTGUARD_DIR"])
spotguard.install()
ack = d / f"ack-{os.getpid()}.json"

def wait_request():
    end = time.monotonic() + 60
    while not spotguard.should_checkpoint() and time.monotonic() < end:
        time.sleep(0.01)

(d / "ready").write_text("")
wait_request()
spotguard.ack("done", step=1)
spotguard.clear()  # early checkpoint (e.g. a rebalance): keep training
assert not spotguard.should_checkpoint() and spotguard.received_signal() is None
(d / "again").write_text("")
wait_request()
states = [json.loads(ack.read_text())["state"]]
spotguard.ack("done", step=2)
print(json.dumps({"states": states, "final": json.loads(ack.read_text())}))
"""


def test_clear_then_new_signal_writes_fresh_received(guard_dir: Path, spawn) -> None:
    guard_dir.mkdir()
    child = spawn(REBALANCE, guard_dir)
    wait_for("the child to install the helper", _ready(guard_dir))
    child.kill(signal.SIGUSR1)
    wait_for("the first checkpoint", lambda: (guard_dir / "again").exists())
    child.kill(signal.SIGUSR1)
    rc, out, err = child.wait()
    assert rc == 0, err
    result = json.loads(out)
    assert result["states"] == ["received"]
    assert result["final"]["state"] == "done" and result["final"]["step"] == 2


FORK = """
import json, os, signal, sys, pathlib
import spotguard

def caught(pid, signum):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signum - 1)))

spotguard.install()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    report = {"handler_is_default": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
              "caught": caught(os.getpid(), signal.SIGUSR1),
              "installed": list(spotguard.installed_signals())}
    os.write(w, json.dumps(report).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 65536).decode())
os.waitpid(pid, 0)
print(json.dumps({"child": child, "parent_caught": caught(os.getpid(), signal.SIGUSR1)}))
"""


def test_forked_children_get_previous_dispositions(guard_dir: Path, spawn) -> None:
    """A DataLoader-style forked worker must not look like a handler to the agent: it would be
    signalled and never ack."""
    guard_dir.mkdir()
    child = spawn(FORK, guard_dir)
    rc, out, err = child.wait()
    assert rc == 0, err
    result = json.loads(out)
    assert result["parent_caught"] is True
    assert result["child"] == {"handler_is_default": True, "caught": False, "installed": []}


NO_TORCH = """
import json, os, signal, sys
sys.modules["torch"] = None              # "import torch" now fails, as where torch is absent
sys.modules["torch.distributed"] = None
import spotguard

try:
    import torch  # noqa: F401
    torch_importable = True
except ImportError:
    torch_importable = False

out = {"torch_importable": torch_importable}
spotguard.install()
out["before"] = [spotguard.should_checkpoint(), spotguard.should_checkpoint(every=4)]
try:
    spotguard.should_checkpoint(every=0)
    out["every0"] = "accepted"
except ValueError:
    out["every0"] = "rejected"
signal.raise_signal(signal.SIGUSR1)
out["after"] = [spotguard.should_checkpoint(every=4), spotguard.should_checkpoint()]
out["requested"] = spotguard.requested()
spotguard.clear()
out["cleared"] = spotguard.should_checkpoint()
spotguard.uninstall()
out["restored"] = signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
print(json.dumps(out))
"""


def test_should_checkpoint_without_torch(guard_dir: Path, spawn) -> None:
    child = spawn(NO_TORCH, guard_dir)
    rc, out, err = child.wait()
    assert rc == 0, err
    assert json.loads(out) == {
        "torch_importable": False,
        "before": [False, False],
        "every0": "rejected",
        # Without a process group the flag is read on every call, `every` notwithstanding.
        "after": [True, True],
        "requested": True,
        "cleared": False,
        "restored": True,
    }
    body = read_json(guard_dir / f"ack-{child.pid}.json")
    assert body is not None and body["state"] == "received"


# ---------------------------------------------------------------------------------------------
# torch.distributed (gloo on CPU): every rank agrees on one step
# ---------------------------------------------------------------------------------------------

DDP = """
import json, os, sys, time, pathlib, datetime
import torch
import torch.distributed as dist
import spotguard

every = int(sys.argv[1])
via = sys.argv[2]
d = pathlib.Path(os.environ["SPOTGUARD_DIR"])
spotguard.install()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
rank = dist.get_rank()
(d / f"ready-{rank}").write_text(str(os.getpid()))
step = 0
while step < 20000:
    step += 1
    time.sleep(0.005)
    if spotguard.should_checkpoint(every=every, via=via):
        spotguard.ack("done", step=step)
        side = spotguard._side_group is not None
        print(json.dumps({"rank": rank, "step": step, "signalled": spotguard.requested(),
                          "side_group": side}))
        dist.destroy_process_group()
        spotguard.exit_after_checkpoint()
sys.exit(3)
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("every, via", [(1, "auto"), (3, "auto"), (1, "gloo"), (2, "default")])
def test_should_checkpoint_all_ranks_agree_with_torch(guard_dir: Path, spawn, every: int,
                                                      via: str) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (only this torch.distributed test needs it)")
    guard_dir.mkdir()
    port = str(_free_port())
    ranks = []
    for rank in range(2):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank)}
        ranks.append(spawn(DDP, guard_dir, env=env, args=(str(every), via), name=f"rank{rank}.py"))
    wait_for("both ranks to join", lambda: all((guard_dir / f"ready-{r}").exists() for r in range(2)),
             timeout=120)
    time.sleep(0.2)
    # Only rank 1 gets the signal, as when ranks see it at different moments.
    ranks[1].kill(signal.SIGUSR1)
    results = []
    for child in ranks:
        rc, out, err = child.wait(timeout=120)
        assert rc == 143, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["signalled"] for r in results] == [False, True]
    assert results[0]["step"] == results[1]["step"]
    assert results[0]["step"] % every == 0
    # Under gloo, "auto" and "default" reduce through the default group; "gloo" made a side group.
    assert [r["side_group"] for r in results] == [via == "gloo"] * 2
    for child, result in zip(ranks, results):
        body = read_json(guard_dir / f"ack-{child.pid}.json")
        assert body is not None and body["state"] == "done" and body["step"] == result["step"]


# ---------------------------------------------------------------------------------------------
# launch: a torchrun-style launcher as the container's PID 1
# ---------------------------------------------------------------------------------------------

# Stands in for torchrun: runs one "worker", passes SIGTERM on to it, and exits 1 when the worker
# fails, as torchrun's agent does.
FAKE_LAUNCHER = """
import signal, subprocess, sys
worker = subprocess.Popen([sys.executable, "-u"] + sys.argv[1:])
signal.signal(signal.SIGTERM, lambda signum, frame: worker.send_signal(signum))
rc = worker.wait()
sys.exit(0 if rc == 0 else 1)
"""

WORKER = """
import os, sys, time, pathlib
import spotguard

d = pathlib.Path(os.environ["SPOTGUARD_DIR"])
mode = sys.argv[1]
if mode == "wait-signal":
    spotguard.install()
    spotguard.resumed(0)  # training starts: SIGTERM is a checkpoint request from here on
    (d / "ready").write_text(str(os.getpid()))
    end = time.monotonic() + 60
    while not spotguard.should_checkpoint() and time.monotonic() < end:
        time.sleep(0.01)
    spotguard.ack("done", step=5, checkpoint="/ckpt/5")
    spotguard.exit_after_checkpoint()
if mode == "done-then-fail":
    spotguard.ack("done", step=1)
    sys.exit(143)
if mode == "slow-done-then-fail":  # a worker that lives long enough to be seen
    time.sleep(1.5)
    spotguard.ack("done", step=1)
    sys.exit(143)
if mode == "fail":
    sys.exit(1)
if mode == "skipped-then-fail":
    spotguard.ack("skipped", step=1)
    sys.exit(143)
sys.exit(0)
"""


def _launch(spawn, guard_dir: Path, tmp_path: Path, mode: str):
    (tmp_path / "fake_torchrun.py").write_text(FAKE_LAUNCHER)
    (tmp_path / "worker.py").write_text(WORKER)
    script = "import sys, spotguard; sys.exit(spotguard.main())"
    return spawn(script, guard_dir, name="launcher.py",
                 args=("launch", "--", sys.executable, str(tmp_path / "fake_torchrun.py"),
                       str(tmp_path / "worker.py"), mode))


@pytest.mark.parametrize(
    "mode, expected",
    [("done-then-fail", 143), ("fail", 1), ("skipped-then-fail", 1), ("ok", 0)],
)
def test_launch_maps_launcher_failure_after_done_to_143(guard_dir: Path, spawn, tmp_path: Path,
                                                        mode: str, expected: int) -> None:
    guard_dir.mkdir()
    rc, out, err = _launch(spawn, guard_dir, tmp_path, mode).wait()
    assert rc == expected, err


def test_launch_ignores_done_acks_from_an_earlier_run(guard_dir: Path, spawn, tmp_path: Path) -> None:
    guard_dir.mkdir()
    stale = guard_dir / "ack-4242.json"
    stale.write_text('{"state":"done","step":9,"checkpoint":null,"ts":1}')
    old = time.time() - 3600
    os.utime(stale, (old, old))
    rc, out, err = _launch(spawn, guard_dir, tmp_path, "fail").wait()
    assert rc == 1, err


def test_launch_forwards_sigterm_and_is_never_a_sigusr1_target(guard_dir: Path, spawn,
                                                                tmp_path: Path) -> None:
    guard_dir.mkdir()
    launcher = _launch(spawn, guard_dir, tmp_path, "wait-signal")
    wait_for("the worker to install the helper", _ready(guard_dir))
    assert sig_caught(launcher.pid, signal.SIGTERM)
    assert not sig_caught(launcher.pid, signal.SIGUSR1)
    worker_pid = int((guard_dir / "ready").read_text())
    with open(f"/proc/{worker_pid}/stat") as f:
        fake_torchrun = int(f.read().rpartition(")")[2].split()[1])
    wait_for("the fake torchrun to relay SIGTERM", lambda: sig_caught(fake_torchrun, signal.SIGTERM))
    # The kubelet signals PID 1 only: SIGTERM goes launcher -> torchrun -> worker, which treats it
    # as "checkpoint now", acks done and exits 143; torchrun exits 1; the pod must report 143.
    launcher.kill(signal.SIGTERM)
    rc, out, err = launcher.wait()
    assert rc == 143, err
    body = read_json(guard_dir / f"ack-{worker_pid}.json")
    assert body is not None and body["state"] == "done" and body["step"] == 5


def test_launch_usage_errors(guard_dir: Path, spawn) -> None:
    for args in ((), ("launch",), ("launch", "--"), ("other",)):
        rc, out, err = spawn("import sys, spotguard; sys.exit(spotguard.main())", guard_dir,
                             name="usage.py", args=args).wait()
        assert rc == 64 and "usage: python3 -m spotguard launch" in err
    rc, out, err = spawn("import sys, spotguard; sys.exit(spotguard.main())", guard_dir,
                         name="missing.py", args=("launch", "/nonexistent/torchrun")).wait()
    assert rc == 127 and "cannot run" in err


STALE_NOTICE = """
import json, os, sys, time, pathlib
import spotguard

d = pathlib.Path(os.environ["SPOTGUARD_DIR"])
before = spotguard.notice() is not None          # not installed: any notice.json is returned
spotguard.install()
after_install = spotguard.notice() is not None   # written before install(): a leftover
(d / "notice.json").write_text(sys.argv[1])       # as the agent does for a live notice
fresh = spotguard.notice()
print(json.dumps({"before": before, "after_install": after_install,
                  "fresh": fresh.notice_id if fresh else None}))
"""


def test_notice_written_before_install_is_a_leftover(guard_dir: Path, spawn) -> None:
    guard_dir.mkdir()
    old = guard_dir / "notice.json"
    old.write_text(json.dumps(dict(NOTICE, notice_id="old")))
    stamp = time.time() - 600
    os.utime(old, (stamp, stamp))
    child = spawn(STALE_NOTICE, guard_dir, args=(json.dumps(dict(NOTICE, notice_id="new")),))
    rc, out, err = child.wait()
    assert rc == 0, err
    assert json.loads(out) == {"before": True, "after_install": False, "fresh": "new"}


# ---------------------------------------------------------------------------------------------
# install(): the checkpoint directory and the default-directory warning
# ---------------------------------------------------------------------------------------------

MKDIR = """
import json, os, stat, sys, warnings
import spotguard
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    d = spotguard.install()
print(json.dumps({"dir": str(d), "mode": stat.S_IMODE(os.stat(d).st_mode),
                  "warnings": [str(w.message) for w in caught]}))
"""


def test_install_creates_a_missing_dir_with_parents_as_1777(guard_dir: Path, spawn) -> None:
    nested = guard_dir / "a" / "b"
    rc, out, err = spawn(MKDIR, nested).wait()
    assert rc == 0, err
    result = json.loads(out)
    assert result == {"dir": str(nested), "mode": 0o1777, "warnings": []}


def test_install_leaves_an_existing_dir_alone(guard_dir: Path, spawn) -> None:
    guard_dir.mkdir(mode=0o750)
    os.chmod(guard_dir, 0o750)
    rc, out, err = spawn(MKDIR, guard_dir).wait()
    assert rc == 0, err
    assert json.loads(out)["mode"] == 0o750


def test_install_warns_when_it_cannot_create_the_dir(guard_dir: Path, spawn) -> None:
    guard_dir.parent.joinpath("file").write_text("x")
    script = MKDIR.replace('"mode": stat.S_IMODE(os.stat(d).st_mode),', "")
    rc, out, err = spawn(script, guard_dir.parent / "file" / "sub").wait()
    assert rc == 0, err
    (warning,) = json.loads(out)["warnings"]
    assert "cannot create the checkpoint directory" in warning and "timeout" in warning


DEFAULT_DIR_WARNING = """
import json, os, sys, warnings
import spotguard
spotguard.DEFAULT_DIR = sys.argv[1]          # keep the test out of the real /tmp/spotguard
spotguard.HOST_AGENT_DIR = sys.argv[2]
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    d = spotguard.install()
print(json.dumps({"dir": str(d), "warnings": [str(w.message) for w in caught],
                  "category": [w.category.__name__ for w in caught]}))
"""


@pytest.mark.parametrize("host_agent", [False, True], ids=["no-host-agent", "host-agent-dir"])
def test_install_without_spotguard_dir_warns(tmp_path: Path, spawn, host_agent: bool) -> None:
    default = tmp_path / "default"
    run_dir = tmp_path / "run-spotguard"
    if host_agent:
        run_dir.mkdir()
    child = spawn(DEFAULT_DIR_WARNING, tmp_path, env={"SPOTGUARD_DIR": ""},
                  args=(str(default), str(run_dir)))
    rc, out, err = child.wait()
    assert rc == 0, err
    result = json.loads(out)
    assert result["dir"] == str(default) and default.is_dir()
    (warning,) = result["warnings"]
    assert result["category"] == ["RuntimeWarning"]
    assert "SPOTGUARD_DIR is not set" in warning and "timeout" in warning
    assert (f"set SPOTGUARD_DIR={run_dir}" in warning) == host_agent


@pytest.fixture
def shared_tmp():
    """A directory other uids can write in, like /tmp (pytest's tmp_path is under a root-only
    0700 dir)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="spotguard-uid-test-", dir="/tmp"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the trainer and agent as other uids")
def test_a_trainer_created_dir_is_writable_by_root_without_dac_override(shared_tmp: Path) -> None:
    """The privileges we ship: the trainer runs as uid 1000 and creates SPOTGUARD_DIR; the agent is
    uid 0 without CAP_DAC_OVERRIDE (the DaemonSet drops it) and must write notice.json there; a
    trainer of a third uid must write its ack."""
    import shutil

    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    guard = shared_tmp / "a" / "guard"
    env = dict(os.environ, SPOTGUARD_DIR=str(guard))
    if FROM_SOURCE:
        env["PYTHONPATH"] = str(CLIENT_DIR)
    as_user = [setpriv, "--reuid=1000", "--regid=1000", "--clear-groups", sys.executable, "-c"]
    subprocess.run(as_user + ["import spotguard; spotguard.install()"], env=env, check=True,
                   timeout=60)
    assert guard.stat().st_uid == 1000 and (guard.stat().st_mode & 0o7777) == 0o1777
    no_dac = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all",
              sys.executable, "-c"]
    agent = subprocess.run(
        no_dac + [f"open({str(guard / 'notice.json')!r}, 'w').write('{{}}')\n"
                  "import os; print(os.geteuid())"],
        capture_output=True, text=True, timeout=60)
    assert agent.returncode == 0 and agent.stdout.strip() == "0", agent.stderr
    other = [setpriv, "--reuid=1001", "--regid=1001", "--clear-groups", sys.executable, "-c"]
    subprocess.run(other + ["import spotguard; spotguard.ack('done', step=1)"], env=env,
                   check=True, timeout=60)
    assert len(list(guard.glob("ack-*.json"))) == 1


def test_should_checkpoint_rejects_an_unknown_agreement_path(guard_dir: Path, spawn) -> None:
    script = ("import spotguard\n"
              "try:\n    spotguard.should_checkpoint(via='nccl')\nexcept ValueError as e:\n"
              "    print(e)\n")
    rc, out, err = spawn(script, guard_dir).wait()
    assert rc == 0 and "via must be one of auto, gloo, default" in out, err


# ---------------------------------------------------------------------------------------------
# launch: which acks belong to this run
# ---------------------------------------------------------------------------------------------


def test_launch_ignores_a_done_ack_written_just_before_it_started(guard_dir: Path, spawn,
                                                                   tmp_path: Path) -> None:
    """Back-to-back runs in one directory: the previous run's `done`, a moment old, must not turn
    this run's plain failure into 143 (v0.1 looked back 0.5 s)."""
    guard_dir.mkdir()
    (guard_dir / "ack-4242.json").write_text(json.dumps(
        {"state": "done", "step": 9, "checkpoint": None, "ts": time.time()}))
    (guard_dir / "ack").write_text(json.dumps({"state": "done", "ts": time.time()}))
    rc, out, err = _launch(spawn, guard_dir, tmp_path, "fail").wait()
    assert rc == 1, err


NOTICE_WORKER = """
import json, os, sys, time, pathlib
import spotguard

d = pathlib.Path(os.environ["SPOTGUARD_DIR"])
spotguard.install()
notice = {"notice_id": sys.argv[1], "source": "aws", "kind": "interruption",
          "deadline_unix": time.time() + 120, "checkpoint_deadline_unix": time.time() + 90,
          "signal": "SIGUSR1"}
(d / "notice.json").write_text(json.dumps(notice))     # as the agent does, during this run
if sys.argv[2] == "stale-id":
    # A `done` naming another notice (an earlier one), written now.
    body = {"state": "done", "step": 3, "checkpoint": None, "ts": time.time(), "notice_id": "old"}
    (d / f"ack-{os.getpid()}.json").write_text(json.dumps(body))
else:
    spotguard.ack("done", step=3)
    print(json.loads((d / f"ack-{os.getpid()}.json").read_text())["notice_id"])
sys.exit(143)
"""


@pytest.mark.parametrize("mode, expected", [("this-notice", 143), ("stale-id", 1)])
def test_launch_matches_acks_by_notice_id(guard_dir: Path, spawn, tmp_path: Path, mode: str,
                                          expected: int) -> None:
    guard_dir.mkdir()
    (tmp_path / "fake_torchrun.py").write_text(FAKE_LAUNCHER)
    (tmp_path / "worker.py").write_text(NOTICE_WORKER)
    launcher = spawn("import sys, spotguard; sys.exit(spotguard.main())", guard_dir,
                     name="launcher.py",
                     args=("launch", "--", sys.executable, str(tmp_path / "fake_torchrun.py"),
                           str(tmp_path / "worker.py"), "n-123", mode))
    rc, out, err = launcher.wait()
    assert rc == expected, err
    if mode == "this-notice":
        assert out.strip() == "n-123"
        assert "exiting 143" in err and "notice n-123" in err


def test_launch_finds_spotguard_dir_in_the_workers_environment(guard_dir: Path, spawn,
                                                                tmp_path: Path) -> None:
    """`launch -- env SPOTGUARD_DIR=… torchrun …`: the launcher's own environment has no
    SPOTGUARD_DIR; it finds the directory where the workers do."""
    guard_dir.mkdir()
    (tmp_path / "fake_torchrun.py").write_text(FAKE_LAUNCHER)
    (tmp_path / "worker.py").write_text(WORKER)
    default = tmp_path / "elsewhere"
    script = ("import sys, spotguard\nspotguard.DEFAULT_DIR = sys.argv[1]\n"
              "sys.exit(spotguard.main(sys.argv[2:]))")
    launcher = spawn(script, guard_dir, name="launcher.py", env={"SPOTGUARD_DIR": ""},
                     args=(str(default), "launch", "--", "env", f"SPOTGUARD_DIR={guard_dir}",
                           sys.executable, str(tmp_path / "fake_torchrun.py"),
                           str(tmp_path / "worker.py"), "slow-done-then-fail"))
    rc, out, err = launcher.wait()
    assert rc == 143, err
    assert str(guard_dir) in err


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the trainer and a forger as other uids")
def test_an_ack_name_held_by_another_user_is_written_under_a_fallback_name(shared_tmp: Path) -> None:
    """checkpoint-protocol.md section 4: in a sticky directory another user's file at
    ``ack-<pid>.json`` (or ``ack``) refuses the trainer's rename; the helper writes
    ``ack-<pid>.<suffix>.json`` (``ack.<suffix>``) instead, and keeps using it."""
    import shutil

    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    guard = shared_tmp / "guard"
    guard.mkdir()
    os.chmod(guard, 0o1777)
    env = dict(os.environ, SPOTGUARD_DIR=str(guard))
    if FROM_SOURCE:
        env["PYTHONPATH"] = str(CLIENT_DIR)
    script = (
        "import os, sys, json, spotguard\n"
        "pid = os.getpid()\n"
        "for name in (f'ack-{pid}.json', 'ack'):\n"  # the forger, uid 1001, plants both names
        "    p = os.path.join(os.environ['SPOTGUARD_DIR'], name)\n"
        "    open(p, 'w').write('{\"state\":\"done\"}')\n"
        "    os.chown(p, 1001, 1001)\n"
        "os.setgid(1000); os.setuid(1000)\n"  # the trainer
        "first = spotguard.ack('received')\n"
        "second = spotguard.ack('done', step=7)\n"
        "plain = spotguard.ack_container(step=7)\n"
        "print(json.dumps([str(first), str(second), str(plain)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    first, second, plain = json.loads(out.stdout)
    assert first == second, "the fallback name is kept for later writes"
    name = Path(second).name
    assert name.startswith("ack-") and name.endswith(".json") and name.count(".") == 2, name
    assert Path(plain).name.startswith("ack.")
    for p in (Path(second), Path(plain)):
        assert p.stat().st_uid == 1000
        assert json.loads(p.read_text())["step"] == 7
    # The planted files are untouched (the trainer cannot replace them).
    assert (guard / "ack").stat().st_uid == 1001
