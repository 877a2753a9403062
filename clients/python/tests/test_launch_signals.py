"""The launcher never loses a SIGTERM (issue 29 item 7): the relayed signals are blocked before the
child starts and unblocked once the relay handlers are installed, so a SIGTERM that arrives while
the child starts is relayed to it; the child itself starts with nothing blocked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from conftest import CLIENT_DIR, FROM_SOURCE, kill_strays

# The child signals its parent (the launcher) first thing (once its sleep is started: the sleep
# never outlives it), then waits for the relayed SIGTERM.
# It records its blocked mask, and whether the SIGTERM reached it.
CHILD = r"""
out="$1"
sleep 30 </dev/null >/dev/null 2>&1 & S=$!
trap 'echo term >> "$out"; kill $S; exit 143' TERM
while read -r k v; do [ "$k" = SigBlk: ] && echo "$k $v" > "$out.blk"; done < /proc/$$/status
kill -TERM $PPID
wait $S
echo no-term >> "$out"
"""

TRIES = 20


def _launcher(tmp_path: Path, cmd: List[str]) -> subprocess.Popen:
    env = dict(os.environ, SPOTGUARD_DIR=str(tmp_path / "guard"))
    if FROM_SOURCE:
        env["PYTHONPATH"] = str(CLIENT_DIR)
    return subprocess.Popen([sys.executable, "-m", "spotguard", "launch", "--"] + cmd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("elastic", [False, True], ids=["plain", "elastic"])
def test_a_sigterm_while_the_child_starts_is_relayed(tmp_path: Path, elastic: bool) -> None:
    (tmp_path / "guard").mkdir()
    if elastic:
        torchrun = tmp_path / "torchrun"  # the launcher takes it for torchrun: the elastic path
        torchrun.write_text("#!/bin/sh\n" + CHILD.replace('out="$1"', 'out="$(dirname "$0")/out"'))
        torchrun.chmod(0o755)
        cmd = [str(torchrun), "--nnodes", "1:2", "--rdzv-backend", "static", "train.py"]
    else:
        cmd = ["sh", "-c", CHILD, "sh", str(tmp_path / "out")]
    try:
        for i in range(TRIES):
            out = tmp_path / "out"
            for p in (out, tmp_path / "out.blk"):
                p.unlink(missing_ok=True)
            launcher = _launcher(tmp_path, cmd)
            try:
                _, err = launcher.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                launcher.kill()
                pytest.fail(f"try {i}: the launcher did not exit")
            assert launcher.returncode == 143, (
                f"try {i}: launcher exit {launcher.returncode} (killed by its SIGTERM?); "
                f"child: {out.read_text() if out.exists() else 'nothing'}; stderr: {err}")
            assert out.read_text() == "term\n", f"try {i}: the child never got the SIGTERM"
            blocked = int((tmp_path / "out.blk").read_text().split()[1], 16)
            assert not blocked & (1 << (signal.SIGTERM - 1)), f"try {i}: the child started with SIGTERM blocked"
            assert not kill_strays(str(tmp_path)), f"try {i}: a stray child"
    finally:
        kill_strays(str(tmp_path))
