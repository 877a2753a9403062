"""Elastic torchrun (TorchElastic, Kubeflow PyTorchJob ``elasticPolicy``) under spotguard: the
preempted node leaves the job right after the checkpoint; the others go on at once.

``python3 -m spotguard launch -- torchrun --nnodes=1:4 --rdzv-backend=c10d … train.py`` runs this
mode by itself when ``--nnodes`` (or ``PET_NNODES``) is a range ``MIN:MAX`` with MIN < MAX;
``launch --elastic`` forces it, ``launch --no-elastic`` turns it off.

What happens at a preemption (docs/training-integration.md, "Elastic training", says why):

1. The agent writes ``notice.json`` into this node's ``SPOTGUARD_DIR`` and signals the workers.
   Every rank of the job (all nodes) agrees on one step through :func:`spotguard.should_checkpoint`
   and saves; every rank acks and exits 143.
2. The launcher on the *preempted* node sees ``notice.json`` appear (it polls every 50 ms) and
   first removes this node's torchrun agent from the c10d rendezvous state, with torch's own
   rendezvous operations against the same store (:func:`leave_rendezvous`; at most
   :data:`LEAVE_WAIT_S` seconds, and tried again once torchrun has exited if that failed).
   Otherwise the entry stays until its heartbeats expire (10-15 s: torchrun's agent never
   removes it when it is stopped by a signal), and a round the surviving nodes form before then
   still counts this node: it fails when the node goes, and they form another one. A removed
   entry also stops the agent's heartbeats (torch only refreshes an entry that is there), so the
   agent cannot rejoin.
3. Then it sends SIGTERM to its torchrun, before the workers have finished their save.
   torchrun's agent takes a signal as "this node is going away": it stops its workers (which are
   saving: the SIGTERM is one more checkpoint request to them, their save completes within
   torchrun's ``--shutdown-timeout``) and exits **without restarting them and without closing
   the rendezvous** (``launch_agent`` only closes it when the agent ends for another reason).
4. The surviving nodes' agents see their workers exit 143 and restart them: a new rendezvous round
   without the preempted node, and the workers resume from the checkpoint just saved.
   ``last_call_timeout`` decides how long a round with enough nodes waits for more; the launcher
   sets it to :data:`LAST_CALL_S` seconds when the command does not (torchrun's default, 30 s,
   would keep the survivors idle that long). It also sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
   (:func:`elastic_environ`): with torch's shared store a node joining a later round never gets
   that round's master address.
5. A replacement node (the operator's new pod, a new VM) joins later: it waits in the rendezvous,
   the running agents see a waiting node and restart their workers for it (torchrun does not
   count that restart); the helper turns the agents' SIGTERM into one more checkpoint, so that
   restart loses nothing either.

Restarts: torchrun counts every restart of a node's workers after they exit non-zero against
``--max-restarts``, and a preemption restarts every surviving node's workers once. torchrun cannot
tell those from failures, so the launcher gives it ``--max-restarts`` = yours +
``SPOTGUARD_PREEMPTION_RESTARTS`` (default :data:`PREEMPTION_RESTARTS`): preemptions do not use up
the restarts you set for failures (a failure can use the allowance, though).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

#: How many extra restarts the launcher gives torchrun for preemptions (one per preemption that
#: a node survives). ``SPOTGUARD_PREEMPTION_RESTARTS`` overrides it.
PREEMPTION_RESTARTS = 10

#: ``last_call_timeout`` (seconds) the launcher adds to ``--rdzv-conf`` when the command sets none.
#: ``SPOTGUARD_LAST_CALL_TIMEOUT`` overrides it.
LAST_CALL_S = 2

#: How often the launcher looks for a notice (seconds).
POLL_S = 0.05

#: How long the launcher waits for the removal of the agent's rendezvous entry before it sends
#: SIGTERM to torchrun anyway (the removal goes on, and is tried again once torchrun has exited).
LEAVE_WAIT_S = 2.0

# torchrun's options that take no value (torch/distributed/run.py: the `check_env` ones).
_BOOLEAN = {
    "--standalone", "-m", "--module", "--no-python", "--run-path", "--virtual-local-rank",
}


def _norm(flag: str) -> str:
    return flag if flag == "-m" else flag.replace("_", "-")


@dataclass
class Torchrun:
    """A torchrun command line, as far as the launcher needs it."""

    argv: List[str]
    #: Index of torchrun's first option (right after ``torchrun`` / ``-m torch.distributed.run``).
    start: int
    #: Index of the training script (the first argument that is not an option).
    end: int
    #: Normalised option name -> (value, first index, index after).
    options: Dict[str, List[Tuple[Optional[str], int, int]]] = field(default_factory=dict)
    environ: Dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> Optional[str]:
        """The option's value: the last one on the command line, else ``PET_<NAME>``."""
        found = self.options.get(name)
        if found:
            return found[-1][0]
        return self.environ.get("PET_" + name.lstrip("-").replace("-", "_").upper())

    @property
    def nodes(self) -> Tuple[int, int]:
        raw = self.get("--nnodes") or "1:1"
        lo, _, hi = raw.partition(":")
        try:
            return int(lo), int(hi or lo)
        except ValueError:
            return 1, 1

    @property
    def elastic(self) -> bool:
        lo, hi = self.nodes
        return hi > lo and self.get("--standalone") is None

    @property
    def backend(self) -> str:
        return self.get("--rdzv-backend") or "static"

    @property
    def endpoint(self) -> str:
        return self.get("--rdzv-endpoint") or ""

    @property
    def run_id(self) -> str:
        return self.get("--rdzv-id") or "none"

    @property
    def conf(self) -> Dict[str, str]:
        out: Dict[str, str] = {}
        for item in (self.get("--rdzv-conf") or "").split(","):
            key, eq, value = item.partition("=")
            if eq and key.strip():
                out[key.strip()] = value.strip()
        return out

    @property
    def max_restarts(self) -> int:
        try:
            return int(self.get("--max-restarts") or 0)
        except ValueError:
            return 0

    def rewritten(self, max_restarts: int, conf: Dict[str, str]) -> List[str]:
        """The command with ``--max-restarts`` and ``--rdzv-conf`` replaced by these values."""
        drop = set()
        for name in ("--max-restarts", "--rdzv-conf"):
            for _, a, b in self.options.get(name, []):
                drop.update(range(a, b))
        head = self.argv[: self.start]
        opts = [t for i, t in enumerate(self.argv[self.start : self.end], self.start) if i not in drop]
        extra = [f"--max-restarts={max_restarts}"]
        if conf:
            extra.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()))
        return head + extra + opts + self.argv[self.end :]


