"""Training-side helper for spotguard's checkpoint protocol v1.

Standard library only, importable without torch. ``pip install spotguard`` installs it together
with the ``spotguard`` binary (the agent and ``spotguard drill``); from a checkout, put
``clients/python`` on ``PYTHONPATH``. Framework glue lives in optional modules that import their
framework only when imported themselves: :mod:`spotguard.lightning` (a Lightning callback) and
:mod:`spotguard.hf` (a Hugging Face ``TrainerCallback``).

spotguard (the node agent) writes ``<SPOTGUARD_DIR>/notice.json`` and then sends a signal
(``SIGUSR1`` by default) to every process that *catches* it. This module:

* :func:`install` catches the signal (and ``SIGTERM``), sets a flag and writes the ``received``
  acknowledgement at once. Nothing else happens inside the handler.
* :func:`should_checkpoint` is polled by the training loop at a step boundary. Under
  ``torch.distributed`` it is a collective (all-reduce MAX of the flag) so that every rank agrees
  on the same step.
* :func:`ack` writes ``done`` / ``skipped`` / ``failed`` with the step and checkpoint path.
* :func:`exit_after_checkpoint` exits with 143 so Kubeflow's ``ExitCode`` restart policy and a
  Job ``podFailurePolicy`` treat the exit as retryable.

Minimal loop::

    import spotguard

    spotguard.install()
    for step in range(start, total):
        train_one_step()
        if spotguard.should_checkpoint():
            path = save_checkpoint(step)
            spotguard.ack("done", step=step, checkpoint=path)
            spotguard.exit_after_checkpoint()

Files (all written atomically: temp file in the same directory, fsync, rename, fsync of the dir):

* ``<dir>/ack-<pid>.json``: ``{"state", "step", "checkpoint", "ts"}``, one per process, ``pid``
  as the process sees it (``os.getpid()``), ``ts`` in Unix seconds (float).
* ``<dir>/ack``: a container-wide acknowledgement (:func:`ack_container`).
* ``<dir>/progress-<pid>.json``: the progress record (:func:`progress_path`, :func:`saved`): the
  last step and its time, the last durable step and since when its work is at risk; the agent
  reads it for a process that exits without acking, to count the work thrown away.

``<dir>`` is the ``dir`` given to :func:`install`, else ``$SPOTGUARD_DIR``, else
``/tmp/spotguard`` (the default of the pod annotation ``spotguard.io/checkpoint-dir``; the host
agent's ``--checkpoint-dir`` defaults to ``/run/spotguard``, so on a VM set ``SPOTGUARD_DIR``:
:func:`install` warns when it is unset). Protocol reference: ``docs/checkpoint-protocol.md``.

Launchers: ``torchrun`` exits 1 when a worker exits 143, which Kubeflow and a Job
``podFailurePolicy`` read as a permanent failure. Run it through :func:`launch` to get 143 back::

    python3 -m spotguard launch -- torchrun --nproc-per-node 8 train.py
"""

from __future__ import annotations

import itertools
import json
import operator
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

__all__ = [
    "ACK_STATES",
    "AGREEMENT_PATHS",
    "PROTOCOL_VERSION",
    "__version__",
    "DEFAULT_DIR",
    "EXIT_CODE",
    "MAX_ACK_BYTES",
    "Notice",
    "ack",
    "ack_container",
    "ack_path",
    "clear",
    "prepare_dir",
    "checkpoint_dir",
    "exit_after_checkpoint",
    "handler_error",
    "install",
    "installed_signals",
    "launch",
    "notice",
    "progress_path",
    "received_at",
    "received_signal",
    "requested",
    "resume_path",
    "resumed",
    "saved",
    "should_checkpoint",
    "sidecar_path",
    "time_left",
    "uninstall",
    # Staged checkpoints (spotguard.staged).
    "LatestCheckpoint",
    "StagedAnswer",
    "ack_staged",
    "latest_checkpoint",
]

#: The checkpoint protocol this helper speaks (docs/checkpoint-protocol.md, "v1"). The package
#: version is the spotguard release (the crate's version, shared with the bundled binary); a
#: release that changes the protocol bumps its minor version while < 1.0 (its major version after)
#: and this number, so ``pip install 'spotguard>=0.1,<0.2'`` pins protocol 1.
PROTOCOL_VERSION = 1

#: The spotguard release this helper belongs to (the same as ``spotguard --version``).
__version__ = "0.1.0"

#: Where acks and the notice live when neither ``install(dir=…)`` nor ``$SPOTGUARD_DIR`` is set.
DEFAULT_DIR = "/tmp/spotguard"

#: The states an ack may carry. ``received`` is written by the signal handler; the other three
#: are terminal and written by the training code.
ACK_STATES = ("received", "done", "skipped", "failed")

#: The agent refuses ack and notice files larger than this (bytes).
MAX_ACK_BYTES = 64 * 1024

#: 128 + SIGTERM: what a process killed by SIGTERM reports, and what Kubeflow's ``ExitCode``
#: restart policy (128–255 = retryable) and a Job ``podFailurePolicy`` rule can match on.
EXIT_CODE = 143

_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, signal.Handlers, None]

# Module state. The signal handler only ever assigns to these (no locks: a Python signal handler
# runs in the main thread between bytecodes, and taking a lock the interrupted code holds would
# deadlock).
_requested = False
_signum: Optional[int] = None
_received_at: Optional[float] = None
_agreed = False
_calls = 0
_dir: Optional[str] = None
_previous: Dict[int, _Handler] = {}
_chain = True
_owner_pid: Optional[int] = None
_handler_error: Optional[BaseException] = None
_tmp_counter = itertools.count()
# Fallback names (checkpoint-protocol.md, section 4): a suffix of this process's own choosing,
# random so nobody can take the name first, used when another user's file holds an ack name in a
# sticky directory. Paths that needed it keep using it (the agent reads every name).
_fallback_suffix = os.urandom(8).hex()
_fallback_for: Dict[str, str] = {}
_fork_hook_registered = False
_installed_at: Optional[float] = None
# Training has started: resumed(), should_checkpoint() or requested() was called. Until then a
# SIGTERM ends the process at once (there is nothing to save yet, and a process still in rendezvous
# or in a gloo connect must not stall its launcher's restart).
_training = False
_watchdog: Optional["_SigtermWatchdog"] = None
# The resume record (resumed()): the step training resumed from and the polls since.
_resume: Optional[Dict[str, Any]] = None
_polls = 0
_resumes = 0
_progress_every: Optional[float] = None
_progress_written = 0.0
# The progress record (progress-<pid>.json): the last step seen by should_checkpoint() (its
# ``step=`` or the resume step plus the calls since), when (monotonic), the last durable step and
# when (wall clock), and when the next refresh is due (monotonic).
_step: Optional[int] = None
_step_mono = 0.0
_durable: Optional[Tuple[int, float, Optional[str]]] = None
_record_due = 0.0
_record_written_step: Optional[int] = None
# The first should_checkpoint() after resumed() stamps ``first_step_ts`` into the resume record.
_first_step_due = False


