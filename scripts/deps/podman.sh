#!/usr/bin/env bash
# podman, buildah and runc (Debian) for tests/image.rs: the agent image built from
# daemonset/Dockerfile and run. No registry is reachable, so the test makes the runtime base
# image itself from this machine's files: Debian's ca-certificates provides the CA bundle it
# carries. Only the runtime stage is built (around the binary scripts/test.sh already built), so
# no Rust image or debootstrap is needed. Idempotent: installs only what is missing.
set -euo pipefail

SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  SUDO="sudo"
fi

missing=()
command -v podman >/dev/null 2>&1 || missing+=(podman)
command -v buildah >/dev/null 2>&1 || missing+=(buildah)
command -v runc >/dev/null 2>&1 || missing+=(runc)
[[ -f /etc/ssl/certs/ca-certificates.crt ]] || missing+=(ca-certificates)

if [[ ${#missing[@]} -gt 0 ]]; then
  if ! apt-cache policy podman 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    $SUDO apt-get update -qq
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends "${missing[@]}" >/dev/null
fi

for tool in podman buildah runc; do
  command -v "$tool" >/dev/null
done
echo "podman: $(podman --version); buildah: $(buildah --version | cut -d' ' -f1-3); runc: $(runc --version | head -1)"
