"""Tests of spotguard.staged: the staged ack and its answer, and finding the latest complete
checkpoint of a directory (the object-store side runs the binary; tests/upload.rs covers it)."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest

import spotguard
from spotguard.staged import MANIFEST_FORMAT


def _stage(root: Path, name: str = "step-12") -> Path:
    d = root / name
    (d / "sub").mkdir(parents=True)
    (d / "w.bin").write_bytes(b"weights")
    (d / "sub" / "s.pt").write_bytes(b"state")
    os.chmod(d / "w.bin", 0o600)
    os.chmod(d / "sub", 0o700)
    return d


def test_ack_staged_writes_the_request_and_times_out_without_an_agent(
    guard_dir: Path, tmp_path: Path
) -> None:
    staged = _stage(tmp_path / "local")
    link = tmp_path / "latest"
    link.symlink_to(staged)
    started = time.monotonic()
    answer = spotguard.ack_staged(link, step=12, upload="s3://bucket/run1", wait=0.3)
    assert answer.state == "timeout" and not answer.taken
    assert time.monotonic() - started < 5
    body = json.loads((guard_dir / f"ack-{os.getpid()}.json").read_text())
    # The agent follows no symlink: the helper sends the real path.
    assert body["staged"] == str(staged) == body["checkpoint"]
    assert (body["state"], body["step"], body["upload"]) == ("done", 12, "s3://bucket/run1")
    # Readable by others (the DaemonSet agent reads without override rights).
    assert stat.S_IMODE(os.stat(staged / "w.bin").st_mode) & stat.S_IROTH
    assert stat.S_IMODE(os.stat(staged / "sub").st_mode) & stat.S_IXOTH
    with pytest.raises(ValueError):
        spotguard.ack_staged(staged / "w.bin", wait=0)


def test_ack_staged_returns_the_agents_answer(guard_dir: Path, tmp_path: Path) -> None:
    staged = _stage(tmp_path / "local")
    ack = guard_dir / f"ack-{os.getpid()}.json"
    answer = guard_dir / f"upload-{os.getpid()}.json"
    guard_dir.mkdir(parents=True, exist_ok=True)
    # A stale answer of an earlier ack is not taken for this one.
    answer.write_text(json.dumps({"state": "refused", "error": "old", "ts": time.time() - 600}))

    def agent() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                body = json.loads(ack.read_text())
            except (OSError, ValueError):
                time.sleep(0.01)
                continue
            if body.get("staged"):
                answer.write_text(json.dumps({
                    "state": "taken", "destination": "s3://bucket/run1/step-12", "files": 2,
                    "bytes": 12, "error": None, "ts": time.time(),
                }))
                return

    t = threading.Thread(target=agent)
    t.start()
    got = spotguard.ack_staged(staged, step=12, wait=30)
    t.join()
    assert got.taken, got
    assert (got.destination, got.files, got.bytes) == ("s3://bucket/run1/step-12", 2, 12)


def test_an_answer_another_user_planted_or_linked_in_is_not_the_agents(
    guard_dir: Path, tmp_path: Path
) -> None:
    """Issue 29 (acks): a `taken` at this process's answer name counts only when the agent (root)
    or this process's own user wrote it, with one link and not writable by others."""
    staged = _stage(tmp_path / "local")
    guard_dir.mkdir(parents=True, exist_ok=True)
    ack = guard_dir / f"ack-{os.getpid()}.json"
    answer = guard_dir / f"upload-{os.getpid()}.json"
    body = json.dumps({"state": "taken", "destination": "s3://b/x", "files": 1, "bytes": 1,
                       "error": None, "ts": time.time() + 3600})
    elsewhere = tmp_path / "shared.log"
    elsewhere.write_text(body)

    def linked() -> None:
        os.link(elsewhere, answer)  # this user's own file, but linked in from elsewhere

    def world_writable() -> None:
        answer.write_text(body)
        os.chmod(answer, 0o666)

    def foreign() -> None:
        answer.write_text(body)
        os.chown(answer, 1001, 1001)

    def own() -> None:
        answer.write_text(body)

    def planted(plant) -> str:
        ack.unlink(missing_ok=True)

        def run() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not ack.exists():
                time.sleep(0.005)
            plant()

        t = threading.Thread(target=run)
        t.start()
        got = spotguard.ack_staged(staged, step=12, wait=1.0)
        t.join()
        answer.unlink(missing_ok=True)
        return got.state

    assert planted(linked) == "timeout"
    assert planted(world_writable) == "timeout"
    if os.geteuid() == 0:
        assert planted(foreign) == "timeout"
    assert planted(own) == "taken"