@dataclass(frozen=True)
class Notice:
    """The parsed ``notice.json`` written by the agent before it signals."""

    notice_id: str
    source: str
    kind: str
    deadline_unix: Optional[float]
    checkpoint_deadline_unix: Optional[float]
    signal: Optional[str]
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Notice":
        """Build from the decoded JSON object. Unknown keys are kept in ``raw`` only."""

        def number(key: str) -> Optional[float]:
            value = data.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"notice.json: {key} must be a number, got {value!r}")
            return float(value)

        def text(key: str) -> Optional[str]:
            value = data.get(key)
            return None if value is None else str(value)

        return cls(
            notice_id=text("notice_id") or "",
            source=text("source") or "",
            kind=text("kind") or "",
            deadline_unix=number("deadline_unix"),
            checkpoint_deadline_unix=number("checkpoint_deadline_unix"),
            signal=text("signal"),
            raw=dict(data),
        )

    def time_left(self, now: Optional[float] = None, *, until: str = "checkpoint") -> float:
        """Seconds until the checkpoint deadline (``until="checkpoint"``, the default) or the
        instance deadline (``until="deadline"``), never negative. A missing deadline means "now"
        (0.0); the checkpoint deadline falls back to the instance deadline when absent."""
        if until not in ("checkpoint", "deadline"):
            raise ValueError(f"until must be 'checkpoint' or 'deadline', got {until!r}")
        now = time.time() if now is None else now
        target = self.deadline_unix
        if until == "checkpoint" and self.checkpoint_deadline_unix is not None:
            target = self.checkpoint_deadline_unix
        if target is None:
            return 0.0
        return max(0.0, target - now)


def checkpoint_dir() -> Path:
    """The directory for the notice and acks: ``install(dir=…)``, else ``$SPOTGUARD_DIR``, else
    ``/tmp/spotguard``."""
    if _dir is not None:
        return Path(_dir)
    return Path(os.environ.get("SPOTGUARD_DIR") or DEFAULT_DIR)


def ack_path(pid: Optional[int] = None) -> Path:
    """``<dir>/ack-<pid>.json`` for this process (or ``pid``)."""
    return checkpoint_dir() / f"ack-{os.getpid() if pid is None else pid}.json"


def _fallback_name(name: str) -> Optional[str]:
    """The fallback name of an ack file (``ack-<pid>.<suffix>.json``, ``ack.<suffix>``), or None
    for a file that is not an ack."""
    if name == "ack":
        return f"ack.{_fallback_suffix}"
    if name.startswith("ack-") and name.endswith(".json") and name[4:-5].isdigit():
        return f"{name[:-5]}.{_fallback_suffix}.json"
    return None


