"""Elastic training: the launcher's torchrun handling (spotguard.elastic), a preempted node leaving
a job of two stand-in torchrun agents (tests/standin/torchrun: rendezvous through a shared store,
restarts up to --max-restarts, SIGTERM stops the workers without closing the rendezvous), the
helper's SIGTERM before training and its resume records, and the Horovod elastic helpers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from conftest import CLIENT_DIR, FROM_SOURCE, kill_strays, read_json, reap, wait_for

import spotguard
from spotguard import elastic, horovod

STANDIN = Path(__file__).resolve().parent / "standin"


# ---------------------------------------------------------------------------------------------
# torchrun command lines
# ---------------------------------------------------------------------------------------------

def test_parse_torchrun_finds_its_options_and_leaves_the_script_alone() -> None:
    argv = ["env", "A=b", "/venv/bin/torchrun", "--nnodes=1:4", "--nproc_per_node", "2",
            "--rdzv-backend", "c10d", "--rdzv_endpoint=head:29400", "--max-restarts", "3",
            "--standalone", "train.py", "--max-restarts", "9", "--nnodes", "7"]
    tr = elastic.parse_torchrun(argv, environ={})
    assert tr is not None
    assert argv[tr.end] == "train.py"
    assert tr.nodes == (1, 4) and tr.backend == "c10d" and tr.endpoint == "head:29400"
    assert tr.max_restarts == 3
    assert not tr.elastic  # --standalone is one node
    assert elastic.parse_torchrun(["python3", "train.py"]) is None
    m = elastic.parse_torchrun(["python3", "-m", "torch.distributed.run", "--nnodes", "2:3",
                                "-m", "pkg.train"], environ={})
    assert m is not None and m.elastic and m.get("-m") == "1"


def test_pet_environment_counts_like_torchrun_reads_it() -> None:
    # Kubeflow's PyTorchJob elasticPolicy passes torchrun its settings as PET_* variables.
    tr = elastic.parse_torchrun(["torchrun", "train.py"],
                                environ={"PET_NNODES": "2:8", "PET_MAX_RESTARTS": "5",
                                         "PET_RDZV_BACKEND": "c10d",
                                         "PET_RDZV_CONF": "last_call_timeout=7,timeout=900"})
    assert tr is not None and tr.elastic and tr.max_restarts == 5
    cmd, notes = elastic.elastic_command(tr, environ={})
    assert cmd[:1] == ["torchrun"] and cmd[-1] == "train.py"
    assert "--max-restarts=15" in cmd
    # The user's last_call_timeout is kept; the other settings too.
    assert "--rdzv-conf=last_call_timeout=7,timeout=900" in cmd


def test_elastic_command_replaces_max_restarts_and_adds_a_short_last_call() -> None:
    argv = ["torchrun", "--nnodes=1:2", "--max_restarts=3", "--rdzv-conf", "timeout=900",
            "train.py", "--lr", "1"]
    tr = elastic.parse_torchrun(argv, environ={})
    cmd, notes = elastic.elastic_command(tr, environ={"SPOTGUARD_PREEMPTION_RESTARTS": "4"})
    assert cmd == ["torchrun", "--max-restarts=7",
                   f"--rdzv-conf=timeout=900,last_call_timeout={elastic.LAST_CALL_S}",
                   "--nnodes=1:2", "train.py", "--lr", "1"]
    assert any("yours 3 + 4 for preemptions" in n for n in notes)
    env, notes = elastic.elastic_environ({})
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    env, notes = elastic.elastic_environ({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0" and not notes


def test_leave_without_torch_or_c10d_says_what_happens_and_never_raises() -> None:
    tr = elastic.parse_torchrun(["torchrun", "--nnodes=1:2", "--rdzv-backend=etcd-v2", "t.py"],
                                environ={})
    ok, what = elastic.leave_rendezvous(tr, [os.getpid()])
    assert ok and "heartbeat expiry" in what
    tr = elastic.parse_torchrun(["torchrun", "--nnodes=1:2", "--rdzv-backend=c10d",
                                 "--rdzv-endpoint=127.0.0.1:1", "t.py"], environ={})
    ok, what = elastic.leave_rendezvous(tr, [os.getpid()], timeout=1.0)
    assert not ok and "heartbeats expire" in what


FAKE_TORCHRUN = """#!/usr/bin/env python3
import os, signal, sys, time, pathlib
d = pathlib.Path(os.environ["FAKE_TORCHRUN_DIR"])
def term(signum, frame):
    (d / "sigterm").write_text(str(time.monotonic()))
    sys.exit(1)
