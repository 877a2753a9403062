"""Staged checkpoints: save to local disk in seconds, ack, exit; spotguard ships the files.

A preemption notice leaves 30 s (GCE) to 2 min (EC2). Writing tens of GB of shards to S3, GCS or
a shared filesystem takes minutes; writing them to local NVMe takes seconds. With a *staged*
ack the trainer saves to a local directory, tells the agent where it is and where it belongs,
waits for the agent's answer (``taken``: every file is open in the agent) and exits; the agent
uploads the directory with the rest of the notice's time and publishes it with a
``manifest.json`` written last. A checkpoint without a manifest does not exist for readers, so a
cut-off upload never shadows the last complete one. Protocol: ``docs/checkpoint-protocol.md``
("Staged checkpoints").

With torch distributed checkpointing::

    import torch.distributed.checkpoint as dcp
    import spotguard

    spotguard.install()
    ...
    if spotguard.should_checkpoint():
        path = f"/local/ckpt/step-{step}"          # an emptyDir on local NVMe
        dcp.save(state, checkpoint_id=path)        # every rank writes its shards
        torch.distributed.barrier()
        answer = spotguard.ack_staged(path, step=step, upload="s3://bucket/run1")
        if not answer.taken:                       # refused or no agent: save durably yourself
            dcp.save(state, checkpoint_id=f"s3-mounted-or-shared-path/step-{step}")
        spotguard.exit_after_checkpoint()

and on the replacement, before training::

    latest = spotguard.latest_checkpoint("s3://bucket/run1")   # or a local/EFS directory
    if latest is not None:
        dcp.load(state, checkpoint_id=latest.local_path or ...)

Standard library only. For ``s3://`` and ``gs://`` locations :func:`latest_checkpoint` runs the
``spotguard`` binary (installed with this package by ``pip install spotguard``; else give
``binary=`` or set ``$SPOTGUARD_BIN``); local and ``file://`` locations are read directly.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

#: The ``format`` of every manifest spotguard writes; others are ignored.
MANIFEST_FORMAT = "spotguard-checkpoint/1"

#: The commit marker at the top of an uploaded checkpoint.
MANIFEST_NAME = "manifest.json"

#: Manifests larger than this are not read.
MANIFEST_MAX_BYTES = 16 << 20

#: The owner marker of a location (``<location>/.spotguard-location.json``): when it is there,
#: only manifests naming its ``writer`` count.
MARKER_NAME = ".spotguard-location.json"
MARKER_FORMAT = "spotguard-location/1"
MARKER_MAX_BYTES = 64 << 10

#: The greatest step a checkpoint may carry (2^53 - 1).
MAX_STEP = (1 << 53) - 1

#: How long :func:`ack_staged` waits for the agent's answer by default (seconds). The agent
#: answers within its ack poll (50 ms) plus the time to open the files (milliseconds).
DEFAULT_WAIT = 15.0

_PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class StagedAnswer:
    """The agent's answer to a staged ack.

    ``state`` is ``taken`` (every staged file is open in the agent: exit whenever you like),
    ``refused`` (``error`` says why: the destination is not allowed, a symlink or FIFO in the
    tree, a file the agent may not read, …) or ``timeout`` (no answer within ``wait``: no agent,
    an agent without uploads, or a late one).
    """

    state: str
    destination: Optional[str] = None
    files: Optional[int] = None
    bytes: Optional[int] = None
    error: Optional[str] = None

    @property
    def taken(self) -> bool:
        return self.state == "taken"


@dataclass(frozen=True)
class LatestCheckpoint:
    """A complete checkpoint: its directory (URL or path), name, step and manifest."""

    location: str
    name: str
    step: Optional[int]
    manifest: Dict[str, Any] = field(repr=False)
    #: Where ``spotguard prefetch --latest-checkpoint LOCATION DEST`` put it, if it was fetched.
    local_path: Optional[str] = None

    @property
    def interruption(self) -> Optional[Dict[str, Any]]:
        """The interruption this checkpoint was saved at, from its manifest (the agent writes the
        notice, the node it ran on and when the trainer's ``done`` ack was seen), in the shape of
        a checkpoint sidecar (``{"v", "notice_id", "node", "kind", "source", "step",
        "saved_ts"}``); None when it was not saved after a notice or the manifest does not say.
        :func:`spotguard.resumed` takes it from here when given this checkpoint."""
        m = self.manifest if isinstance(self.manifest, dict) else {}
        n = m.get("notice")
        if not isinstance(n, dict) or not isinstance(n.get("id"), str):
            return None
        secs, nanos = _parse_time((m.get("timings") or {}).get("acked_at")
                                  if isinstance(m.get("timings"), dict) else None)
        if secs == 0:
            return None
        node = (m.get("origin") or {}).get("node") if isinstance(m.get("origin"), dict) else None
        return {"v": 1, "notice_id": n["id"], "node": node, "kind": n.get("kind"),
                "source": n.get("source"), "step": m.get("step"),
                "saved_ts": secs + nanos / 1e9}


def answer_path(pid: Optional[int] = None) -> Path:
    """``<dir>/upload-<pid>.json``: where the agent answers this process's staged ack."""
    from . import checkpoint_dir

    return checkpoint_dir() / f"upload-{os.getpid() if pid is None else pid}.json"


def _make_readable(root: str) -> None:
    """Let others read the tree (o+r files, o+x directories): the DaemonSet agent reads as root
    without CAP_DAC_OVERRIDE, so permission bits apply to it like to anyone else."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            try:
                st = os.lstat(name)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                want = st.st_mode | stat.S_IROTH | stat.S_IXOTH
            elif stat.S_ISREG(st.st_mode):
                want = st.st_mode | stat.S_IROTH
            else:
                continue
            if want != st.st_mode and st.st_uid == os.geteuid():
                os.chmod(name, stat.S_IMODE(want))


def _read_answer(path: Path, after: float) -> Optional[StagedAnswer]:
    # Only the agent's own answer counts: a regular file with one link, owned by root (the agent)
    # or by this process's own user, that other users cannot write. A file another user planted
    # at this name (or linked in: a hard link keeps its owner) could otherwise say `taken` and
    # make this process exit while its checkpoint was never taken.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_nlink != 1
                or st.st_uid not in (0, os.geteuid()) or st.st_mode & stat.S_IWOTH):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = json.loads(f.read(64 * 1024))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict) or data.get("state") not in ("taken", "refused"):
        return None
    ts = data.get("ts")
    if isinstance(ts, (int, float)) and ts + 1.0 < after:
        return None  # an answer to an earlier ack (1 s of clock slack: same machine)
    return StagedAnswer(
        state=data["state"],
        destination=data.get("destination"),
        files=data.get("files"),
        bytes=data.get("bytes"),
        error=data.get("error"),
    )


def ack_staged(
    staged: _PathLike,
    *,
    step: Optional[int] = None,
    upload: Optional[str] = None,
    wait: float = DEFAULT_WAIT,
    make_readable: bool = True,
    part: Optional[Tuple[int, int]] = None,
) -> StagedAnswer:
    """Ack ``done`` for a checkpoint saved in the local directory ``staged`` and wait for the
    agent to take it.

    The job's location is the pod's ``spotguard.io/checkpoint-upload`` annotation (host mode:
    ``--checkpoint-upload``; ``s3://bucket/prefix``, ``gs://bucket/prefix`` or a directory such
    as an EFS mount); ``upload`` may only name that location or a place below it (anything else,
    or no bound location at all, is refused). ``step``, if given, must be the number the
    directory's name carries (``step-1200`` → 1200).
    The checkpoint lands in ``<upload>/<basename of staged>/`` with ``manifest.json`` last, so
    name the directory after the step (``step-1200``). The path is resolved
    (``os.path.realpath``: the agent follows no symlink) and, with ``make_readable``, the tree
    is made readable by others (the agent reads as a user without override rights).

    ``part=(node_index, node_count)`` when several nodes save one checkpoint (each node stages
    its own ranks' shards under the same directory name): each node's agent uploads its share
    with a manifest of its own, and the checkpoint is complete once every part is.

    Waits at most ``wait`` seconds (never past the notice's checkpoint deadline) for the agent's
    answer and returns it; once it is ``taken`` the process may exit at once — the upload no
    longer needs it, its container or its files' names. Raises ``ValueError`` when ``staged`` is
    not a directory.
    """
    from . import _current_notice_id, _mark_durable, _write_atomic, ack_path, time_left

    real = os.path.realpath(os.fspath(staged))
    if not os.path.isdir(real):
        raise ValueError(f"staged checkpoint {real!r} is not a directory")
    if step is not None:
        if isinstance(step, bool):
            raise ValueError(f"step must be an int or None, got {step!r}")
        step = int(step)
    if part is not None:
        index, count = (int(x) for x in part)
        if not 0 <= index < count <= 10_000:
            raise ValueError(f"part must be (index, count) with 0 <= index < count; got {part!r}")
    if make_readable:
        _make_readable(real)
    answer = answer_path()
    try:
        os.unlink(answer)
    except OSError:
        pass
    body: Dict[str, Any] = {
        "state": "done",
        "step": step,
        "checkpoint": real,
        "staged": real,
        "ts": time.time(),
    }
    if upload:
        body["upload"] = upload
    if part is not None:
        body["part"] = {"index": index, "count": count}
    notice_id = _current_notice_id()
    if notice_id:
        body["notice_id"] = notice_id
    started = time.time()
    _write_atomic(ack_path(), json.dumps(body, separators=(",", ":")).encode())
    left = time_left()
    budget = wait if left is None else max(0.0, min(wait, left))
    deadline = time.monotonic() + budget
    while True:
        got = _read_answer(answer, started)
        if got is not None:
            if got.taken and step is not None:
                _mark_durable(step, real)
            return got
        if time.monotonic() >= deadline:
            return StagedAnswer(state="timeout")
        time.sleep(0.02)


def _parse_time(text: Any) -> Tuple[int, int]:
    """RFC 3339 ``YYYY-MM-DDTHH:MM:SS[.fraction]Z`` as (seconds, nanoseconds); (0, 0) if not."""
    import calendar

    if not isinstance(text, str) or not text.endswith("Z"):
        return (0, 0)
    main, _, frac = text[:-1].partition(".")
    try:
        secs = calendar.timegm(time.strptime(main, "%Y-%m-%dT%H:%M:%S"))
        nanos = int((frac + "000000000")[:9]) if frac else 0
    except ValueError:
        return (0, 0)
    return (secs, nanos)


def _clean_path(path: Any) -> bool:
    """A file path a manifest may list: a clean relative key, as the upload side writes them
    (``/``-separated non-empty segments, none ``.`` or ``..``, no NUL or control characters, not
    the part-file infix, segments of at most 255 bytes, no manifest's name at the top)."""
    if not isinstance(path, str) or not path or path.startswith("/"):
        return False
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in path):
        return False
    if ".spotguard-part-" in path:
        return False
    for i, seg in enumerate(path.split("/")):
        if seg in ("", ".", "..") or len(seg.encode("utf-8", "surrogatepass")) > 255:
            return False
        if i == 0 and (seg == MANIFEST_NAME or seg.startswith("manifest.part-")):
            return False
    return True


def _valid_manifest(data: Any, name: str, part: Optional[Tuple[int, int]]) -> bool:
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        return False
    files = data.get("files")
    if data.get("name") != name or not isinstance(files, list):
        return False
    got = data.get("part")
    if (None if got is None else (got.get("index"), got.get("count"))) != part:
        return False
    try:
        total = sum(int(f["size"]) for f in files)
        paths = [f["path"] for f in files]
    except (KeyError, TypeError, ValueError):
        return False
    if not all(_clean_path(p) for p in paths) or len(set(paths)) != len(paths):
        return False
    return data.get("file_count") == len(files) and data.get("bytes") == total


def _checkpoint_name(name: str) -> bool:
    """Letters, digits, ``-``, ``_``, ``.``; not starting with ``.``; at most 100 characters."""
    return (0 < len(name) <= 100 and not name.startswith(".")
            and all(c.isascii() and (c.isalnum() or c in "-_.") for c in name))


def _step_of_name(name: str) -> Tuple[bool, Optional[int]]:
    """``(ok, step)``: the step a checkpoint's name proves (its last run of ASCII digits);
    ``ok`` is false when the digits exceed :data:`MAX_STEP`."""
    end = len(name)
    while end > 0 and not ("0" <= name[end - 1] <= "9"):
        end -= 1
    if end == 0:
        return True, None
    start = end
    while start > 0 and "0" <= name[start - 1] <= "9":
        start -= 1
    step = int(name[start:end])
    return step <= MAX_STEP, step if step <= MAX_STEP else None


def _owned(data: Dict[str, Any], name: str, owner: Optional[str]) -> bool:
    """The manifest is the location owner's (when it has one) and its step agrees with its
    name; its ``step`` is then the one the name proves."""
    if owner is not None and data.get("writer") != owner:
        return False
    ok, proved = _step_of_name(name)
    claimed = data.get("step")
    if not ok or (claimed is not None and (type(claimed) is not int or claimed != proved)):
        return False
    data["step"] = proved
    return True


def _manifest_part(name: str) -> Optional[Tuple[Optional[Tuple[int, int]]]]:
    """``(None,)`` for ``manifest.json``, ``((i, n),)`` for a part's manifest, else ``None``."""
    if name == MANIFEST_NAME:
        return (None,)
    if not (name.startswith("manifest.part-") and name.endswith(".json")):
        return None
    i, sep, n = name[len("manifest.part-"):-len(".json")].partition("-of-")
    if not (sep and i.isdigit() and n.isdigit()):
        return None
    index, count = int(i), int(n)
    if not 0 <= index < count <= 10_000 or name != f"manifest.part-{index}-of-{count}.json":
        return None
    return ((index, count),)


def _complete(manifests: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The single manifest, or every part merged (same name, step and count; all indices)."""
    for m in manifests:
        if m.get("part") is None:
            return m
    if not manifests:
        return None
    manifests = sorted(manifests, key=lambda m: m["part"]["index"])
    count = manifests[0]["part"]["count"]
    if [m["part"]["index"] for m in manifests] != list(range(count)):
        return None
    first = manifests[0]
    files: Dict[str, Dict[str, Any]] = {}
    for m in manifests:
        if (m.get("name"), m.get("step"), m["part"]["count"]) != (first.get("name"),
                                                                  first.get("step"), count):
            return None
        for f in m["files"]:
            if f["path"] in files and files[f["path"]] != f:
                return None
            files[f["path"]] = f
    merged = dict(first)
    merged["part"] = None
    merged["files"] = [files[p] for p in sorted(files)]
    merged["file_count"] = len(files)
    merged["bytes"] = sum(int(f["size"]) for f in files.values())
    merged["timings"] = dict(max((m.get("timings") or {} for m in manifests),
                                 key=lambda t: _parse_time(t.get("completed_at"))))
    return merged


def _order_key(m: Dict[str, Any]) -> Tuple[bool, int, Tuple[int, int], str]:
    step = m.get("step")
    completed = (m.get("timings") or {}).get("completed_at")
    return (isinstance(step, int), step if isinstance(step, int) else 0, _parse_time(completed),
            m.get("name", ""))


def _read_capped(path: str, cap: int) -> Tuple[bool, Optional[bytes]]:
    """``(present, data)`` of a regular file read without following a symlink or blocking on a
    FIFO; ``data`` is None when it is larger than ``cap``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False, None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False, None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(cap + 1)
        return True, (data if len(data) <= cap else None)
    except OSError:
        return False, None
    finally:
        os.close(fd)


def _read_manifest(path: str) -> Any:
    _, data = _read_capped(path, MANIFEST_MAX_BYTES)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def _owner(directory: str) -> Optional[str]:
    """The writer the location's owner marker names; None without a marker. A marker that
    cannot be read raises ``ValueError``: no checkpoint of the location is trusted then."""
    path = os.path.join(directory, MARKER_NAME)
    present, data = _read_capped(path, MARKER_MAX_BYTES)
    if not present:
        return None
    try:
        if data is None:
            raise ValueError(f"larger than {MARKER_MAX_BYTES} bytes")
        marker = json.loads(data)
        if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
            raise ValueError(f"not a {MARKER_FORMAT} marker")
        writer = marker.get("writer")
        if not isinstance(writer, str) or not writer:
            raise ValueError("no writer")
    except ValueError as e:
        raise ValueError(f"the location's owner marker {path} cannot be read: {e}; "
                         "no checkpoint under it is taken") from None
    return writer


def _latest_local(directory: str) -> Optional[LatestCheckpoint]:
    best: Optional[Dict[str, Any]] = None
    best_dir = ""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return None
    owner = _owner(directory)
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False) or not _checkpoint_name(entry.name):
            continue
        manifests = []
        for inner in os.scandir(entry.path):
            kind = _manifest_part(inner.name)
            if kind is None:
                continue
            data = _read_manifest(inner.path)
            if _valid_manifest(data, entry.name, kind[0]) and _owned(data, entry.name, owner):
                manifests.append(data)
        data = _complete(manifests)
        if data is not None and (best is None or _order_key(data) > _order_key(best)):
            best, best_dir = data, entry.path
    if best is None:
        return None
    step = best.get("step")
    return LatestCheckpoint(location=best_dir, name=best["name"],
                            step=step if isinstance(step, int) else None, manifest=best,
                            local_path=best_dir)


def _binary(binary: Optional[str]) -> str:
    found = binary or os.environ.get("SPOTGUARD_BIN") or shutil.which("spotguard")
    if not found:
        raise FileNotFoundError(
            "finding the latest checkpoint in an object store needs the spotguard binary "
            "(pip install spotguard ships it; else pass binary= or set SPOTGUARD_BIN)")
    return found


def latest_checkpoint(
    location: _PathLike,
    *,
    fetch_to: Optional[_PathLike] = None,
    endpoint: Optional[str] = None,
    binary: Optional[str] = None,
) -> Optional[LatestCheckpoint]:
    """The latest complete checkpoint under ``location`` (``s3://bucket/prefix``,
    ``gs://bucket/prefix``, ``file:///dir`` or a directory), or ``None`` when there is none yet.

    A checkpoint is a directory right under the location with a valid ``manifest.json`` (one
    that spotguard wrote last, after every file; every file path a clean relative key); uploads
    cut off by a deadline have none and do not count. When the location has an owner marker
    (``.spotguard-location.json``) only its writer's manifests count; a manifest whose step
    disagrees with its directory's name never does. The latest has the greatest step, then the
    latest completion time.

    Local locations without ``fetch_to`` are read here and returned in place, unverified (a
    marker that cannot be read raises ``ValueError``). Object stores go through ``spotguard prefetch
    --latest-checkpoint`` (the agent's own credentials chain: ``AWS_*``, IRSA, the instance
    role; ``GOOGLE_*``, the metadata server; ``endpoint`` for S3-compatible servers); with
    ``fetch_to`` (any location) the binary fetches only the manifest's files into
    ``<fetch_to>/<name>`` (``local_path``) and checks every file's CRC-64/NVME and CRC-32C
    against the manifest (Python's standard library has neither); a mismatch raises
    ``RuntimeError`` naming the file.
    """
    text = os.fspath(location)
    if text.startswith("file://"):
        text = text[len("file://"):]
    local = not (text.startswith("s3://") or text.startswith("gs://"))
    if local and fetch_to is None:
        return _latest_local(text)
    cmd: List[str] = [_binary(binary), "prefetch", "--latest-checkpoint", os.fspath(location)]
    if fetch_to is not None:
        cmd += [os.fspath(fetch_to), "--progress", "none"]
    if endpoint:
        cmd += ["--endpoint", endpoint]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    found = json.loads(lines[-1]) if lines else None
    if found is None:
        return None
    step = found.get("step")
    return LatestCheckpoint(location=found["checkpoint"], name=found["name"],
                            step=step if isinstance(step, int) else None,
                            manifest=found.get("manifest") or {}, local_path=found.get("local"))
