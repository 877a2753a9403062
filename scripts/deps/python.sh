#!/usr/bin/env bash
# Installs what the Python helper's tests need (clients/python/tests): pytest, from PyPI.
# Idempotent: does nothing when pytest is already importable. torch is NOT installed here: the
# torch-specific test skips (with a reason) where torch is absent.
set -euo pipefail

PYTHON="${PYTHON:-python3}"

if "$PYTHON" -c 'import pytest' >/dev/null 2>&1; then
    echo "python deps: pytest $("$PYTHON" -c 'import pytest; print(pytest.__version__)') already installed"
    exit 0
fi

echo "python deps: installing pytest"
"$PYTHON" -m pip install --quiet --disable-pip-version-check 'pytest>=7,<9'
"$PYTHON" -c 'import pytest; print("python deps: pytest", pytest.__version__)'
