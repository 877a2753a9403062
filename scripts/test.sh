#!/usr/bin/env bash
# Runs every spotguard test on a fresh machine: installs what the tests need (S3-compatible
# servers, pytest, kubectl — each scripts/deps/*.sh is idempotent), checks formatting and lints,
# then runs the Rust and Python test suites.
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

echo "==> cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets --locked -- -D warnings

echo "==> config reference is up to date"
cargo run --quiet --locked -- config-reference > target/configuration.md
if ! diff -u docs/configuration.md target/configuration.md; then
  echo "docs/configuration.md drifted from the CLI definitions: run 'cargo run -- config-reference > docs/configuration.md'" >&2
  exit 1
fi

echo "==> cargo test"
cargo test --locked --no-fail-fast

echo "==> python client tests"
python3 -m pytest -q clients/python/tests