signal.signal(signal.SIGTERM, term)
(d / "ready").write_text(str(os.getpid()))
time.sleep(60)
sys.exit(3)
"""


def test_the_launcher_removes_the_rendezvous_entry_before_it_stops_torchrun(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the notice the node's entry leaves the c10d rendezvous first and torchrun gets its
    SIGTERM after: a round the other nodes form in between cannot count the leaving node."""
    guard = tmp_path / "guard"
    guard.mkdir()
    torchrun = tmp_path / "torchrun"
    torchrun.write_text(FAKE_TORCHRUN)
    torchrun.chmod(0o755)
    monkeypatch.setenv("SPOTGUARD_DIR", str(guard))
    monkeypatch.setenv("FAKE_TORCHRUN_DIR", str(tmp_path))
    calls: List[bool] = []  # per removal: had torchrun already had its SIGTERM?

    def leave(tr: elastic.Torchrun, pids: object, timeout: float = 10.0) -> tuple:
        calls.append((tmp_path / "sigterm").exists())
        return True, "removed (test)"

    monkeypatch.setattr(elastic, "leave_rendezvous", leave)
    argv = [str(torchrun), "--nnodes=1:2", "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:1", "t.py"]
    tr = elastic.parse_torchrun(argv)
    assert tr is not None and tr.elastic

    def notice() -> None:
        wait_for("the fake torchrun", lambda: (tmp_path / "ready").exists())
        (guard / "notice.json").write_text(json.dumps(
            {"notice_id": "n-1", "source": "gce", "kind": "preempted",
             "deadline_unix": time.time() + 30}))

    import threading
    writer = threading.Thread(target=notice, daemon=True)
    writer.start()
    rc = elastic.run(argv, tr, [signal.SIGTERM, signal.SIGINT])
    writer.join()
    assert (tmp_path / "sigterm").exists(), "torchrun was not stopped"
    assert rc == 1
    assert calls == [False], f"removals (True: after torchrun's SIGTERM): {calls}"


# ---------------------------------------------------------------------------------------------
# Two stand-in elastic nodes under the launcher
# ---------------------------------------------------------------------------------------------

def _node(tmp_path: Path, n: int, launcher: bool, max_restarts: int = 1,
          conf: str = "") -> subprocess.Popen:
    guard = tmp_path / f"node{n}"
    guard.mkdir(exist_ok=True)
    env = dict(os.environ, SPOTGUARD_DIR=str(guard), SPOTGUARD_PROGRESS="0.2")
    if FROM_SOURCE:
        env["PYTHONPATH"] = str(CLIENT_DIR)
    cmd = [sys.executable, str(STANDIN / "torchrun"), "--nnodes", "1:2", "--nproc-per-node", "2",
           "--max-restarts", str(max_restarts), "--rdzv-backend", "standin",
           "--rdzv-endpoint", str(tmp_path / "rdzv"), "--rdzv-id", "job"]
    if conf:
        cmd += ["--rdzv-conf", conf]
    cmd += [str(STANDIN / "worker.py"), "--ckpt-dir", str(tmp_path / "ck"), "--step-time", "0.03"]
    if launcher:
        cmd = [sys.executable, "-m", "spotguard", "launch", "--"] + cmd
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _resumes(guard: Path) -> List[Dict]:
    out = [read_json(p) for p in guard.glob("resume-*.json")]
    return sorted((r for r in out if r), key=lambda r: r["ts"])


def _notice(guard: Path) -> None:
    """What the agent does on the preempted node: notice.json, then SIGUSR1 to the workers (the
    processes whose resume record is there)."""
    body = {"notice_id": "n-1", "source": "gce", "kind": "preempted",
            "deadline_unix": time.time() + 30, "checkpoint_deadline_unix": time.time() + 20}
    (guard / "notice.json").write_text(json.dumps(body))
    for r in guard.glob("resume-*.json"):
        try:
            os.kill(int(r.stem.split("-")[1]), signal.SIGUSR1)
        except ProcessLookupError:
            pass