def _write_atomic(path: Path, data: bytes) -> Path:
    """Temp file in the same directory (a dot-name that never matches ``ack-*.json``), fsync,
    rename over ``path``, fsync the directory. Only ``os`` calls: safe from a signal handler.

    An ack whose name another user's file holds in a sticky directory (the rename is refused with
    EPERM/EACCES) is written under its fallback name instead, and so is every later write of it.
    Returns the path written."""
    target = _fallback_for.get(str(path), str(path))
    directory = str(path.parent)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{path.name}.tmp-{os.getpid()}-{next(_tmp_counter)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(tmp, target)
        except PermissionError:
            fallback = _fallback_name(path.name)
            if fallback is None or target != str(path):
                raise
            target = os.path.join(directory, fallback)
            os.replace(tmp, target)
            _fallback_for[str(path)] = target
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return Path(target)
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
    return Path(target)


def _ack_bytes(
    state: str, step: Optional[int], checkpoint: Optional[str], notice_id: Optional[str] = None
) -> bytes:
    body: Dict[str, Any] = {"state": state, "step": step, "checkpoint": checkpoint, "ts": time.time()}
    if notice_id:
        # Optional and informational for the agent (it reads state/step/checkpoint/ts); it lets
        # :func:`launch` tell this notice's acks from an earlier run's in the same directory.
        body["notice_id"] = notice_id
    return json.dumps(body, separators=(",", ":")).encode()


def _current_notice_id() -> Optional[str]:
    n = notice()
    return n.notice_id or None if n is not None else None



def _as_step(step: Any, expected: str) -> int:
    """``step`` as an int (numpy / 0-d integer tensor steps too, never a bool); ``ValueError``
    naming ``expected`` otherwise."""
    if isinstance(step, bool):
        raise ValueError(f"step must be {expected}, got {step!r}")
    try:
        return operator.index(step)
    except TypeError:
        raise ValueError(f"step must be {expected}, got {step!r}") from None

def ack(
    state: str,
    step: Optional[int] = None,
    checkpoint: Union[str, "os.PathLike[str]", None] = None,
) -> Path:
    """Write this process's acknowledgement ``<dir>/ack-<pid>.json`` atomically.

    A terminal ack also carries ``notice_id`` when a ``notice.json`` newer than :func:`install`
    is present (the agent ignores it; :func:`launch` uses it to match acks to its own run).

    ``state`` is one of ``received``, ``done`` (checkpoint saved), ``skipped`` (the save could not
    fit the deadline) or ``failed``. ``step`` and ``checkpoint`` (a path, as the process sees it)
    are reported by the agent in logs and Events. Returns the path written; raises ``ValueError``
    for a bad state and ``OSError`` when the file cannot be written.
    """
    if state not in ACK_STATES:
        raise ValueError(f"ack state must be one of {', '.join(ACK_STATES)}; got {state!r}")
    if step is not None:
        step = _as_step(step, "an int or None")
    where = None if checkpoint is None else os.fspath(checkpoint)
    data = _ack_bytes(state, step, where, _current_notice_id() if state != "received" else None)
    if len(data) > MAX_ACK_BYTES:
        raise ValueError(f"ack is {len(data)} bytes; the agent reads at most {MAX_ACK_BYTES}")
    written = _write_atomic(ack_path(), data)
    if state == "done" and step is not None:
        _mark_durable(step, where)
        _write_sidecar(step, where)
    return written


def ack_container(
    step: Optional[int] = None,
    checkpoint: Union[str, "os.PathLike[str]", None] = None,
) -> Path:
    """Write the plain ``<dir>/ack`` file: it acknowledges the whole container at once (for
    launchers where one process saves on behalf of all). Content is informational JSON."""
    where = None if checkpoint is None else os.fspath(checkpoint)
    written = _write_atomic(checkpoint_dir() / "ack", _ack_bytes("done", step, where, _current_notice_id()))
    if step is not None:
        _mark_durable(step, where)
        _write_sidecar(step, where)
    return written


#: How often (seconds) :func:`should_checkpoint` refreshes the resume record's ``last_step`` when
#: ``$SPOTGUARD_PROGRESS`` is set (``spotguard drill --elastic`` sets it; unset, never).
PROGRESS_ENV = "SPOTGUARD_PROGRESS"


def _progress_interval() -> Optional[float]:
    raw = os.environ.get(PROGRESS_ENV)
    if not raw:
        return None
    try:
        every = float(raw)
    except ValueError:
        return None
    return every if every > 0 else None


def _world() -> Tuple[Optional[int], Optional[int]]:
    """(rank, world size): from an initialised ``torch.distributed`` or Horovod, else torchrun's
    / Horovod's environment, else ``(None, None)``."""
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None:
        try:
            if hvd.is_initialized():
                return int(hvd.rank()), int(hvd.size())
        except Exception:  # not initialised, or torn down by a reset: the other sources
            pass
    dist = _distributed()
    if dist is not None:
        try:
            return int(dist.get_rank()), int(dist.get_world_size())
        except Exception:  # a group torn down under us: fall back to the environment
            pass
    for rank_key, size_key in (("RANK", "WORLD_SIZE"), ("HOROVOD_RANK", "HOROVOD_SIZE")):
        try:
            return int(os.environ[rank_key]), int(os.environ[size_key])
        except (KeyError, ValueError):
            continue
    return None, None


def resume_path(pid: Optional[int] = None) -> Path:
    """``<dir>/resume-<pid>.json``: the resume record of this process (or ``pid``). A process
    that resumes again without restarting (Horovod elastic's reset) writes
    ``resume-<pid>-<n>.json`` for its n-th resume, so that every resume keeps its record."""
    if pid is None and _resumes > 1:
        return checkpoint_dir() / f"resume-{os.getpid()}-{_resumes}.json"
    return checkpoint_dir() / f"resume-{os.getpid() if pid is None else pid}.json"


def _resume_bytes() -> bytes:
    assert _resume is not None
    body = dict(_resume)
    body["last_step"] = _resume["step"] + _polls
    body["last_ts"] = time.time()
    return json.dumps(body, separators=(",", ":")).encode()


def resumed(
    step: int,
    checkpoint: Union[str, "os.PathLike[str]", "LatestCheckpoint", None] = None,
    *,
    restore_seconds: Optional[float] = None,
) -> Path:
    """Say where training (re)starts: call it once the checkpoint is loaded (``step`` = the step
    it holds, 0 on a fresh start) and the process group is up, right before the loop.

    It marks training as started (a SIGTERM from now on is a checkpoint request, see
    :func:`install`). Writes ``<dir>/resume-<pid>.json`` (``{"step", "ts", "rank",
    "world_size", "last_step", "last_ts"}``, atomically).

    ``checkpoint`` (optional) is what was loaded: a local path, or the
    :class:`LatestCheckpoint` that :func:`latest_checkpoint` returned. When it was saved after a
    notice — its sidecar (:func:`sidecar_path`, written by :func:`ack` / :func:`saved` after a
    signal) or its staged manifest names the notice — and for this same ``step``, the record
    gains ``"interruption": {"notice_id", "node", "kind", "source", "step", "saved_ts"}``.
    ``restore_seconds`` (optional) is how long loading took, as the trainer timed it
    (``"restore_seconds"``). The first :func:`should_checkpoint` call after this (the end of the
    first step trained) adds ``"first_step_ts"`` (one more write, once). The agent on this node
    reads a record with both ``interruption`` and ``first_step_ts`` and reports the recovery
    once: the time from the save on the interrupted node to this first step, and the restore
    time (docs/goodput.md). A sidecar or manifest that cannot be read or is not the helper's
    shape is ignored (no interruption named); it never raises.

    ``spotguard drill --elastic`` reads the record too, to tell which step each node resumed
    from after a preemption and when it trained again, so that it can count the steps lost (with
    ``--node-env VAR`` the record also carries ``"node"``, the value of ``$VAR``: one launcher
    for every node, e.g. ``HOROVOD_HOSTNAME``). Under ``spotguard drill --elastic``
    (``$SPOTGUARD_PROGRESS`` set) :func:`should_checkpoint` also refreshes ``last_step``
    (``step`` + its calls since) at most that often, which lets the drill count steps trained
    and then thrown away. Returns the path written; raises ``ValueError`` for a bad step or
    ``restore_seconds`` and ``OSError`` when it cannot write."""
    global _resume, _polls, _progress_written, _training, _resumes, _step, _step_mono, _durable
    global _first_step_due
    step = _as_step(step, "an int")
    if restore_seconds is not None:
        if isinstance(restore_seconds, bool) or not isinstance(restore_seconds, (int, float)):
            raise ValueError(f"restore_seconds must be a number, got {restore_seconds!r}")
        restore_seconds = float(restore_seconds)
        if not (0.0 <= restore_seconds < 1e7):
            raise ValueError(f"restore_seconds must be >= 0 and finite, got {restore_seconds!r}")
    interruption = _interruption_of(checkpoint, step) if checkpoint is not None else None
    _training = True
    rank, world = _world()
    _polls = 0
    _resumes += 1
    _resume = {"step": step, "ts": time.time(), "rank": rank, "world_size": world}
    node_env = os.environ.get("SPOTGUARD_NODE_ENV")  # `drill --elastic --node-env VAR` sets it
    if node_env:
        _resume["node"] = os.environ.get(node_env)
    if interruption is not None:
        _resume["interruption"] = interruption
    if restore_seconds is not None:
        _resume["restore_seconds"] = restore_seconds
    path = resume_path()
    _write_atomic(path, _resume_bytes())
    _first_step_due = True
    _progress_written = time.monotonic()
    _step, _step_mono = step, _progress_written
    # The loaded checkpoint is durable; what is trained from now on is at risk.
    _durable = (step, _resume["ts"], None)
    _write_record()
    return path


def _note_first_step() -> None:
    """The first :func:`should_checkpoint` after :func:`resumed`: stamp ``first_step_ts`` into
    the resume record (once); never raises into the training loop."""
    global _first_step_due
    _first_step_due = False
    if _resume is None:
        return
    _resume["first_step_ts"] = time.time()
    try:
        _write_atomic(resume_path(), _resume_bytes())
    except OSError as err:
        _warn_stderr(f"cannot write the resume record's first_step_ts: {err}")


#: The hidden directory beside a checkpoint that holds its interruption sidecar
#: (``<parent>/.spotguard/<name>.json``). Nothing is written inside the checkpoint, nor next to it
#: under a name a trainer's own ``glob("step-*")`` could take for another checkpoint.
SIDECAR_DIR = ".spotguard"

#: Sidecars larger than this (bytes) are ignored.
MAX_SIDECAR_BYTES = 4096

_SCHEMES = ("s3://", "gs://", "file://", "http://", "https://")


def sidecar_path(checkpoint: Union[str, "os.PathLike[str]"]) -> Path:
    """Where the interruption sidecar of a local checkpoint (a file or a directory) lives:
    ``<parent>/.spotguard/<name>.json``, e.g. ``/ckpt/.spotguard/step-120.pt.json`` for
    ``/ckpt/step-120.pt``."""
    where = Path(os.path.normpath(os.fspath(checkpoint)))
    return where.parent / SIDECAR_DIR / f"{where.name}.json"


def _warn_stderr(text: str) -> None:
    try:
        print(f"spotguard: warning: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _write_sidecar(step: int, where: Optional[str]) -> None:
    """After a notice (a signal arrived and ``notice.json`` names it), leave the interruption's
    timeline beside a local checkpoint made durable at ``step``, so that :func:`resumed` on the
    next node can name it. Never raises into the training loop: a warning on stderr instead."""
    if where is None or not _requested or _received_at is None or where.startswith(_SCHEMES):
        return
    n = notice()
    if n is None or not n.notice_id:
        return
    try:
        if not os.path.exists(where):
            return
        node = n.raw.get("node")
        body = {
            "v": 1,
            "notice_id": n.notice_id,
            "node": node if isinstance(node, str) else None,
            "kind": n.kind,
            "source": n.source,
            "step": step,
            "signal_ts": _received_at,
            "saved_ts": time.time(),
        }
        path = sidecar_path(where)
        try:
            os.mkdir(path.parent, 0o755)
        except FileExistsError:
            pass
        if not _own_sidecar_dir(os.fspath(path.parent)):
            _warn_stderr(f"not writing the interruption sidecar for {where}: {path.parent} is not "
                         "this user's own directory (another user's, or writable by others)")
            return
        _write_atomic(path, json.dumps(body, separators=(",", ":")).encode())
    except (OSError, ValueError, TypeError) as err:
        _warn_stderr(f"cannot write the checkpoint's interruption sidecar for {where}: {err}")


def _trusted_dir_stat(st: os.stat_result) -> bool:
    """A sidecar directory this process may trust: a directory of its own user that neither its
    group nor others can write (in a shared 1777 checkpoint directory another user could have
    created ``.spotguard`` first, or put a sidecar in it)."""
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _own_sidecar_dir(path: str) -> bool:
    try:
        return _trusted_dir_stat(os.lstat(path))
    except OSError:
        return False


def _read_own_sidecar(path: Path) -> Optional[bytes]:
    """A sidecar's bytes, only from this process's own user in a directory of its own
    (:func:`_trusted_dir_stat`): the directory opened without following a symlink, the file
    inside it likewise, a regular file owned by this user, at most :data:`MAX_SIDECAR_BYTES`.
    None otherwise."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        dfd = os.open(os.fspath(path.parent), flags | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        if not _trusted_dir_stat(os.fstat(dfd)):
            return None
        fd = os.open(path.name, flags | os.O_NONBLOCK, dir_fd=dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
                return None
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(MAX_SIDECAR_BYTES + 1)
            return data if len(data) <= MAX_SIDECAR_BYTES else None
        finally:
            os.close(fd)
    except OSError:
        return None
    finally:
        os.close(dfd)


def _sane_time(t: Any) -> bool:
    return (not isinstance(t, bool) and isinstance(t, (int, float))
            and 1.0e9 <= float(t) < 7.3e9)


def _short_text(v: Any, limit: int) -> bool:
    return isinstance(v, str) and 0 < len(v) <= limit


def _valid_interruption(body: Any, step: int) -> Optional[Dict[str, Any]]:
    """The resume record's ``interruption`` from a sidecar-shaped dict, or None when it is not
    the helper's shape or names another step."""
    if not isinstance(body, dict) or body.get("v") != 1:
        return None
    got = body.get("step")
    if isinstance(got, bool) or not isinstance(got, int) or got != step:
        return None
    node = body.get("node")
    if not (_short_text(body.get("notice_id"), 256) and _short_text(body.get("kind"), 64)
            and _short_text(body.get("source"), 64) and _sane_time(body.get("saved_ts"))
            and (node is None or _short_text(node, 256))):
        return None
    return {"notice_id": body["notice_id"], "node": node, "kind": body["kind"],
            "source": body["source"], "step": step, "saved_ts": float(body["saved_ts"])}


def _interruption_of(checkpoint: Any, step: int) -> Optional[Dict[str, Any]]:
    """The interruption a loaded checkpoint was saved at: from a staged checkpoint's manifest, or
    from a local checkpoint's sidecar (read without following a symlink, at most
    :data:`MAX_SIDECAR_BYTES`). None for anything else; never raises."""
    from .staged import LatestCheckpoint

    try:
        if isinstance(checkpoint, LatestCheckpoint):
            return _valid_interruption(checkpoint.interruption, step)
        where = os.fspath(checkpoint)
        if where.startswith(_SCHEMES):
            return None
        data = _read_own_sidecar(sidecar_path(where))
        if data is None:
            return None
        return _valid_interruption(json.loads(data.decode("utf-8")), step)
    except Exception:  # hostile input of any shape: no interruption named, never a crash
        return None


def _write_progress() -> None:
    """Refresh the resume record's ``last_step`` (drill only), at most every ``_progress_every``
    seconds; never raises into the training loop."""
    global _progress_written
    now = time.monotonic()
    if _progress_every is None or now - _progress_written < _progress_every:
        return
    _progress_written = now
    try:
        _write_atomic(resume_path(), _resume_bytes())
    except OSError:
        pass


#: How often (seconds) :func:`should_checkpoint` refreshes the progress record at most. Between
#: refreshes a call costs one monotonic-clock read and compare; after a signal every new step is
#: written at once.
PROGRESS_EVERY = 5.0

#: The agent refuses progress records larger than this (bytes).
MAX_PROGRESS_BYTES = 4096


def progress_path(pid: Optional[int] = None) -> Path:
    """``<dir>/progress-<pid>.json``: the progress record of this process (or ``pid``)."""
    return checkpoint_dir() / f"progress-{os.getpid() if pid is None else pid}.json"


def _progress_bytes() -> bytes:
    now_wall = time.time()
    body: Dict[str, Any] = {"v": 1, "step": _step}
    body["ts"] = None if _step is None else now_wall - max(0.0, time.monotonic() - _step_mono)
    if _durable is not None:
        body["durable_step"], body["durable_ts"] = _durable[0], _durable[1]
        if _durable[2] is not None and len(_durable[2]) <= 1024:
            body["durable_checkpoint"] = _durable[2]
    if _resume is not None:
        body["resumed_step"], body["resumed_ts"] = _resume["step"], _resume["ts"]
    return json.dumps(body, separators=(",", ":")).encode()


def _write_record() -> None:
    """Write the progress record now; never raises (it runs in the training loop and in the
    signal handler)."""
    global _record_due, _record_written_step
    _record_due = time.monotonic() + PROGRESS_EVERY
    _record_written_step = _step
    try:
        _write_atomic(progress_path(), _progress_bytes())
    except (OSError, ValueError, TypeError):
        pass


def _mark_durable(step: int, where: Optional[str]) -> None:
    global _durable
    _durable = (step, time.time(), where)
    if _owner_pid == os.getpid():
        _write_record()


def saved(step: int, checkpoint: Union[str, "os.PathLike[str]", None] = None) -> None:
    """Say that the checkpoint of ``step`` is durable (a periodic save, outside any notice):
    the progress record then counts the work after it, and only that, as lost if the process
    dies before its next save. :func:`ack` ``("done", step)`` and :func:`resumed` say it too.
    Raises ``ValueError`` for a bad step; never raises for the record itself."""
    step = _as_step(step, "an int")
    where = None if checkpoint is None else os.fspath(checkpoint)
    _mark_durable(step, where)
    _write_sidecar(step, where)


def notice() -> Optional[Notice]:
    """The parsed ``<dir>/notice.json``, or ``None`` when there is none, when it cannot be read or
    parsed (the agent writes it atomically, so that only happens when something else wrote it),
    or when it is older than :func:`install` in this process.

    The last rule drops leftovers: the agent writes the notice before it signals, and it only
    signals processes that already catch the signal, so a notice written before ``install()`` was
    never meant for this process (e.g. an ``emptyDir`` that survived a container restart)."""
    path = checkpoint_dir() / "notice.json"
    try:
        with open(path, "rb") as f:
            if _installed_at is not None and os.fstat(f.fileno()).st_mtime < _installed_at - 1.0:
                return None
            data = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    try:
        return Notice.from_dict(data)
    except ValueError:
        return None


def time_left(now: Optional[float] = None, *, until: str = "checkpoint") -> Optional[float]:
    """Seconds left before the checkpoint deadline in ``notice.json`` (or the instance deadline,
    ``until="deadline"``), or ``None`` when there is no notice (e.g. a plain SIGTERM from the
    kubelet: assume the pod's termination grace period)."""
    n = notice()
    return None if n is None else n.time_left(now, until=until)


def requested() -> bool:
    """Whether a checkpoint signal arrived in *this* process since :func:`install` or
    :func:`clear`. Local only; use :func:`should_checkpoint` in a training loop. Calling it
    marks training as started, like :func:`should_checkpoint`."""
    global _training
    _training = True
    return _requested


def received_signal() -> Optional[int]:
    """The number of the first signal that set the flag (e.g. ``signal.SIGUSR1``), or ``None``."""
    return _signum


def received_at() -> Optional[float]:
    """When (Unix seconds) the first signal of the current request arrived, or ``None``. Useful to
    budget a save when there is no ``notice.json`` (a plain SIGTERM from the kubelet: the pod's
    ``terminationGracePeriodSeconds`` counts from here)."""
    return _received_at


def handler_error() -> Optional[BaseException]:
    """The error the signal handler hit writing the ``received`` ack, if any. The handler never
    raises into the training loop; check this (or just write your terminal ack) afterwards."""
    return _handler_error


def installed_signals() -> Tuple[int, ...]:
    """The signals the helper currently handles."""
    return tuple(_previous)


def clear() -> None:
    """Forget a handled request so that training can go on (e.g. after an early checkpoint for an
    EC2 rebalance recommendation). The next signal writes a fresh ``received`` ack. Do not call it
    when exiting after the checkpoint: a late SIGTERM would then overwrite your ``done``."""
    global _requested, _signum, _received_at, _agreed, _calls
    _requested = False
    _signum = None
    _received_at = None
    _agreed = False
    _calls = 0


def _handle(signum: int, frame: Optional[FrameType]) -> None:
    """The signal handler: set the flag, write ``received`` once per request, chain."""
    global _requested, _signum, _received_at, _handler_error
    if os.getpid() == _owner_pid:
        if signum == signal.SIGTERM and not _training:
            _exit_before_training("the signal handler")
        first = not _requested
        _requested = True
        if first:
            _signum = signum
            _received_at = time.time()
            try:
                _write_atomic(ack_path(), _ack_bytes("received", None, None))
            except OSError as err:  # never raise into the training loop from a handler
                _handler_error = err
            if _training:
                _write_record()  # the step at the signal, for a process that dies before acking
    previous = _previous.get(signum)
    if _chain and callable(previous) and previous is not signal.default_int_handler:
        previous(signum, frame)


def _exit_before_training(where: str) -> None:
    """SIGTERM before training started (no :func:`resumed`, :func:`should_checkpoint` or
    :func:`requested` call yet): there is no step to save, so leave now with 143 instead of turning it into a request.
    A launcher stopping its workers (torchrun restarting them, a membership change) must not wait
    for a process still in rendezvous or in a gloo connect. Acks ``skipped`` (no checkpoint) so
    that an agent waiting on this process learns it at once. Only ``os`` calls: this runs in the
    signal handler or in the watchdog thread."""
    try:
        _write_atomic(ack_path(), _ack_bytes("skipped", None, None))
    except OSError:
        pass
    try:
        os.write(2, f"spotguard: SIGTERM before training started (seen by {where}): nothing to "
                    f"checkpoint yet, exiting {EXIT_CODE}\n".encode())
    except OSError:
        pass
    os._exit(EXIT_CODE)


class _SigtermWatchdog:
    """Sees SIGTERM while the main thread is blocked in C code (a rendezvous, a gloo connect, a
    store wait), where Python cannot run the signal handler until the call returns: Python's C
    handler writes the signal number to the wakeup fd, and this thread reads it. Before training
    started it ends the process (:func:`_exit_before_training`); after, it does nothing (the
    handler sets the flag as soon as the main thread runs Python again)."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        os.set_inheritable(self._r, False)
        os.set_inheritable(self._w, False)
        self.previous = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        if self.previous != -1:
            # Someone else (asyncio, a framework) owns the wakeup fd: give it back, no watchdog.
            signal.set_wakeup_fd(self.previous)
            os.close(self._r)
            os.close(self._w)
            self.active = False
            return
        self.active = True
        self._thread = threading.Thread(target=self._run, name="spotguard-sigterm", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._r, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data and not _training and os.getpid() == _owner_pid:
                _exit_before_training("the watchdog thread: the main thread was busy in C code")

    def stop(self) -> None:
        if not self.active:
            return
        self.active = False
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:  # not the main thread (a forked child): the fd dies with the pipe
            pass
        for fd in (self._w, self._r):
            try:
                os.close(fd)
            except OSError:
                pass


def _reset_in_child() -> None:
    """After ``os.fork`` (DataLoader workers, multiprocessing 'fork'): give the child the
    dispositions it had before :func:`install`, so that its ``SigCgt`` no longer shows the signal
    and spotguard's ``handlers`` mode never signals it (it would never ack)."""
    global _owner_pid, _installed_at, _watchdog, _training
    if _owner_pid is None or os.getpid() == _owner_pid:
        return
    saved = dict(_previous)
    _previous.clear()
    _owner_pid = None
    _installed_at = None
    if _watchdog is not None:
        _watchdog.stop()  # its thread did not survive the fork
    for signum, previous in saved.items():
        try:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        except (ValueError, OSError, TypeError):
            pass
    _watchdog = None
    _training = False
    clear()


def install(
    signals: Iterable[int] = (signal.SIGUSR1, signal.SIGTERM),
    dir: Union[str, "os.PathLike[str]", None] = None,
    *,
    chain: bool = True,
) -> Path:
    """Catch ``signals`` and turn them into a checkpoint request. Call it once, early, from the
    main thread of every process that should checkpoint (each DDP rank, not the torchrun agent).

    The handler sets a flag, records the signal, writes ``<dir>/ack-<pid>.json`` with
    ``{"state": "received", ...}`` on the first signal of a request, then calls the handler that
    was installed before (when ``chain`` and that handler is a Python callable). It never chains
    ``SIG_DFL``, ``SIG_IGN`` or Python's SIGINT ``default_int_handler`` (KeyboardInterrupt): for
    SIGTERM the default action would kill the process before the save, which is the point of
    catching it. A chained handler that exits (e.g. raises ``SystemExit``) defeats the save, so
    keep an earlier framework handler only if it returns (else pass ``chain=False``).

    Idempotent: calling it again (with the same or other signals) does not wrap itself. ``dir``
    overrides ``$SPOTGUARD_DIR``. Forked children get their previous dispositions back.

    SIGTERM *before training started* (before :func:`resumed` or the first
    :func:`should_checkpoint` / :func:`requested` call) is not a checkpoint request: there is nothing to save yet, so the
    process acks ``skipped`` and exits 143 at once, even while its main thread is blocked in C
    code (a rendezvous, a gloo connect: a watchdog thread reads Python's signal wakeup fd, unless
    something else already owns it). A launcher's restart (torchrun stopping its workers) never
    waits on a worker that is still starting. SIGUSR1 before training started is kept as a
    request: the first step boundary checkpoints.

    It creates the checkpoint directory when missing (:func:`prepare_dir`: mode ``0o1777``), and
    warns (``RuntimeWarning``) when neither ``dir`` nor ``$SPOTGUARD_DIR`` is set or when the
    directory cannot be created: a directory the agent does not write to ends in its timeout.
    Returns the checkpoint directory. Raises ``RuntimeError`` outside the main thread.
    """
    global _dir, _chain, _owner_pid, _fork_hook_registered, _installed_at, _watchdog
    global _progress_every
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "spotguard.install() must be called from the main thread: Python runs signal handlers "
            "only there (call it at start-up, before starting threads or the training loop)"
        )
    sigs = [int(s) for s in signals]
    if not sigs:
        raise ValueError("spotguard.install(): no signals given")
    for s in sigs:
        if s in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"signal {s} cannot be caught")
    if dir is not None:
        _dir = os.fspath(dir)
    _chain = chain
    _owner_pid = os.getpid()
    if _installed_at is None:
        _installed_at = time.time()
    for s in sigs:
        if s in _previous:
            continue
        previous = signal.getsignal(s)
        signal.signal(s, _handle)
        _previous[s] = previous
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_reset_in_child)
        _fork_hook_registered = True
    if signal.SIGTERM in _previous and _watchdog is None:
        _watchdog = _SigtermWatchdog()
    _progress_every = _progress_interval()
    if dir is None and not os.environ.get("SPOTGUARD_DIR") and _dir is None:
        _warn_default_dir()
    directory = checkpoint_dir()
    try:
        prepare_dir(directory)
    except OSError as err:
        warnings.warn(
            f"spotguard: cannot create the checkpoint directory {directory}: {err}; the agent "
            "cannot write notice.json there and this process cannot ack (the agent's wait for "
            "it would end in a timeout)",
            RuntimeWarning,
            stacklevel=2,
        )
    return directory


