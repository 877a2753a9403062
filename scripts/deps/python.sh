#!/usr/bin/env bash
# Installs what the Python side of scripts/test.sh needs, from PyPI: pytest (the helper's tests)
# and maturin (builds the `pip install spotguard` wheel). Idempotent: installs only what is
# missing. torch is NOT installed here (scripts/test-frameworks.sh does that, in its own venv);
# the torch-specific tests skip (with a reason) where torch is absent.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
PIP=("$PYTHON" -m pip install --quiet --disable-pip-version-check)

if "$PYTHON" -c 'import pytest' >/dev/null 2>&1; then
    echo "python deps: pytest $("$PYTHON" -c 'import pytest; print(pytest.__version__)') already installed"
else
    echo "python deps: installing pytest"
    "${PIP[@]}" 'pytest>=7,<9'
fi

if "$PYTHON" -m maturin --version >/dev/null 2>&1; then
    echo "python deps: $("$PYTHON" -m maturin --version) already installed"
else
    echo "python deps: installing maturin"
    "${PIP[@]}" 'maturin>=1.9,<2'
    "$PYTHON" -m maturin --version
fi
"$PYTHON" -c 'import venv' || { echo "python deps: the venv module is missing (apt-get install python3-venv)" >&2; exit 1; }
