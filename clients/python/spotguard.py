"""Training-side helper for spotguard's checkpoint protocol v1.

One file, standard library only, importable without torch. Copy it next to your training script
or put ``clients/python`` on ``PYTHONPATH``.

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

``<dir>`` is the ``dir`` given to :func:`install`, else ``$SPOTGUARD_DIR``, else
``/tmp/spotguard``. Protocol reference: ``docs/checkpoint-protocol.md``.

Launchers: ``torchrun`` exits 1 when a worker exits 143, which Kubeflow and a Job
``podFailurePolicy`` read as a permanent failure. Run it through :func:`launch` to get 143 back::

    python3 spotguard.py launch -- torchrun --nproc-per-node 8 train.py
"""

from __future__ import annotations

import itertools
import json
import operator
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

__all__ = [
    "ACK_STATES",
    "DEFAULT_DIR",
    "EXIT_CODE",
    "MAX_ACK_BYTES",
    "Notice",
    "ack",
    "ack_container",
    "ack_path",
    "clear",
    "checkpoint_dir",
    "exit_after_checkpoint",
    "handler_error",
    "install",
    "installed_signals",
    "launch",
    "notice",
    "received_at",
    "received_signal",
    "requested",
    "should_checkpoint",
    "time_left",
    "uninstall",
]

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
_fork_hook_registered = False
_installed_at: Optional[float] = None


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


def _write_atomic(path: Path, data: bytes) -> None:
    """Temp file in the same directory (a dot-name that never matches ``ack-*.json``), fsync,
    rename over ``path``, fsync the directory. Only ``os`` calls: safe from a signal handler."""
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
        os.replace(tmp, str(path))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _ack_bytes(state: str, step: Optional[int], checkpoint: Optional[str]) -> bytes:
    body = {"state": state, "step": step, "checkpoint": checkpoint, "ts": time.time()}
    return json.dumps(body, separators=(",", ":")).encode()


def ack(
    state: str,
    step: Optional[int] = None,
    checkpoint: Union[str, "os.PathLike[str]", None] = None,
) -> Path:
    """Write this process's acknowledgement ``<dir>/ack-<pid>.json`` atomically.

    ``state`` is one of ``received``, ``done`` (checkpoint saved), ``skipped`` (the save could not
    fit the deadline) or ``failed``. ``step`` and ``checkpoint`` (a path, as the process sees it)
    are reported by the agent in logs and Events. Returns the path written; raises ``ValueError``
    for a bad state and ``OSError`` when the file cannot be written.
    """
    if state not in ACK_STATES:
        raise ValueError(f"ack state must be one of {', '.join(ACK_STATES)}; got {state!r}")
    if step is not None:
        if isinstance(step, bool):
            raise ValueError(f"step must be an int or None, got {step!r}")
        try:
            step = operator.index(step)  # accepts numpy / 0-d integer tensor steps too
        except TypeError:
            raise ValueError(f"step must be an int or None, got {step!r}") from None
    data = _ack_bytes(state, step, None if checkpoint is None else os.fspath(checkpoint))
    if len(data) > MAX_ACK_BYTES:
        raise ValueError(f"ack is {len(data)} bytes; the agent reads at most {MAX_ACK_BYTES}")
    path = ack_path()
    _write_atomic(path, data)
    return path