#: The host agent's default ``--checkpoint-dir`` (the systemd unit's RuntimeDirectory).
HOST_AGENT_DIR = "/run/spotguard"


def _warn_default_dir() -> None:
    hint = ""
    if os.path.isdir(HOST_AGENT_DIR):
        hint = (
            f" {HOST_AGENT_DIR} exists: a host agent (systemd unit) writes there, and its "
            f"private /tmp never sees {DEFAULT_DIR}; set SPOTGUARD_DIR={HOST_AGENT_DIR}."
        )
    warnings.warn(
        f"spotguard: SPOTGUARD_DIR is not set; using {DEFAULT_DIR}. The agent writes notice.json "
        "to the pod annotation spotguard.io/checkpoint-dir (default /tmp/spotguard) in "
        f"Kubernetes and to --checkpoint-dir (default {HOST_AGENT_DIR}) on a host: set "
        "SPOTGUARD_DIR to that path, or a preemption ends in the agent's timeout." + hint,
        RuntimeWarning,
        stacklevel=3,
    )


def prepare_dir(path: Union[str, "os.PathLike[str]"]) -> bool:
    """Create the checkpoint directory (with its parents) when it is missing. A directory this
    call created gets mode ``0o1777`` (sticky, world-writable, like ``/tmp``): the agent writes
    ``notice.json`` into it as root *without* ``CAP_DAC_OVERRIDE`` (the DaemonSet drops it), and
    trainers of any uid write their acks. An existing directory is left as it is (an emptyDir is
    already 0777). Returns whether it created the directory. Called by :func:`install`."""
    target = os.fspath(path)
    try:
        os.makedirs(target)
    except FileExistsError:
        if not os.path.isdir(target):
            raise NotADirectoryError(f"{target} exists and is not a directory") from None
        return False
    os.chmod(target, 0o1777)  # makedirs applies the umask; set the mode explicitly
    return True


