#!/usr/bin/env bash
# etcd for the tests' real Kubernetes control plane (testkit/src/k8s/): Debian's etcd-server
# (bookworm: 3.4.23; kube-apiserver 1.32 works with it). Idempotent. The package's service is
# not started (policy-rc.d); each test binary starts its own etcd on loopback with a private data
# dir. `apt-get install` is skipped when an etcd binary is already on PATH or named by ETCD_BIN.
# Also xz-utils: the harness unpacks ../shared/k8s/kubernetes-*.tar.xz with `tar -xJf`.
set -euo pipefail

if ! command -v xz >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends xz-utils
fi

if [[ -n "${ETCD_BIN:-}" && -x "${ETCD_BIN}" ]] || command -v etcd >/dev/null 2>&1; then
  echo "etcd: $(command -v etcd 2>/dev/null || echo "$ETCD_BIN") ($("${ETCD_BIN:-etcd}" --version 2>/dev/null | head -1))"
  exit 0
fi

apt-get update -qq
# policy-rc.d: never start the service from the package's maintainer scripts.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"
  chmod +x "$policy"
  created_policy=1
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server
if [[ $created_policy -eq 1 ]]; then
  rm -f "$policy"
fi
echo "etcd: $(command -v etcd) ($(etcd --version | head -1))"
