"""Horovod elastic under spotguard: the preempted host commits with everyone, then leaves.

Horovod elastic (``horovodrun --host-discovery-script SCRIPT`` + ``@hvd.elastic.run``) re-forms
the job when its discovery script stops listing a host, and on a worker failure rolls every worker
back to the last ``state.commit()``. So a preemption loses nothing when, at the notice:

1. every rank commits at the same step: :func:`should_checkpoint` agrees through an
   ``hvd.allreduce`` (MAX) of the helper's flag, as :func:`spotguard.should_checkpoint` does
   through ``torch.distributed``; then :func:`checkpoint` commits the state on every rank, saves a
   durable copy on rank 0 (your ``save`` callback: storage that outlives the job) and acks;
2. the preempted host's ranks (the ones the agent signalled) mark their host as leaving
   (:func:`leave`: a file ``<leaving dir>/<host>`` on storage the driver sees), so that the
   discovery script (:func:`hosts_main`: ``python3 -m spotguard horovod-hosts``) stops listing it,
   and every rank trains on;
3. the driver sees the host gone (its discovery runs every second) and tells the workers; from the
   checkpoint on, :func:`should_checkpoint` (given the state) checks for that every step, so every
   rank raises ``HostsUpdatedInterrupt`` at the same step: the survivors keep their state (a
   removal needs no rollback) and re-form without the host, whose workers leave
   (``hvd.init`` tells them they were removed). Nothing is lost, and the survivors barely stop.
   If the host dies first (power-off before the driver acted), the survivors fail over the
   ordinary way: they roll back to the commit made at the notice.
   A replacement host appears in the discovery output and joins at the next reset.

Discovery script (give its path to ``horovodrun --host-discovery-script``)::

    #!/bin/sh
    exec python3 -m spotguard horovod-hosts --hosts /etc/horovod/hosts --leaving /shared/leaving

Training loop::

    import horovod.torch as hvd
    import spotguard, spotguard.horovod as sgh

    spotguard.install()
    hvd.init()
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)

    @hvd.elastic.run
    def train(state):
        spotguard.resumed(state.batch)
        for batch in range(state.batch, total):
            step(batch)
            state.batch = batch + 1             # batches done
            if sgh.should_checkpoint(state):
                sgh.checkpoint(state, LEAVING, save=save_to_disk, step=state.batch)
            elif state.batch % 100 == 0:
                state.commit()

Standard library only; Horovod is imported from ``sys.modules`` (never by this module).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

import spotguard

#: Markers older than this (seconds) are ignored: a host of the same name came back.
FORGET_AFTER_S = 600.0

# Set on every rank by checkpoint(): a host may be leaving, so should_checkpoint(state) checks for
# the driver's host update every step until the reset.
_watching = False


def hostname() -> str:
    """This worker's host as horovodrun names it (``HOROVOD_HOSTNAME``), else the hostname."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def _hvd() -> Any:
    for name in ("horovod.torch", "horovod.tensorflow", "horovod.keras"):
        module = sys.modules.get(name)
        if module is not None:
            return module
    return None


def should_checkpoint(state: Any = None) -> bool:
    """Whether to checkpoint now, agreed by every Horovod rank: an ``hvd.allreduce`` (MAX) of
    this process's flag (:func:`spotguard.requested`), so that a notice seen by one host makes
    every rank checkpoint at the same step. Call it at the same point of every step in every rank.
    Without an initialised Horovod it is :func:`spotguard.should_checkpoint`.

    With ``state`` (the elastic state), after a :func:`checkpoint` it also calls
    ``state.check_host_updates()`` every step (a collective too) until the reset, so that every
    rank raises ``HostsUpdatedInterrupt`` at the same step once the driver dropped the leaving
    host."""
    global _watching
    if state is not None and _watching:
        try:
            state.check_host_updates()
        except BaseException:  # the interrupt (or a failure): hvd.elastic.run resets
            _watching = False
            raise
    hvd = _hvd()
    try:
        initialised = hvd is not None and hvd.is_initialized()
    except Exception:
        initialised = False
    if not initialised:
        return spotguard.should_checkpoint()
    local = spotguard.requested()
    torch = sys.modules.get("torch")
    if torch is None:  # horovod.tensorflow / keras: numpy allreduce
        import numpy as np  # type: ignore[import-not-found]

        value = hvd.allreduce(np.array([1 if local else 0]), op=hvd.Max, name="spotguard.flag")
        return bool(int(value[0]))
    flag = torch.tensor([1 if local else 0], dtype=torch.int32)
    return bool(hvd.allreduce(flag, op=hvd.Max, name="spotguard.flag").item())