def _stop(tmp_path: Path, *procs: subprocess.Popen) -> str:
    """SIGTERM each node (the stand-in agent stops its workers, which run in sessions of their
    own, as torch's do: the node's process group does not hold them), SIGKILL what is left. A
    worker that outlives its agent fails the test (and is killed): it would keep the node's
    output pipe, and the job's GPUs, forever."""
    out = []
    left: Dict[int, str] = {}
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            out.append(p.communicate(timeout=20)[0])
        except subprocess.TimeoutExpired:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            left.update(kill_strays(str(tmp_path)))
            out.append(reap(p)[0])
    left.update(kill_strays(str(tmp_path)))
    if left:
        pytest.fail("workers outlived their agent:\n" + "\n".join(left.values())
                    + "\n" + "\n".join(out))
    return "\n".join(out)


def test_the_preempted_node_leaves_and_the_other_resumes_from_the_saved_step(tmp_path: Path) -> None:
    a = _node(tmp_path, 1, launcher=True)
    b = None
    try:
        wait_for("node 1 to train", lambda: _resumes(tmp_path / "node1"))
        b = _node(tmp_path, 2, launcher=True)
        # Both nodes in one world of 4 ranks (node 1 restarts its workers for node 2).
        wait_for("node 2 to train", lambda: any(r["world_size"] == 4
                                                for r in _resumes(tmp_path / "node2")))
        time.sleep(0.5)
        noticed = time.time()
        _notice(tmp_path / "node2")
        rc = b.wait(timeout=30)
        assert rc == 143  # the launcher: torchrun failed after this run's checkpoint
        done = [read_json(p) for p in (tmp_path / "node2").glob("ack-*.json")]
        steps = {d["step"] for d in done if d and d["state"] == "done" and d["ts"] >= noticed}
        assert len(steps) == 1, done
        saved = steps.pop()
        # Node 2's agent did not restart its workers: no resume record after the notice.
        assert not [r for r in _resumes(tmp_path / "node2") if r["ts"] > noticed]
        # Node 1 re-formed alone and resumed from exactly the saved step.
        after = wait_for("node 1 to resume", lambda: [r for r in _resumes(tmp_path / "node1")
                                                      if r["ts"] > noticed])
        assert {r["step"] for r in after} == {saved}
        assert {r["world_size"] for r in after} == {2}
        assert a.poll() is None
    finally:
        out = _stop(tmp_path, a, *([b] if b else []))
    assert "stopping torchrun so that this node leaves" in out, out
    assert "--max-restarts=11 (yours 1 + 10 for preemptions)" in out, out


def test_without_the_launcher_the_preempted_nodes_agent_restarts_its_workers(tmp_path: Path) -> None:
    """The stand-in reproduces what the launcher prevents: torchrun's agent restarts the workers
    that exited 143 after the checkpoint and rejoins the job it should leave."""
    a = _node(tmp_path, 1, launcher=False, max_restarts=3, conf="last_call_timeout=1")
    b = None
    try:
        wait_for("node 1 to train", lambda: _resumes(tmp_path / "node1"))
        b = _node(tmp_path, 2, launcher=False, max_restarts=3, conf="last_call_timeout=1")
        wait_for("node 2 to train", lambda: any(r["world_size"] == 4
                                                for r in _resumes(tmp_path / "node2")))
        noticed = time.time()
        _notice(tmp_path / "node2")
        again = wait_for("node 2's workers to restart",
                         lambda: [r for r in _resumes(tmp_path / "node2") if r["ts"] > noticed])
        assert {r["world_size"] for r in again} == {4}  # it rejoined at the full size
    finally:
        _stop(tmp_path, a, *([b] if b else []))


# ---------------------------------------------------------------------------------------------
# The helper: SIGTERM before training, resume records
# ---------------------------------------------------------------------------------------------

BEFORE_TRAINING = """
import ctypes, os, sys, time, pathlib
import spotguard

d = pathlib.Path(os.environ["SPOTGUARD_DIR"])
spotguard.install()
(d / "ready").write_text(str(os.getpid()))
if sys.argv[1] == "python":
    time.sleep(30)          # start-up in Python (imports, data): the handler runs
else:
    # Blocked in C like a rendezvous or a gloo connect: glibc's system() waits for its child
    # and retries on EINTR, so Python cannot run the handler until it returns.
    ctypes.CDLL(None).system(b"sleep 6")
print("still here", flush=True)
sys.exit(0)
"""