def _manifest(directory: Path, name: str, step, completed: str, ok: bool = True,
              part=None, path: str = "w", writer=None) -> None:
    d = directory / name
    d.mkdir(parents=True, exist_ok=True)
    if _clean(path):
        (d / path).parent.mkdir(parents=True, exist_ok=True)
        (d / path).write_bytes(b"x")
    m = {
        "format": MANIFEST_FORMAT,
        "name": name,
        "step": step,
        "files": [{"path": path, "size": 1, "crc64nvme": "0" * 16, "crc32c": "0" * 8,
                   "verified_by": "written"}],
        "file_count": 1,
        "bytes": 1 if ok else 2,
        "timings": {"completed_at": completed},
    }
    if writer is not None:
        m["writer"] = writer
    if part is None:
        (d / "manifest.json").write_text(json.dumps(m))
    else:
        m["part"] = {"index": part[0], "count": part[1]}
        (d / f"manifest.part-{part[0]}-of-{part[1]}.json").write_text(json.dumps(m))


def _clean(path: str) -> bool:
    return bool(path) and not path.startswith("/") and ".." not in path.split("/") \
        and "" not in path.split("/") and "\0" not in path


def _mark_owner(directory: Path, writer: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".spotguard-location.json").write_text(json.dumps(
        {"format": "spotguard-location/1", "writer": writer,
         "created_at": "2026-01-01T00:00:00Z"}))


def test_only_the_owners_checkpoints_with_steps_their_names_prove_count(tmp_path: Path) -> None:
    owner = "k8s:ml/JobSet/train-a"
    _manifest(tmp_path, "step-100", 100, "2026-01-01T00:00:00Z", writer=owner)
    # Another job's with a higher step; steps the names do not prove; an absurd name.
    _manifest(tmp_path, "step-900", 900, "2026-01-02T00:00:00Z", writer="host:uid:1001")
    _manifest(tmp_path, "step-201", 2**64 - 1, "2026-01-02T00:00:00Z", writer=owner)
    _manifest(tmp_path, "step-18446744073709551615", None, "2026-01-02T00:00:00Z", writer=owner)
    _manifest(tmp_path, "final", 5000, "2026-01-02T00:00:00Z", writer=owner)
    # Without a marker (a location of an earlier release) every consistent manifest counts.
    assert spotguard.latest_checkpoint(tmp_path).name == "step-900"
    _mark_owner(tmp_path, owner)
    latest = spotguard.latest_checkpoint(tmp_path)
    assert (latest.name, latest.step) == ("step-100", 100)
    # A step left out is the one the name proves.
    _manifest(tmp_path, "step-150", None, "2026-01-01T00:00:00Z", writer=owner)
    assert (spotguard.latest_checkpoint(tmp_path).name,
            spotguard.latest_checkpoint(tmp_path).step) == ("step-150", 150)
    # A marker that cannot be read trusts nothing.
    (tmp_path / ".spotguard-location.json").write_bytes(b" " * (70 << 10))
    with pytest.raises(ValueError, match="owner marker"):
        spotguard.latest_checkpoint(tmp_path)


