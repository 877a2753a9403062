#!/usr/bin/env bash
# promtool for tests/alerts.rs: `promtool check rules`, `promtool test rules` and parsing the
# dashboard's queries. Debian's `prometheus` package ships it. Idempotent.
set -euo pipefail

if command -v promtool >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  SUDO="sudo"
fi
if ! apt-cache policy prometheus 2>/dev/null | grep -q 'Candidate: [0-9]'; then
  $SUDO apt-get update -qq
fi
# The package's postinst would start a Prometheus server where an init system runs; policy-rc.d
# is not ours to change, so only the binary is wanted: install without recommends.
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v promtool >/dev/null
