#!/usr/bin/env bash
# Runs every spotguard test on a fresh machine: installs what the tests need (S3-compatible
# servers, pytest, maturin, kubectl — each scripts/deps/*.sh is idempotent), checks formatting
# and lints, runs the Rust suites, builds the Python wheel and runs the Python tests against it.
# The framework drills (torch, Lightning, transformers: gigabytes) are in scripts/test-frameworks.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

echo "==> installing test dependencies (scripts/deps/*.sh)"
for s in scripts/deps/*.sh; do
  echo "--> $s"
  bash "$s"
done

echo "==> cargo fmt --check"
cargo fmt --all -- --check

echo "==> cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "==> config reference is up to date"
cargo run --quiet --locked -- config-reference > target/configuration.md
if ! diff -u docs/configuration.md target/configuration.md; then
  echo "docs/configuration.md drifted from the CLI definitions: run 'cargo run -- config-reference > docs/configuration.md'" >&2
  exit 1
fi

# --workspace: spotguard's suites and the testkit's own (the fake API server's faithfulness).
echo "==> cargo test --workspace"
cargo test --workspace --locked --no-fail-fast

# The suite's control plane is Kubernetes 1.34 (testkit's default); validation differs between
# minors, so the shipped manifests and the Helm chart are checked against 1.32 as well (same
# test binaries, no compilation: about 2 minutes).
echo "==> manifests and chart against Kubernetes 1.32"
SPOTGUARD_K8S_VERSION=1.32.13 cargo test --locked --test manifests --test chart --no-fail-fast

# `pip install spotguard`: one wheel with the Python package and the binary (maturin, profile
# `wheel`: release without fat LTO, opt-level 1, 16 codegen units; it adds about 7 CPU-minutes of
# compilation). The Python tests run against it, installed into a fresh venv, and call its binary.
echo "==> wheel: maturin build --profile wheel"
wheel_start=$SECONDS
rm -rf target/wheels
python3 -m maturin build --locked --profile wheel --out target/wheels
echo "wheel built in $((SECONDS - wheel_start))s: $(ls target/wheels)"

# The helper alone (`pip install ./clients/python`): pure Python, setuptools, the same sources.
echo "==> pure-Python helper wheel: pip wheel ./clients/python"
rm -rf target/wheels-pure
python3 -m pip wheel --quiet --disable-pip-version-check --no-deps -w target/wheels-pure ./clients/python
rm -rf clients/python/build clients/python/spotguard.egg-info
echo "pure-Python wheel: $(ls target/wheels-pure)"

echo "==> fresh venv with the wheel installed"
rm -rf target/wheel-venv
python3 -m venv target/wheel-venv
target/wheel-venv/bin/python -m pip install --quiet --disable-pip-version-check \
  target/wheels/spotguard-*.whl 'pytest>=7,<9'

echo "==> python client tests (installed package and binary)"
PATH="$PWD/target/wheel-venv/bin:$PATH" target/wheel-venv/bin/python -m pytest -q clients/python/tests