def uninstall() -> None:
    """Restore the dispositions that were in place before :func:`install` and clear the flag.
    Main thread only."""
    global _owner_pid, _installed_at, _watchdog, _training
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("spotguard.uninstall() must be called from the main thread")
    for signum, previous in list(_previous.items()):
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        del _previous[signum]
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None
    _owner_pid = None
    _installed_at = None
    _training = False
    clear()


def _distributed() -> Any:
    """``torch.distributed`` when it is imported, available and initialised, else ``None``.
    Never imports torch itself: a process group can only exist if the module was imported."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if dist.is_available() and dist.is_initialized():
            return dist
    except Exception:  # a half-imported or broken torch counts as "not distributed"
        return None
    return None


_side_group: Any = None

#: The ways :func:`should_checkpoint` can agree across ranks (its ``via`` argument).
AGREEMENT_PATHS = ("auto", "gloo", "default")


def _agreement_group(dist: Any, via: str) -> Tuple[Any, Any]:
    """(process group, device) for the agreement all-reduce. ``None`` as the group means the
    default group."""
    global _side_group
    torch = sys.modules["torch"]
    backend = str(dist.get_backend()).lower()
    cpu_capable = "gloo" in backend or "nccl" not in backend
    if via == "default":
        # A tensor must live where the backend can reduce it: NCCL only reduces CUDA tensors, gloo
        # reduces CPU tensors (a mixed "cpu:gloo,cuda:nccl" backend takes CPU tensors via gloo).
        if cpu_capable:
            return None, torch.device("cpu")
        return None, torch.device("cuda", torch.cuda.current_device())
    if via == "auto" and cpu_capable:
        return None, torch.device("cpu")
    # A gloo group over the same ranks, made once: a CPU tensor, no CUDA stream sync. new_group
    # is itself a collective, and every rank reaches it here at the same call.
    if _side_group is None:
        _side_group = dist.new_group(backend="gloo")
    return _side_group, torch.device("cpu")


def _all_reduce_max(dist: Any, local: bool, via: str) -> bool:
    torch = sys.modules["torch"]
    group, device = _agreement_group(dist, via)
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
    if group is None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    else:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def should_checkpoint(every: int = 1, *, via: str = "auto", step: Optional[int] = None) -> bool:
    """Whether to checkpoint now. Call it at the same point of every step (after the optimizer
    step) in *every* rank.

    Without an initialised ``torch.distributed`` process group this is the local flag (free; read
    on every call). With one, it is a collective: an all-reduce (MAX) of the local flag, so that
    a signal seen by any rank — ranks get it at slightly different times — makes all ranks
    checkpoint at the same step. Every rank must call it the same number of times, or the
    collective hangs. Once the ranks agreed on True it stays True without further collectives
    until :func:`clear`.

    ``via`` chooses where the all-reduce runs:

    * ``"auto"`` (default): on the CPU. Under gloo (or a mixed ``cpu:gloo,cuda:nccl`` backend)
      through the default group; under NCCL through a gloo side group over the same ranks, made
      once on the first call. No CUDA tensor, so no per-step GPU synchronisation (``.item()`` on
      a CUDA tensor waits for every kernel queued before it).
    * ``"gloo"``: always the gloo side group.
    * ``"default"``: the default group, on a CUDA tensor under NCCL (v0.1's behaviour: a GPU sync
      per call).

    ``every=N`` runs the all-reduce on every N-th call only (returning False in between) to
    amortise its cost: the answer arrives at most N-1 steps later, so a checkpoint starts up to
    (N-1) x step time after the signal. Keep that well under the budget (about 20 s on GCE).

    ``step`` (optional) is the step just trained; without it the step is the one given to
    :func:`resumed` plus the calls since. It feeds the progress record
    (``<dir>/progress-<pid>.json``, refreshed at most every :data:`PROGRESS_EVERY` seconds, and at
    every new step once a signal came): the agent reads it after a notice to count the work
    thrown away by a process that died without acking.
    """
    global _agreed, _calls, _training, _polls, _step, _step_mono
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    if via not in AGREEMENT_PATHS:
        raise ValueError(f"via must be one of {', '.join(AGREEMENT_PATHS)}; got {via!r}")
    _training = True
    _polls += 1
    _step_mono = now = time.monotonic()
    if step is not None:
        _step = step
    elif _resume is not None:
        _step = _resume["step"] + _polls
    else:
        _step = _polls
    if now >= _record_due or (_requested and _step != _record_written_step):
        _write_record()
    if _first_step_due:
        _note_first_step()
    if _progress_every is not None and _resume is not None:
        _write_progress()
    if _agreed:
        return True
    dist = _distributed()
    if dist is None:
        if _requested:
            _agreed = True
        return _agreed
    _calls += 1
    if _calls % every != 0:
        return False
    if _all_reduce_max(dist, _requested, via):
        _agreed = True
    return _agreed


def exit_after_checkpoint(code: int = EXIT_CODE, *, hard: bool = True) -> None:
    """Leave after the checkpoint was saved and acked, with exit code 143 by default.

    143 (128 + SIGTERM) is what a process killed by SIGTERM reports. Kubeflow's training operator
    with ``restartPolicy: ExitCode`` treats 1–127 as permanent failures and 128–255 as retryable,
    and a Job ``podFailurePolicy`` rule ``onExitCodes: {operator: In, values: [143]}`` with action
    ``Ignore`` keeps the preemption from counting against ``backoffLimit``. Exit 0 would mark the
    job *succeeded*; exit 1 would be a permanent failure.

    ``hard=True`` flushes stdout/stderr and calls ``os._exit``: no atexit handlers, no interpreter
    teardown, which can hang (DataLoader workers, NCCL communicators) while the deadline runs.
    ``hard=False`` raises ``SystemExit(code)`` for a normal shutdown. Destroy the process group
    first under DDP if you want a clean one.
    """
    if not hard:
        raise SystemExit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


LAUNCH_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _read_json_file(path: Path) -> Optional[Dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_ACK_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_ACK_BYTES:
        return None
    try:
        body = json.loads(data.decode("utf-8"))
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _launch_notice(directory: Path, started: float, before: Optional[str]) -> Optional[str]:
    """The id of the ``notice.json`` the agent wrote into ``directory`` during this launch: its
    id differs from the one there at the start (``before``) or the file is newer than the start."""
    path = directory / "notice.json"
    body = _read_json_file(path)
    if body is None or not body.get("notice_id"):
        return None
    nid = str(body["notice_id"])
    try:
        newer = path.stat().st_mtime >= started
    except OSError:
        return None
    return nid if (nid != before or newer) else None


def _done_acks(directory: Path, started: float, before: Optional[str]) -> List[str]:
    """Descriptions of the ``done`` acks in ``directory`` that belong to this launch: written
    after it started (by the ack's own ``ts``, the writer's clock, which is this host's clock: no
    look-back), and, when the ack names a notice, naming the notice written during this launch.
    A ``done`` left by an earlier run (same directory, back-to-back runs) never counts."""
    this_notice = _launch_notice(directory, started, before)
    found = []
    # The plain ack, its fallback names (``ack.<suffix>``) and every ``ack-<pid>[.<suffix>].json``.
    candidates = ([directory / "ack"] + sorted(directory.glob("ack.*"))
                  + sorted(directory.glob("ack-*.json")))
    for path in candidates:
        body = _read_json_file(path)
        if path.name == "ack" or path.name.startswith("ack."):
            if body is None:  # the plain ack may hold anything: go by its time
                try:
                    if path.exists() and path.stat().st_mtime >= started:
                        found.append(f"{path.name}")
                except OSError:
                    pass
                continue
        elif body is None or body.get("state") != "done":
            continue
        ts = body.get("ts")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < started:
            continue
        nid = body.get("notice_id")
        if nid is not None and str(nid) != this_notice:
            continue
        found.append(f"{path.name} (step {body.get('step')}, notice {nid or '-'})")
    return found


def _environ_dir(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return None
    for item in env.split(b"\0"):
        if item.startswith(b"SPOTGUARD_DIR="):
            value = item[len(b"SPOTGUARD_DIR=") :].decode("utf-8", "replace")
            return value or None
    return None


def _descendants(root: int) -> List[int]:
    children: Dict[int, List[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rpartition(b")")[2].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


class _DirWatch:
    """Finds the checkpoint directories of a launch the way its workers do: from the
    ``SPOTGUARD_DIR`` in each process's environment (``launch -- env SPOTGUARD_DIR=… torchrun``
    sets it for the workers only). Polls the child's process tree from a thread until stopped."""

    def __init__(self, root: int, interval: float = 0.5) -> None:
        self.root = root
        self.interval = interval
        self.dirs: Dict[str, Optional[str]] = {}  # dir -> notice id present when first seen
        self._seen: set = set()
        self._stop = threading.Event()
        self.add(str(checkpoint_dir()))
        self._thread = threading.Thread(target=self._run, name="spotguard-launch-dirs", daemon=True)
        self._thread.start()

    def add(self, directory: str) -> None:
        if directory not in self.dirs:
            body = _read_json_file(Path(directory) / "notice.json")
            self.dirs[directory] = str(body.get("notice_id")) if body else None

    def scan(self) -> None:
        for pid in _descendants(self.root):
            if pid in self._seen:
                continue
            self._seen.add(pid)
            found = _environ_dir(pid)
            if found:
                self.add(found)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.scan()
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def seen_pids(self) -> List[int]:
        """Every pid seen in the child's process tree while it ran."""
        return sorted(self._seen)