def test_a_manifest_naming_paths_outside_its_checkpoint_is_not_one(tmp_path: Path) -> None:
    _manifest(tmp_path, "step-5", 5, "2026-01-01T00:00:00Z")
    for step, path in enumerate(["/etc/hostname", "../x", "a//b", "./w", "a\nb",
                                 "manifest.json", "w.spotguard-part-h-1"], start=10):
        _manifest(tmp_path, f"step-{step}", step, "2026-01-02T00:00:00Z", path=path)
    assert spotguard.latest_checkpoint(tmp_path).name == "step-5"
    # What a staged tree legitimately holds stays valid.
    for step, path in enumerate(["a\\b", "%25", "q?x#y", "sub/manifest.json", "caf\u00e9"],
                                start=20):
        _manifest(tmp_path, f"step-{step}", step, "2026-01-03T00:00:00Z", path=path)
        assert spotguard.latest_checkpoint(tmp_path).name == f"step-{step}", path
    # A path listed twice, and a manifest past its cap, do not count either.
    d = tmp_path / "step-90"
    d.mkdir()
    f = {"path": "w", "size": 1, "crc64nvme": "0" * 16, "crc32c": "0" * 8,
         "verified_by": "written"}
    (d / "manifest.json").write_text(json.dumps({
        "format": MANIFEST_FORMAT, "name": "step-90", "step": 90, "files": [f, f],
        "file_count": 2, "bytes": 2, "timings": {"completed_at": "2026-01-04T00:00:00Z"}}))
    d = tmp_path / "step-91"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({
        "format": MANIFEST_FORMAT, "name": "step-91", "step": 91, "files": [f],
        "file_count": 1, "bytes": 1, "timings": {"completed_at": "2026-01-04T00:00:00Z"},
        "pad": " " * (16 << 20)}))
    assert spotguard.latest_checkpoint(tmp_path).name == "step-24"


def test_latest_checkpoint_of_a_directory(tmp_path: Path) -> None:
    assert spotguard.latest_checkpoint(tmp_path / "none") is None
    assert spotguard.latest_checkpoint(tmp_path) is None
    _manifest(tmp_path, "step-100", 100, "2026-01-01T00:00:00Z")
    _manifest(tmp_path, "step-90", 90, "2026-01-02T00:00:00Z")
    _manifest(tmp_path, "step-300", 300, "2026-01-03T00:00:00Z", ok=False)  # inconsistent
    (tmp_path / "step-400").mkdir()  # an upload cut off by the deadline: no manifest
    (tmp_path / "step-400" / "w").write_bytes(b"partial")
    latest = spotguard.latest_checkpoint(tmp_path)
    assert latest is not None
    assert (latest.name, latest.step) == ("step-100", 100)
    assert latest.location == str(tmp_path / "step-100") == latest.local_path
    # Equal steps: the later completion wins, to the nanosecond.
    _manifest(tmp_path, "step-100b", 100, "2026-01-01T00:00:00.000000001Z")
    assert spotguard.latest_checkpoint(f"file://{tmp_path}").name == "step-100b"


def test_a_multi_node_checkpoint_counts_once_every_part_is_there(tmp_path: Path) -> None:
    _manifest(tmp_path, "step-100", 100, "2026-01-01T00:00:00Z")
    _manifest(tmp_path, "step-200", 200, "2026-01-02T00:00:00Z", part=(0, 2), path="a")
    assert spotguard.latest_checkpoint(tmp_path).name == "step-100"
    _manifest(tmp_path, "step-200", 200, "2026-01-02T00:00:05Z", part=(1, 2), path="b")
    latest = spotguard.latest_checkpoint(tmp_path)
    assert (latest.name, latest.step) == ("step-200", 200)
    assert [f["path"] for f in latest.manifest["files"]] == ["a", "b"]
    assert latest.manifest["timings"]["completed_at"] == "2026-01-02T00:00:05Z"


def test_ack_staged_sends_the_part(guard_dir: Path, tmp_path: Path) -> None:
    staged = _stage(tmp_path / "local")
    spotguard.ack_staged(staged, step=1, part=(1, 4), wait=0)
    body = json.loads((guard_dir / f"ack-{os.getpid()}.json").read_text())
    assert body["part"] == {"index": 1, "count": 4}
    with pytest.raises(ValueError):
        spotguard.ack_staged(staged, part=(4, 4), wait=0)
