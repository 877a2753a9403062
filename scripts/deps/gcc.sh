#!/usr/bin/env bash
# The NVML stand-in library (tests/nvml-stub/nvml_stub.c) is compiled by the GPU tests with the
# system C compiler. Idempotent.
set -euo pipefail
if command -v gcc >/dev/null 2>&1 && echo 'int main(void){return 0;}' | gcc -x c -o /dev/null - >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc libc6-dev