def _launch_exit_code(argv: Sequence[str], rc: int, watch: _DirWatch, started: float) -> int:
    """The launch's exit code: the child's (128 + N when killed by signal N), or 143 when it
    failed after a ``done`` ack of this run (see :func:`launch`)."""
    if rc < 0:
        rc = 128 - rc
    if rc == 0 or rc == EXIT_CODE:
        return rc
    for directory, before in watch.dirs.items():
        acks = _done_acks(Path(directory), started, before)
        if acks:
            print(
                f"spotguard launch: {argv[0]} exited {rc} after this run's checkpoint "
                f"({', '.join(acks)} in {directory}): exiting {EXIT_CODE} (retryable)",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_CODE
    return rc


def _start_held(
    cmd: List[str], forward: Sequence[int], env: Optional[Dict[str, str]] = None
) -> "Tuple[subprocess.Popen[bytes], Callable[[], None]]":
    """Start the launcher's child with the ``forward`` signals blocked in this process until the
    caller has installed its relay handlers (then it calls the returned ``unblock``): a
    ``SIGTERM`` that arrives while the child starts stays pending and is relayed, instead of
    killing this process by its default action and leaving the child running. Threads started
    meanwhile inherit the block, so the signal can only be taken by the main thread once it is
    unblocked there. The child starts with the mask this process had (restored before ``exec``):
    it never inherits the block."""
    held = set(forward)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)

    def restore() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)

    try:
        child = subprocess.Popen(cmd, env=env, preexec_fn=restore)
    except BaseException:
        restore()
        raise
    return child, restore


