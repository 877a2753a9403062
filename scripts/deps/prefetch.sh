#!/usr/bin/env bash
# Installs what `cargo test --test prefetch` needs (idempotent):
#   - s3s-fs 0.14.1 (crates.io), an S3-compatible server over a directory;
#   - moto's server mode (PyPI), for tests that need `If-Match` honoured on GET;
#   - PyYAML (PyPI, normally installed with moto), to read the manifests in tests.
# Benchmark-only tools (s5cmd, rclone, aws CLI) are installed by bench/deps.sh.
set -euo pipefail

if ! command -v s3s-fs >/dev/null 2>&1; then
    if cargo install --list | grep -q '^s3s-fs v0.14.1'; then
        echo "s3s-fs is installed in ~/.cargo/bin but not on PATH: add \$HOME/.cargo/bin to PATH" >&2
        exit 1
    fi
    # 0.15+ needs a newer rustc than 1.95.
    cargo install s3s-fs@0.14.1 --features binary --locked
fi

if ! command -v moto_server >/dev/null 2>&1; then
    python3 -m pip install --quiet 'moto[server]'
    # pyenv: `python3 -m pip` does not refresh the shims that put moto_server on PATH.
    if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
fi

# tests/prefetch_manifests.rs reads the manifests with PyYAML (a moto dependency; checked here).
if ! python3 -c 'import yaml' >/dev/null 2>&1; then
    python3 -m pip install --quiet pyyaml
fi

echo "prefetch test dependencies: s3s-fs $(command -v s3s-fs), moto_server $(command -v moto_server)"