def parse_torchrun(argv: Sequence[str], environ: Optional[Dict[str, str]] = None) -> Optional[Torchrun]:
    """Find torchrun in ``argv`` (``torchrun``, ``python -m torch.distributed.run``, also after
    ``env VAR=…``) and parse its options; ``None`` when the command is not torchrun."""
    args = list(argv)
    start = None
    for i, tok in enumerate(args):
        if os.path.basename(tok) == "torchrun":
            start = i + 1
            break
        if tok == "-m" and i + 1 < len(args) and args[i + 1] in ("torch.distributed.run",):
            start = i + 2
            break
    if start is None:
        return None
    tr = Torchrun(argv=args, start=start, end=len(args), environ=dict(os.environ if environ is None else environ))
    i = start
    while i < len(args):
        tok = args[i]
        if tok == "--":
            tr.end = i
            break
        if not tok.startswith("-") or tok == "-":
            tr.end = i
            break
        name, eq, value = tok.partition("=")
        name = _norm(name)
        if eq:
            tr.options.setdefault(name, []).append((value, i, i + 1))
            i += 1
        elif name in _BOOLEAN:
            tr.options.setdefault(name, []).append(("1", i, i + 1))
            i += 1
        else:
            val = args[i + 1] if i + 1 < len(args) else None
            tr.options.setdefault(name, []).append((val, i, i + 2))
            i += 2
    else:
        tr.end = len(args)
    return tr


