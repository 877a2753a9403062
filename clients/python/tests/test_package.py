"""The installed wheel (`pip install spotguard`): the package, its metadata, `python -m spotguard`,
and the `spotguard` binary it carries, driving a drill against a trainer that uses the installed
package. scripts/test.sh runs these in a fresh venv; with SPOTGUARD_TEST_SOURCE=1 the tests that
need the installed wheel skip."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import CLIENT_DIR, FROM_SOURCE, REPO_ROOT

import spotguard

installed_only = pytest.mark.skipif(FROM_SOURCE, reason="tests the installed wheel (scripts/test.sh)")


def binary() -> str:
    """The `spotguard` the wheel installed next to this interpreter."""
    path = Path(sys.executable).parent / "spotguard"
    assert path.is_file() and os.access(path, os.X_OK), f"no spotguard binary at {path}"
    return str(path)


@installed_only
def test_the_package_comes_from_the_installed_wheel() -> None:
    here = Path(spotguard.__file__).resolve()
    assert CLIENT_DIR not in here.parents, f"imported from the checkout: {here}"
    assert "site-packages" in here.parts
    # Typed (PEP 561), and the optional framework modules are inside.
    pkg = here.parent
    assert (pkg / "py.typed").is_file()
    for module in ("lightning.py", "hf.py", "__main__.py"):
        assert (pkg / module).is_file(), module


@installed_only
def test_versions_agree_wheel_helper_binary() -> None:
    from importlib.metadata import requires, version

    assert version("spotguard") == spotguard.__version__
    assert requires("spotguard") is None  # zero dependencies
    out = subprocess.run([binary(), "--version"], capture_output=True, text=True, check=True)
    # `spotguard 0.1.0 (commit abc123…)`: the version, then the commit it was built from.
    words = out.stdout.split()
    assert words[:2] == ["spotguard", spotguard.__version__]
    assert words[2:3] == ["(commit"], out.stdout


def test_protocol_version_is_the_documented_one() -> None:
    doc = (REPO_ROOT / "docs" / "checkpoint-protocol.md").read_text()
    assert spotguard.PROTOCOL_VERSION == 1
    assert f"v{spotguard.PROTOCOL_VERSION}" in doc.splitlines()[0] + doc[:2000]


def test_importing_spotguard_imports_no_framework() -> None:
    code = ("import sys, spotguard\n"
            "print(sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules))")
    env = dict(os.environ)
    if FROM_SOURCE:
        env["PYTHONPATH"] = str(CLIENT_DIR)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module, framework", [("spotguard.lightning", "lightning"),
                                               ("spotguard.hf", "transformers")])
def test_framework_modules_need_their_framework(module: str, framework: str) -> None:
    if importlib.util.find_spec(framework) is not None:
        pytest.skip(f"{framework} is installed (scripts/test-frameworks.sh drills it)")
    with pytest.raises(ImportError):
        __import__(module)


@installed_only
def test_python_dash_m_spotguard_launch(tmp_path: Path) -> None:
    guard = tmp_path / "guard"
    guard.mkdir()
    env = dict(os.environ, SPOTGUARD_DIR=str(guard))
    usage = subprocess.run([sys.executable, "-m", "spotguard"], capture_output=True, text=True,
                           env=env)
    assert usage.returncode == 64 and "usage: python3 -m spotguard launch" in usage.stderr
    worker = ("import sys, spotguard; spotguard.install(); spotguard.ack('done', step=2); "
              "sys.exit(143)")
    fake_torchrun = f"import subprocess, sys; sys.exit(1 if subprocess.call([sys.executable, '-c', {worker!r}]) else 0)"
    run = subprocess.run([sys.executable, "-m", "spotguard", "launch", "--", sys.executable, "-c",
                          fake_torchrun], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 143, run.stderr


TRAINER = """
import os, sys, time
import spotguard

assert "site-packages" in spotguard.__file__, spotguard.__file__
time.sleep(float(sys.argv[1]))          # a slow start-up, like `import torch`
spotguard.install()
step = 0
while True:
    step += 1
    time.sleep(0.02)
    if spotguard.should_checkpoint():
        spotguard.ack("done", step=step, checkpoint=f"/ckpt/{step}")
        spotguard.exit_after_checkpoint()
"""


@installed_only
def test_the_wheels_binary_drills_a_trainer_using_the_installed_package(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAINER))
    junit = tmp_path / "drill.xml"
    out = subprocess.run(
        [binary(), "drill", "--after", "1s", "--json", "--junit", str(junit), "--",
         sys.executable, str(script), "3"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (run,) = json.loads(out.stdout)["runs"]
    assert run["pass"] is True and run["exit"]["code"] == 143
    assert run["handler"]["found"] and run["handler"]["after_start_s"] >= 2.9
    (ack,) = run["acks"]
    assert ack["state"] == "done" and ack["checkpoint"] == f"/ckpt/{ack['step']}"
    assert ack["note"] is None
    assert 'failures="0"' in junit.read_text()


@installed_only
def test_the_wheels_binary_runs_the_bundled_drill() -> None:
    out = subprocess.run([binary(), "drill", "--after", "1s"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verdict: PASS" in out.stdout


def test_the_binary_is_on_path_in_the_venv() -> None:
    if FROM_SOURCE:
        pytest.skip("tests the installed wheel (scripts/test.sh)")
    assert shutil.which("spotguard") == binary()


def _wheel(folder: str) -> Path:
    found = sorted((REPO_ROOT / "target" / folder).glob("spotguard-*.whl"))
    if not found:
        pytest.skip(f"no wheel in target/{folder} (scripts/test.sh builds it)")
    return found[-1]


@installed_only
def test_the_pure_python_wheel_carries_the_same_helper_as_the_binary_wheel() -> None:
    """`pip install ./clients/python` (setuptools, any platform) and `pip install spotguard`
    (maturin, with the binary) build from the same sources: the same package files, byte for
    byte, the same version; only the binary wheel has the binary."""
    import zipfile

    def package(z: zipfile.ZipFile) -> dict:
        return {n: z.read(n) for n in z.namelist()
                if n.startswith("spotguard/") and "__pycache__" not in n}

    pure, full = _wheel("wheels-pure"), _wheel("wheels")
    assert pure.name == f"spotguard-{spotguard.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(pure) as p, zipfile.ZipFile(full) as f:
        assert package(p) == package(f)
        assert not [n for n in p.namelist() if n.endswith("/spotguard") or ".data/" in n]
        assert [n for n in f.namelist() if n.endswith(".data/scripts/spotguard")]
    sources = {f"spotguard/{x.name}": x.read_bytes()
               for x in (CLIENT_DIR / "spotguard").iterdir() if x.is_file()}
    with zipfile.ZipFile(pure) as p:
        assert package(p) == sources