@pytest.mark.parametrize("where", ["python", "blocked-in-c"])
def test_sigterm_before_training_exits_at_once_with_a_skipped_ack(guard_dir: Path, spawn,
                                                                  where: str) -> None:
    guard_dir.mkdir()
    child = spawn(BEFORE_TRAINING, guard_dir, args=(where,))
    wait_for("the child to install the helper", lambda: (guard_dir / "ready").exists())
    sent = time.monotonic()
    child.kill(signal.SIGTERM)
    child.proc.wait(timeout=20)
    took = time.monotonic() - sent
    # (The output pipes stay open until system()'s orphaned `sleep` ends.)
    rc, out, err = child.wait(timeout=20)
    assert rc == spotguard.EXIT_CODE, (out, err)
    assert took < 3.0, f"took {took:.1f}s"
    assert "still here" not in out
    assert "SIGTERM before training started" in err
    ack = read_json(guard_dir / f"ack-{child.pid}.json")
    assert ack is not None and ack["state"] == "skipped" and ack["step"] is None


def test_sigusr1_before_training_is_kept_for_the_first_step(guard_dir: Path, spawn) -> None:
    guard_dir.mkdir()
    child = spawn("""
import os, sys, time, pathlib, signal
import spotguard
d = pathlib.Path(os.environ["SPOTGUARD_DIR"])
spotguard.install()
os.kill(os.getpid(), signal.SIGUSR1)   # the notice came during start-up
time.sleep(0.2)
spotguard.resumed(7)
print(spotguard.should_checkpoint(), flush=True)
""", guard_dir)
    rc, out, err = child.wait()
    assert rc == 0 and out.strip() == "True", err


def test_resumed_writes_the_record_and_progress_under_the_drill(guard_dir: Path, spawn) -> None:
    guard_dir.mkdir()
    child = spawn("""
import os, json, time, pathlib
import spotguard
spotguard.install()
p = spotguard.resumed(40)
first = json.loads(p.read_text())
for _ in range(6):
    spotguard.should_checkpoint()
    time.sleep(0.06)
print(json.dumps({"first": first, "last": json.loads(p.read_text()), "name": p.name}))
""", guard_dir, env={"SPOTGUARD_PROGRESS": "0.05", "RANK": "3", "WORLD_SIZE": "8"})
    rc, out, err = child.wait()
    assert rc == 0, err
    got = json.loads(out)
    assert got["name"] == f"resume-{child.pid}.json"
    assert got["first"]["step"] == 40 and got["first"]["last_step"] == 40
    assert got["first"]["rank"] == 3 and got["first"]["world_size"] == 8
    assert 43 <= got["last"]["last_step"] <= 46
    assert got["last"]["ts"] == got["first"]["ts"]