def launch(
    argv: Sequence[str],
    forward: Iterable[int] = LAUNCH_FORWARDED,
    *,
    elastic: Optional[bool] = None,
) -> int:
    """Run a launcher such as ``torchrun`` as a child and return the exit code the pod should
    report: 143 when it failed after a checkpoint was acked ``done`` during this run (torchrun
    turns its workers' 143 into 1), else the child's own code (128 + N when killed by signal N).

    Which acks count: ``done`` acks written after the launch started (by the ack's ``ts``) and,
    when they name a notice, naming the ``notice.json`` the agent wrote during this launch. The
    directories searched are this process's :func:`checkpoint_dir` and every ``SPOTGUARD_DIR``
    found in the environment of the child's process tree (polled while it runs), so
    ``launch -- env SPOTGUARD_DIR=/ckpt torchrun …`` works too.

    ``SIGTERM``, ``SIGINT`` and ``SIGHUP`` received by this process (the container's PID 1, which
    is what the kubelet signals) are forwarded to the child. ``SIGUSR1`` is deliberately not
    caught: spotguard's ``handlers`` mode then skips this process and signals the workers, which
    called :func:`install`, directly. Main thread only.

    Elastic torchrun (``--nnodes MIN:MAX`` with MIN < MAX, or ``elastic=True``): the node that
    gets the notice leaves the job right after its checkpoint and the other nodes go on without
    it; see :mod:`spotguard.elastic`. ``elastic=False`` turns that off.
    """
    if not argv:
        raise ValueError("launch: no command given")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("spotguard.launch() must be called from the main thread")
    if elastic is not False:
        from . import elastic as _elastic

        tr = _elastic.parse_torchrun(argv)
        if tr is not None and (elastic or tr.elastic):
            return _elastic.run(argv, tr, forward)
        if elastic:
            print(
                f"spotguard launch: --elastic: {argv[0]!r} is not torchrun (torchrun, or "
                "python -m torch.distributed.run): running it as a plain launcher",
                file=sys.stderr,
                flush=True,
            )
    started = time.time()
    forward = list(forward)
    child, unblock = _start_held(list(argv), forward)

    def relay(signum: int, frame: Optional[FrameType]) -> None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    saved = {}
    try:
        for s in forward:
            saved[s] = signal.signal(s, relay)
    finally:
        unblock()  # a signal that came while the child started is relayed now
    watch = _DirWatch(child.pid)
    try:
        rc = child.wait()
    finally:
        for s, previous in saved.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        watch.stop()
    return _launch_exit_code(argv, rc, watch, started)


def main(argv: Optional[List[str]] = None) -> int:
    """``python3 -m spotguard launch [--elastic|--no-elastic] [--] CMD ARGS…`` (see
    :func:`launch`) and ``python3 -m spotguard horovod-hosts …`` (see :mod:`spotguard.horovod`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python3 -m spotguard launch [--elastic|--no-elastic] [--] CMD [ARGS...]"
    if args and args[0] == "horovod-hosts":
        from . import horovod

        return horovod.hosts_main(args[1:])
    if not args or args[0] != "launch":
        print(usage, file=sys.stderr)
        return 64
    cmd = args[1:]
    elastic: Optional[bool] = None
    while cmd and cmd[0] in ("--elastic", "--no-elastic"):
        elastic = cmd[0] == "--elastic"
        cmd = cmd[1:]
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print(usage, file=sys.stderr)
        return 64
    try:
        return launch(cmd, elastic=elastic)
    except OSError as err:
        print(f"spotguard launch: cannot run {cmd[0]!r}: {err}", file=sys.stderr)
        return 127


from .staged import LatestCheckpoint, StagedAnswer, ack_staged, latest_checkpoint  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
