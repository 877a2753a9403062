#!/usr/bin/env bash
# podman, buildah and runc for scripts/image-test.sh (the agent image built from
# daemonset/Dockerfile and run), plus the pieces its local base images are made of: Debian's
# ca-certificates (the bundle the runtime image carries) and debootstrap is NOT needed (the
# test builds only the runtime stage from the binary the test command already built).
# Idempotent: installs only what is missing.
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
command -v openssl >/dev/null 2>&1 || missing+=(openssl)

if [[ ${#missing[@]} -gt 0 ]]; then
  if ! apt-cache policy podman 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    $SUDO apt-get update -qq
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends "${missing[@]}" >/dev/null
fi

for tool in podman buildah runc openssl; do
  command -v "$tool" >/dev/null
done
echo "podman: $(podman --version); buildah: $(buildah --version | cut -d' ' -f1-3); runc: $(runc --version | head -1)"