def elastic_command(tr: Torchrun, environ: Optional[Dict[str, str]] = None) -> Tuple[List[str], List[str]]:
    """(the command to run, what was changed): ``--max-restarts`` raised by the preemption
    allowance, ``last_call_timeout`` added when missing."""
    env = os.environ if environ is None else environ
    notes = []
    try:
        allowance = max(0, int(env.get("SPOTGUARD_PREEMPTION_RESTARTS", PREEMPTION_RESTARTS)))
    except ValueError:
        allowance = PREEMPTION_RESTARTS
    restarts = tr.max_restarts + allowance
    notes.append(f"--max-restarts={restarts} (yours {tr.max_restarts} + {allowance} for preemptions)")
    conf = tr.conf
    if "last_call_timeout" not in conf:
        conf["last_call_timeout"] = env.get("SPOTGUARD_LAST_CALL_TIMEOUT", str(LAST_CALL_S))
        notes.append(f"rdzv last_call_timeout={conf['last_call_timeout']}s (torchrun's default 30s "
                     "would keep the surviving nodes waiting that long)")
    return tr.rewritten(restarts, conf), notes


def elastic_environ(environ: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, str], List[str]]:
    """(torchrun's environment, what was changed): ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    unless set. With the store shared (torch's default since 2.5) a node that was rank 0 before
    keeps publishing its first round's address, so a node joining a later round (a replacement,
    a scale-up) waits for it until the store times out (pytorch/pytorch#135712)."""
    env = dict(os.environ if environ is None else environ)
    notes = []
    if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in env:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        notes.append("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a node joining a later round "
                     "must get that round's master address)")
    return env, notes


def _local_addr(tr: Torchrun) -> str:
    return tr.get("--local-addr") or socket.getfqdn()