def leave(leaving_dir: "os.PathLike[str] | str", host: Optional[str] = None) -> Path:
    """Mark ``host`` (default: this one) as leaving: ``<leaving_dir>/<host>``, written atomically,
    with the notice's id and deadline. The discovery script drops marked hosts. ``leaving_dir``
    must be storage the driver (where horovodrun runs the discovery script) sees."""
    host = host or hostname()
    if not host or "/" in host or host in (".", ".."):
        raise ValueError(f"not a host name: {host!r}")
    notice = spotguard.notice()
    body = {
        "host": host,
        "ts": time.time(),
        "notice_id": notice.notice_id if notice else None,
        "deadline_unix": notice.deadline_unix if notice else None,
    }
    path = Path(leaving_dir) / host
    spotguard._write_atomic(path, json.dumps(body).encode())
    return path


def checkpoint(
    state: Any,
    leaving_dir: "os.PathLike[str] | str",
    *,
    save: Optional[Callable[[Any], Optional[str]]] = None,
    step: Optional[int] = None,
    rank: Optional[int] = None,
) -> None:
    """At the agreed step (:func:`should_checkpoint`), on every rank: ``state.commit()`` (what
    every rank rolls back to if the preempted host dies before the driver drops it),
    ``save(state)`` on rank 0 (a durable copy; returns its path), ack ``done``; on the preempted
    host's ranks (signalled by the agent) then :func:`leave`. Every rank returns and trains on;
    :func:`should_checkpoint` with the state then raises ``HostsUpdatedInterrupt`` on every rank
    once the driver dropped the host."""
    global _watching
    state.commit()
    hvd = _hvd()
    if rank is None:
        rank = int(hvd.rank()) if hvd is not None else 0
    path = save(state) if (save is not None and rank == 0) else None
    spotguard.ack("done", step=step, checkpoint=path)
    if spotguard.requested():
        leave(leaving_dir)
    spotguard.clear()
    _watching = True


def read_hosts(path: "os.PathLike[str] | str") -> List[Tuple[str, int]]:
    """``host[:slots]`` lines (``#`` comments, blank lines skipped; slots default 1)."""
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(":")
        out.append((host.strip(), int(slots) if slots.strip() else 1))
    return out


def available_hosts(hosts: Sequence[Tuple[str, int]], leaving_dir: "os.PathLike[str] | str",
                    now: Optional[float] = None,
                    forget_after: float = FORGET_AFTER_S) -> List[Tuple[str, int]]:
    """``hosts`` less those marked leaving within the last ``forget_after`` seconds."""
    now = time.time() if now is None else now
    out = []
    for host, slots in hosts:
        try:
            marked = (Path(leaving_dir) / host).stat().st_mtime
        except OSError:
            marked = None
        if marked is not None and now - marked < forget_after:
            continue
        out.append((host, slots))
    return out


def hosts_main(argv: Sequence[str]) -> int:
    """``python3 -m spotguard horovod-hosts --hosts FILE --leaving DIR``: print ``host:slots``
    for every host of FILE not marked leaving in DIR (a ``--host-discovery-script``)."""
    p = argparse.ArgumentParser(prog="python3 -m spotguard horovod-hosts",
                                description=hosts_main.__doc__)
    p.add_argument("--hosts", required=True, help="file of host[:slots] lines (the pool)")
    p.add_argument("--leaving", required=True, help="directory of leaving-host markers")
    p.add_argument("--forget-after", type=float, default=FORGET_AFTER_S,
                   help="ignore markers older than this many seconds")
    a = p.parse_args(list(argv))
    try:
        hosts = read_hosts(a.hosts)
    except (OSError, ValueError) as err:
        print(f"spotguard horovod-hosts: {a.hosts}: {err}", file=sys.stderr)
        return 1
    for host, slots in available_hosts(hosts, a.leaving, forget_after=a.forget_after):
        print(f"{host}:{slots}")
    return 0