def ack_container(
    step: Optional[int] = None,
    checkpoint: Union[str, "os.PathLike[str]", None] = None,
) -> Path:
    """Write the plain ``<dir>/ack`` file: it acknowledges the whole container at once (for
    launchers where one process saves on behalf of all). Content is informational JSON."""
    path = checkpoint_dir() / "ack"
    where = None if checkpoint is None else os.fspath(checkpoint)
    _write_atomic(path, _ack_bytes("done", step, where))
    return path


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
    :func:`clear`. Local only; use :func:`should_checkpoint` in a training loop."""
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
        first = not _requested
        _requested = True
        if first:
            _signum = signum
            _received_at = time.time()
            try:
                _write_atomic(ack_path(), _ack_bytes("received", None, None))
            except OSError as err:  # never raise into the training loop from a handler
                _handler_error = err
    previous = _previous.get(signum)
    if _chain and callable(previous) and previous is not signal.default_int_handler:
        previous(signum, frame)


def _reset_in_child() -> None:
    """After ``os.fork`` (DataLoader workers, multiprocessing 'fork'): give the child the
    dispositions it had before :func:`install`, so that its ``SigCgt`` no longer shows the signal
    and spotguard's ``handlers`` mode never signals it (it would never ack)."""
    global _owner_pid, _installed_at
    if _owner_pid is None or os.getpid() == _owner_pid:
        return
    saved = dict(_previous)
    _previous.clear()
    _owner_pid = None
    _installed_at = None
    for signum, previous in saved.items():
        try:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        except (ValueError, OSError, TypeError):
            pass
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
    Returns the checkpoint directory. Raises ``RuntimeError`` outside the main thread.
    """
    global _dir, _chain, _owner_pid, _fork_hook_registered, _installed_at
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
    return checkpoint_dir()


def uninstall() -> None:
    """Restore the dispositions that were in place before :func:`install` and clear the flag.
    Main thread only."""
    global _owner_pid, _installed_at
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("spotguard.uninstall() must be called from the main thread")
    for signum, previous in list(_previous.items()):
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        del _previous[signum]
    _owner_pid = None
    _installed_at = None
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


def _all_reduce_max(dist: Any, local: bool) -> bool:
    torch = sys.modules["torch"]
    backend = str(dist.get_backend()).lower()
    # A tensor must live where the backend can reduce it: NCCL only reduces CUDA tensors, gloo
    # reduces CPU tensors (a mixed "cpu:gloo,cuda:nccl" backend takes CPU tensors through gloo).
    if "nccl" in backend and "gloo" not in backend:
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def should_checkpoint(every: int = 1) -> bool:
    """Whether to checkpoint now. Call it at the same point of every step (after the optimizer
    step) in *every* rank.

    Without an initialised ``torch.distributed`` process group this is the local flag (free; read
    on every call). With one, it is a collective: an all-reduce (MAX) of the local flag, so that
    a signal seen by any rank — ranks get it at slightly different times — makes all ranks
    checkpoint at the same step. Every rank must call it the same number of times, or the
    collective hangs. ``every=N`` runs the all-reduce on every N-th call only (returning False in
    between) to amortise its cost; the answer arrives at most N-1 steps later. Once the ranks agreed
    on True it stays True without further collectives until :func:`clear`.
    """
    global _agreed, _calls
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
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
    if _all_reduce_max(dist, _requested):
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


def _done_acked_since(since: float) -> bool:
    """Whether any process acked ``done`` (or the plain ``ack`` appeared) at or after ``since``."""
    directory = checkpoint_dir()
    plain = directory / "ack"
    try:
        if plain.stat().st_mtime >= since:
            return True
    except OSError:
        pass
    for path in directory.glob("ack-*.json"):
        try:
            if path.stat().st_mtime < since:
                continue
            body = json.loads(path.read_bytes().decode("utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(body, dict) and body.get("state") == "done":
            return True
    return False


def launch(argv: Sequence[str], forward: Iterable[int] = LAUNCH_FORWARDED) -> int:
    """Run a launcher such as ``torchrun`` as a child and return the exit code the pod should
    report: 143 when it failed after a checkpoint was acked ``done`` during this run (torchrun
    turns its workers' 143 into 1), else the child's own code (128 + N when killed by signal N).

    ``SIGTERM``, ``SIGINT`` and ``SIGHUP`` received by this process (the container's PID 1, which
    is what the kubelet signals) are forwarded to the child. ``SIGUSR1`` is deliberately not
    caught: spotguard's ``handlers`` mode then skips this process and signals the workers, which
    called :func:`install`, directly. Main thread only.
    """
    if not argv:
        raise ValueError("launch: no command given")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("spotguard.launch() must be called from the main thread")
    # File times come from the kernel's coarse clock, a few ms behind time.time(): allow for it.
    started = time.time() - 0.5
    child = subprocess.Popen(list(argv))

    def relay(signum: int, frame: Optional[FrameType]) -> None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    saved = {}
    for s in forward:
        saved[s] = signal.signal(s, relay)
    try:
        rc = child.wait()
    finally:
        for s, previous in saved.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
    if rc < 0:
        rc = 128 - rc
    if rc != 0 and _done_acked_since(started):
        return EXIT_CODE
    return rc


def main(argv: Optional[List[str]] = None) -> int:
    """``python3 spotguard.py launch [--] CMD ARGS…`` (see :func:`launch`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: spotguard.py launch [--] CMD [ARGS...]"
    if not args or args[0] != "launch":
        print(usage, file=sys.stderr)
        return 64
    cmd = args[1:]
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print(usage, file=sys.stderr)
        return 64
    try:
        return launch(cmd)
    except OSError as err:
        print(f"spotguard.py launch: cannot run {cmd[0]!r}: {err}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
