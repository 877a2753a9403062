#!/usr/bin/env bash
# What tests/trust.rs, the pipeline tests with AWS's ec2-metadata-mock and the prefetch
# directory-sync test need from the system: xz (unpacks ../shared/k8s/ec2-metadata-mock-*.xz once
# under target/), setpriv and mount (util-linux), mkfs.ext4 (e2fsprogs). Idempotent.
set -euo pipefail
missing=()
command -v xz >/dev/null 2>&1 || missing+=(xz-utils)
command -v setpriv >/dev/null 2>&1 || missing+=(util-linux)
command -v mkfs.ext4 >/dev/null 2>&1 || missing+=(e2fsprogs)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
