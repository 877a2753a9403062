"""Shared helpers for the helper's tests: real child processes, real signals, real files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Dict, Optional, TypeVar

import pytest

CLIENT_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = CLIENT_DIR.parent.parent
# scripts/test.sh runs these tests against the installed wheel (a fresh venv): the package and the
# `spotguard` binary come from there. SPOTGUARD_TEST_SOURCE=1 tests the checkout instead (quick
# iteration on the helper; the tests that need the binary then skip).
FROM_SOURCE = os.environ.get("SPOTGUARD_TEST_SOURCE") == "1"
if FROM_SOURCE:
    sys.path.insert(0, str(CLIENT_DIR))

# Generous: the machine running the tests may be heavily loaded.
WAIT_S = 60.0

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], Optional[T]], timeout: float = WAIT_S) -> T:
    """Poll ``probe`` until it returns something other than None/False; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.01)


def reap(proc: subprocess.Popen, timeout: float = 10.0) -> tuple:
    """Kill ``proc`` and read its output, bounded: a descendant that outlived it and still holds
    its pipes (a worker in a session of its own) fails the test instead of hanging it."""
    proc.kill()
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.wait()
        pytest.fail(f"pid {proc.pid} exited but a descendant still holds its output pipes")


def kill_strays(marker: str) -> Dict[int, str]:
    """SIGKILL the processes whose command line mentions ``marker`` (a test's tmp_path): what a
    test left running. Returns their command lines by pid."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            if marker.encode() in cmd:
                os.kill(int(entry), signal.SIGKILL)
                found[int(entry)] = cmd.decode(errors="replace").strip()
        except OSError:
            continue
    return found


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sig_caught(pid: int, signum: int) -> bool:
    """What spotguard's `handlers` mode checks: the signal's bit in SigCgt and not in SigIgn."""
    fields: Dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("SigCgt", "SigIgn"):
                fields[key] = int(value.strip(), 16)
    bit = 1 << (signum - 1)
    return bool(fields["SigCgt"] & bit) and not fields["SigIgn"] & bit


class Child:
    """A Python child running ``script`` with the helper importable and SPOTGUARD_DIR set."""

    def __init__(self, tmp_path: Path, script: str, guard_dir: Path, env: Optional[dict] = None,
                 python: str = sys.executable, name: str = "child.py", args: tuple = ()):
        self.path = tmp_path / name
        self.path.write_text(textwrap.dedent(script))
        full_env = dict(os.environ)
        if FROM_SOURCE:
            full_env["PYTHONPATH"] = str(CLIENT_DIR)
        full_env["SPOTGUARD_DIR"] = str(guard_dir)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [python, "-u", str(self.path), *args],
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid

    def kill(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def wait(self, timeout: float = WAIT_S) -> tuple:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = reap(self.proc)
            pytest.fail(f"child did not exit within {timeout:.0f}s\nstdout:\n{out}\nstderr:\n{err}")
        return self.proc.returncode, out, err

    def close(self) -> None:
        if self.proc.poll() is None:
            reap(self.proc)


@pytest.fixture
def guard_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh SPOTGUARD_DIR for this test (env and the helper's module state)."""
    import spotguard

    d = tmp_path / "guard"
    monkeypatch.setenv("SPOTGUARD_DIR", str(d))
    monkeypatch.setattr(spotguard, "_dir", None)
    return d


@pytest.fixture
def spawn(tmp_path: Path):
    children = []

    def make(script: str, guard_dir: Path, **kw) -> Child:
        c = Child(tmp_path, script, guard_dir, **kw)
        children.append(c)
        return c

    yield make
    for c in children:
        c.close()