def _rendezvous_modules() -> Any:
    """Import torch's rendezvous modules (slow: torch). Done in a thread at start-up so that the
    leave after a notice does not wait for ``import torch``."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    return RendezvousParameters, c10d, dr


def leave_rendezvous(tr: Torchrun, agent_pids: Iterable[int],
                     timeout: float = 10.0) -> Tuple[bool, str]:
    """Remove this node's (stopped) torchrun agents from the c10d rendezvous state: the entries
    whose address is this node's and whose pid is one of ``agent_pids``, from the participants,
    the wait list and the redundancy list, with torch's own rendezvous operations (the same
    removal an agent does for itself before it joins a new round). Returns (done, what it did)
    for the log; never raises (a failure leaves the entry to its heartbeat expiry)."""
    if tr.backend != "c10d":
        return True, (f"rendezvous backend {tr.backend!r}: the node's entry is left to its "
                      "heartbeat expiry (the launcher removes it only from a c10d rendezvous)")
    pids = set(agent_pids)
    addr = _local_addr(tr)
    try:
        RendezvousParameters, c10d, dr = _rendezvous_modules()
        lo, hi = tr.nodes
        conf: Dict[str, Any] = dict(tr.conf)
        conf["is_host"] = False  # the agent that hosted the store (if it was ours) is gone
        conf.setdefault("read_timeout", str(int(max(1, timeout))))
        params = RendezvousParameters(backend="c10d", endpoint=tr.endpoint, run_id=tr.run_id,
                                      min_nodes=lo, max_nodes=hi, local_addr=addr, **conf)
        backend, store = c10d.create_backend(params)
        handler = dr.create_handler(store, backend, params)
        holder, settings = handler._state_holder, handler._settings
        holder.sync()
        state = holder.state
        everyone = set(state.participants) | set(state.wait_list) | set(state.redundancy_list)
        mine = sorted((n for n in everyone if n.pid in pids and n.addr == addr), key=repr)
        if not mine:
            return False, f"no entry of this node's agent in rendezvous {tr.run_id!r} yet"
        Action = dr._Action

        def leave(ctx: Any, deadline: float) -> Any:
            if time.monotonic() > deadline:
                return Action.ERROR_TIMEOUT
            if ctx.node in ctx.state.participants:
                return Action.REMOVE_FROM_PARTICIPANTS
            if ctx.node in ctx.state.wait_list:
                return Action.REMOVE_FROM_WAIT_LIST
            if ctx.node in ctx.state.redundancy_list:
                return Action.REMOVE_FROM_REDUNDANCY_LIST
            return Action.FINISH

        for node in mine:
            dr._DistributedRendezvousOpExecutor(node, holder, settings).run(
                leave, time.monotonic() + timeout)
        return True, (f"removed {', '.join(map(repr, mine))} from rendezvous {tr.run_id!r} at "
                      f"{tr.endpoint}: the other nodes re-form without waiting for its "
                      "heartbeats to expire")
    except Exception as err:  # torch missing or changed, store unreachable: the expiry still works
        return False, (f"could not remove this node from rendezvous {tr.run_id!r} "
                       f"({type(err).__name__}: {err}); the other nodes drop it when its "
                       "heartbeats expire (10-15 s)")


def _say(message: str) -> None:
    print(f"spotguard launch: {message}", file=sys.stderr, flush=True)


def run(argv: Sequence[str], tr: Torchrun, forward: Iterable[int]) -> int:
    """The elastic launcher (see the module docstring). Returns the exit code for the pod, the way
    :func:`spotguard.launch` does."""
    import signal as _signal

    import spotguard as sg

    cmd, notes = elastic_command(tr)
    env, more = elastic_environ()
    _say("elastic torchrun: " + "; ".join(notes + more))
    started = time.time()
    forward = list(forward)
    # The relayed signals stay blocked until the handlers below are installed (a SIGTERM while
    # torchrun starts is relayed, not lost); torchrun itself starts with the mask unblocked.
    child, unblock = sg._start_held(cmd, forward, env)
    preload = threading.Thread(target=_try_preload, name="spotguard-launch-torch", daemon=True)
    if tr.backend == "c10d":
        preload.start()  # after the fork, and with the relayed signals blocked (inherited)
    # When torchrun was told to stop (monotonic), and whether its entry left the rendezvous.
    stopping: List[float] = []
    left: List[bool] = []
    removal: List[threading.Thread] = []  # the removal started at the notice

    def stop_agent() -> None:
        if stopping:
            return
        stopping.append(time.monotonic())
        try:
            child.send_signal(_signal.SIGTERM)
        except ProcessLookupError:
            pass

    def relay(signum: int, frame: Optional[FrameType]) -> None:
        if signum == _signal.SIGTERM and not stopping:
            stopping.append(time.monotonic())
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    def leave() -> None:
        ok, what = leave_rendezvous(tr, watch.seen_pids())
        if ok:
            left.append(True)
        _say(what)

    def leave_then_stop() -> None:
        """This node's entry out of the rendezvous first (bounded by LEAVE_WAIT_S), then the
        SIGTERM: no round formed in between can still count this node."""
        if tr.backend == "c10d":
            leaving = threading.Thread(target=leave, name="spotguard-launch-leave", daemon=True)
            leaving.start()
            removal.append(leaving)
            leaving.join(LEAVE_WAIT_S)
            if leaving.is_alive():
                _say(f"the rendezvous entry was not removed within {LEAVE_WAIT_S:g}s: "
                     "stopping torchrun anyway")
        else:
            leave()
        stop_agent()

    saved = {}
    try:
        for s in forward:
            saved[s] = _signal.signal(s, relay)
    finally:
        unblock()
    watch = sg._DirWatch(child.pid)  # the process tree every 0.5 s; notice.json every POLL_S
    try:
        while child.poll() is None:
            if not stopping:
                for directory, before in list(watch.dirs.items()):
                    nid = sg._launch_notice(Path(directory), started, before)
                    if nid:
                        _say(f"notice {nid} in {directory}: stopping torchrun so that this node "
                             "leaves the job after its checkpoint instead of restarting its workers")
                        leave_then_stop()
                        break
            time.sleep(POLL_S)
        rc = child.wait()
    finally:
        for s, previous in saved.items():
            _signal.signal(s, previous if previous is not None else _signal.SIG_DFL)
        watch.scan()
        watch.stop()
    for leaving in removal:
        leaving.join()  # bounded by leave_rendezvous's own timeout
    if stopping and not any(left):
        leave()
    return sg._launch_exit_code(list(argv), rc, watch, started)


def _try_preload() -> None:
    try:
        _rendezvous_modules()
    except Exception:
        pass
