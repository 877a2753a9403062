#!/usr/bin/env bash
# Builds Horovod (CPU, gloo, PyTorch; no MPI, no CUDA) from its PyPI sdist into a venv that
# already has torch, for the Horovod elastic drill of scripts/test-frameworks.sh. Not part of CI:
# it compiles for about 20 minutes on 2 cores.
#
#   bash scripts/build-horovod.sh [VENV]      # default: target/frameworks-venv
#
# Horovod 0.28.1 (the last release) needs two fixes to build against a current torch:
# - its vendored gloo asks for cmake_minimum_required < 3.5, which CMake 4 refuses: build with
#   cmake < 4 (installed here into the venv from PyPI);
# - its torch extension is compiled as C++14, and torch >= 2.8 headers require C++20
#   ("#error C++20 or later compatible compiler is required to use PyTorch"): the sdist's
#   horovod/torch/CMakeLists.txt is patched to C++20, and the top-level CMakeLists.txt (which
#   gloo inherits) to C++17: gloo built as C++14 defines Store::kDefaultTimeout out of line,
#   which the C++20 objects also define inline ("multiple definition of
#   gloo::rendezvous::Store::kDefaultTimeout" at the link).
# Exit 0 when `import horovod.torch` works in the venv afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${SPOTGUARD_FRAMEWORKS_VENV:-target/frameworks-venv}}"
VENV="$(cd "$VENV" 2>/dev/null && pwd || echo "$VENV")"
PY="$VENV/bin/python"
VERSION="${HOROVOD_VERSION:-0.28.1}"
[ -x "$PY" ] || { echo "no venv at $VENV (run scripts/test-frameworks.sh first: it installs torch)" >&2; exit 2; }
if "$PY" -c 'import horovod.torch' >/dev/null 2>&1; then
  echo "horovod: $("$PY" -c 'import horovod; print(horovod.__version__)') already built"
  exit 0
fi
"$PY" -c 'import torch' || { echo "torch is not installed in $VENV" >&2; exit 2; }
"$PY" -m pip install --quiet --disable-pip-version-check 'cmake>=3.18,<4' wheel packaging cloudpickle psutil pyyaml cffi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
  "horovod==$VERSION" -d "$work"
tar xzf "$work/horovod-$VERSION.tar.gz" -C "$work"
src="$work/horovod-$VERSION"
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 20)/' "$src/horovod/torch/CMakeLists.txt"
grep -q 'CMAKE_CXX_STANDARD 20' "$src/horovod/torch/CMakeLists.txt"
sed -i 's/^set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt"
grep -q '^set(CMAKE_CXX_STANDARD 17)' "$src/CMakeLists.txt"
echo "horovod: building $VERSION (CPU, gloo, PyTorch) in $VENV"
PATH="$VENV/bin:$PATH" \
HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS="-j${JOBS:-2}" \
  "$PY" -m pip install --no-build-isolation --no-cache-dir --disable-pip-version-check "$src"
"$PY" -c 'import horovod, horovod.torch as hvd; print("horovod", horovod.__version__, "gloo built:", hvd.gloo_built())'