def test_resumed_rejects_a_non_integer_step(guard_dir: Path) -> None:
    for bad in (True, "3", 1.5):
        with pytest.raises(ValueError):
            spotguard.resumed(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Horovod elastic
# ---------------------------------------------------------------------------------------------

def test_discovery_drops_hosts_marked_leaving(tmp_path: Path, guard_dir: Path, spawn) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("# pool\nnode-a:4\nnode-b:4\nnode-c\n")
    leaving = tmp_path / "leaving"
    guard_dir.mkdir()
    marker = spawn("""
import spotguard.horovod as sgh, sys
print(sgh.leave(sys.argv[1]))
""", guard_dir, args=(str(leaving),), env={"HOROVOD_HOSTNAME": "node-b"})
    rc, out, err = marker.wait()
    assert rc == 0 and Path(out.strip()) == leaving / "node-b", err
    assert json.loads((leaving / "node-b").read_text())["host"] == "node-b"
    script = "import sys, spotguard; sys.exit(spotguard.main())"
    rc, out, err = spawn(script, guard_dir, name="hosts.py",
                         args=("horovod-hosts", "--hosts", str(hosts), "--leaving",
                               str(leaving))).wait()
    assert rc == 0 and out.split() == ["node-a:4", "node-c:1"], err
    # An old marker (a host of that name came back) no longer drops it.
    old = time.time() - horovod.FORGET_AFTER_S - 5
    os.utime(leaving / "node-b", (old, old))
    assert horovod.available_hosts(horovod.read_hosts(hosts), leaving) == [
        ("node-a", 4), ("node-b", 4), ("node-c", 1)]
    with pytest.raises(ValueError):
        horovod.leave(leaving, host="../etc")


FAKE_HOROVOD = """
import json, os, sys, types, pathlib, signal
import spotguard

# Just enough of torch and horovod.torch for the agreement: the all-reduce takes the MAX over
# "ranks" (this process and a pretend peer whose flag comes from argv).
torch = types.ModuleType("torch")
class T:
    def __init__(self, v): self.v = list(v)
    def item(self): return self.v[0]
torch.tensor = lambda v, dtype=None: T(v)
torch.int32 = "int32"
hvd = types.ModuleType("horovod.torch")
hvd.Max = "max"
hvd.is_initialized = lambda: True
hvd.rank = lambda: int(sys.argv[2])
peer = int(sys.argv[1])
hvd.allreduce = lambda t, op, name: T([max(t.v[0], peer)])
sys.modules["torch"], sys.modules["horovod.torch"] = torch, hvd
import spotguard.horovod as sgh

class HostsUpdatedInterrupt(Exception):
    pass

class State:
    commits = 0
    checks = 0
    def commit(self): State.commits += 1
    def check_host_updates(self):
        State.checks += 1
        if State.checks == 2:          # the driver dropped the host: every rank, same step
            raise HostsUpdatedInterrupt()

spotguard.install()
d = pathlib.Path(os.environ["SPOTGUARD_DIR"])
if sys.argv[3] == "signalled":
    os.kill(os.getpid(), signal.SIGUSR1)
state = State()
agreed = sgh.should_checkpoint(state)
out = {"agreed": agreed}
if agreed:
    sgh.checkpoint(state, d / "leaving", save=lambda s: "/ckpt/12", step=12)
    peer = 0
    out["after"] = sgh.should_checkpoint(state)   # trains on; checks for the host update
    try:
        sgh.should_checkpoint(state)
    except HostsUpdatedInterrupt:
        out["interrupted"] = True
    sgh.should_checkpoint(state)                  # after the reset: no more checks
out.update(commits=State.commits, checks=State.checks, requested=spotguard.requested())
print(json.dumps(out), flush=True)
"""


@pytest.mark.parametrize("case", ["peer-signalled", "signalled", "nobody"])
def test_horovod_agreement_commits_everywhere_and_only_the_signalled_host_leaves(
        guard_dir: Path, spawn, case: str) -> None:
    guard_dir.mkdir()
    peer = "1" if case == "peer-signalled" else "0"
    child = spawn(FAKE_HOROVOD, guard_dir, args=(peer, "0", case),
                  env={"HOROVOD_HOSTNAME": "node-x"})
    rc, out, err = child.wait()
    assert rc == 0, err
    got = json.loads(out)
    ack = read_json(guard_dir / f"ack-{child.pid}.json")
    if case == "nobody":
        assert got == {"agreed": False, "commits": 0, "checks": 0, "requested": False}
        return
    # Every rank: committed at the agreed step, acked done (rank 0 saved), trains on, and raises
    # the driver's HostsUpdatedInterrupt when it comes, then stops checking.
    assert got == {"agreed": True, "after": False, "interrupted": True, "commits": 1,
                   "checks": 2, "requested": False}
    assert ack is not None and ack["state"] == "done" and ack["step"] == 12
    assert ack["checkpoint"] == "/ckpt/12"
    # Only the preempted host (its ranks were signalled) is marked leaving.
    assert (guard_dir / "leaving" / "node-x").exists() == (case == "signalled")


def test_a_second_resume_in_the_same_process_keeps_the_first_record(guard_dir: Path, spawn) -> None:
    """Horovod elastic resets in-process: each resume gets its own record, so the drill still
    sees how far the process got before the reset."""
    guard_dir.mkdir()
    child = spawn("""
import json, spotguard
spotguard.install()
a = spotguard.resumed(0)
b = spotguard.resumed(25)
print(json.dumps([a.name, b.name]))
""", guard_dir)
    rc, out, err = child.wait()
    assert rc == 0, err
    assert json.loads(out) == [f"resume-{child.pid}.json", f"resume-{child.pid}-2.json"]
    assert read_json(guard_dir / f"resume-{child.pid}.json")["step"] == 0
    assert read_json(guard_dir / f"resume-{child.pid}-2.json")["step"] == 25
