#!/usr/bin/env bash
# The relay benchmark (issue 44, docs/relay.md): the largest staged checkpoint that is published
# intact when its node is reclaimed, with and without the relay. Three agents (release build), each
# in its own network namespace, and the store in a fourth:
#
#   store   s3s-fs                                   doomed --STORE_RATE-- store
#   doomed  agent (host mode, GCE emulator), trainer peerN  --PEER_STORE_RATE-- store
#   peer1   agent receiving relays (--relay-listen)  doomed --PEER_RATE-- peer1, peer2
#   peer2   agent receiving relays (--relay-listen)
#
# Each link is a veth pair shaped with `tc tbf` on both ends. The doomed agent lists both peers
# (`--relay-peers`, tried in order): the relay sends a tree to one peer, so peer2 takes it only
# when peer1 refuses or fails.
#
# Per checkpoint size, on a ladder (BENCH_START_MIB, times BENCH_STEP) and per arm (`--relay off`,
# `--relay auto`): a fresh doomed agent, its own GCE metadata emulator and a uid-1000 trainer
# (the Python helper); a GCE preemption is raised; the trainer saves the checkpoint on the
# signal (8 shards + 4 small files), acks it staged (`spotguard.ack_staged`) and exits once the
# agent took it. At the notice's end (BENCH_NOTICE seconds after the preemption became visible)
# the doomed node's links go down and every process in its namespace is SIGKILLed. Then, bounded
# (BENCH_WAIT_S, default 1.5 times the publish time at PEER_STORE_RATE plus 90 s), the bench waits
# for the peers to finish (published, or nothing left on their staging volumes) and checks the
# store: published intact = the manifest is there, lists exactly the staged files, and every
# object's SHA-256 is the staged file's. An arm climbs the ladder to its first size not published
# intact, then tries BENCH_REFINE geometric midpoints between that and the last one published.
# Prints a line per trial and a table; the rows go to BENCH_DIR/relay-bench.json, the logs of
# every process to BENCH_DIR/logs (kept with BENCH_DIR or BENCH_KEEP=1). About 15 minutes with
# the defaults (a relayed checkpoint is published by its peer at PEER_STORE_RATE: 200 s at the
# largest size).
#
#   bench/relay.sh                         (needs root, ip netns, tc, s3s-fs, curl, setpriv)
#
# Environment (rates in MB/s = 10^6 bytes/s):
#   BENCH_STORE_RATE (5), BENCH_PEER_RATE (50), BENCH_PEER_STORE_RATE (= store rate): the links;
#     the defaults are the issue's 50 / 500 MB/s scaled down by 10 for a 2-core machine (the
#     ratio, the one figure that matters, is kept; the sizes scale with the rates)
#   BENCH_NOTICE (30, seconds: GCE's `--gce-preemption-notice`), BENCH_DRAIN_RESERVE (the agent's
#     own default: 8s on GCE)
#   BENCH_START_MIB (32), BENCH_STEP (1.5), BENCH_MAX_MIB (4096), BENCH_ARMS (off,auto),
#     BENCH_REFINE (1: geometric midpoints tried between the last size published and the first not)
#   BENCH_DIR (work dir, default a fresh one under /var/tmp; needs ~3x the largest size)
#   BENCH_RT_PRIO (10: the bench's processes run `chrt -r 10`; 0: normal priority)
#   SPOTGUARD (a prebuilt binary; default: cargo build --release)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"

[ "$(id -u)" = 0 ] || { echo "bench/relay.sh needs root (network namespaces, tc)" >&2; exit 1; }
for tool in ip tc s3s-fs curl setpriv python3; do
    command -v "$tool" >/dev/null 2>&1 || { echo "missing $tool (s3s-fs: bench/deps.sh)" >&2; exit 1; }
done

store_rate="${BENCH_STORE_RATE:-5}"
peer_rate="${BENCH_PEER_RATE:-50}"
peer_store_rate="${BENCH_PEER_STORE_RATE:-$store_rate}"
ns_store=sgrelay-store ns_doomed=sgrelay-doomed ns_peer1=sgrelay-peer1 ns_peer2=sgrelay-peer2
all_ns=("$ns_store" "$ns_doomed" "$ns_peer1" "$ns_peer2")

for ns in "${all_ns[@]}"; do
    if ip netns list | grep -qw "$ns"; then
        echo "network namespace $ns exists: another bench/relay.sh running, or one that died (ip netns del $ns)" >&2
        exit 1
    fi
done

work="${BENCH_DIR:-$(mktemp -d /var/tmp/spotguard-relay-bench.XXXXXX)}"
mkdir -p "$work"
chmod 0755 "$work"

cleanup() {
    local ns pid
    for ns in "${all_ns[@]}"; do
        # Only the bench's own namespaces: everything in them was started by this bench.
        for pid in $(ip netns pids "$ns" 2>/dev/null); do
            kill -9 "$pid" 2>/dev/null || true
        done
    done
    for ns in "${all_ns[@]}"; do
        ip netns del "$ns" 2>/dev/null || true
    done
    if [ -z "${BENCH_DIR:-}" ] && [ -z "${BENCH_KEEP:-}" ]; then
        rm -rf "$work"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ -z "${SPOTGUARD:-}" ]; then
    (cd "$repo" && cargo build --release --bin spotguard)
    target="${CARGO_TARGET_DIR:-$repo/target}"
    cp "$target/release/spotguard" "$work/spotguard"
    SPOTGUARD="$work/spotguard"
fi
chmod 0755 "$SPOTGUARD"

for ns in "${all_ns[@]}"; do
    ip netns add "$ns" || { echo "ip netns add $ns failed: network namespaces unavailable" >&2; exit 1; }
    ip -n "$ns" link set lo up
done

# A shaped veth link: link NS_A IF_A ADDR_A NS_B IF_B ADDR_B RATE_MB_PER_S (a /30 each).
link() {
    local a="$1" ia="$2" aa="$3" b="$4" ib="$5" ab="$6" rate="$7"
    local bits burst
    ip link add sgr-tmp-a type veth peer name sgr-tmp-b
    ip link set sgr-tmp-a netns "$a" name "$ia"
    ip link set sgr-tmp-b netns "$b" name "$ib"
    ip -n "$a" addr add "$aa/30" dev "$ia"
    ip -n "$b" addr add "$ab/30" dev "$ib"
    ip -n "$a" link set "$ia" up
    ip -n "$b" link set "$ib" up
    bits=$(python3 -c "print(int(float('$rate') * 8e6))")
    # tbf's bucket holds 20 ms of the rate, at least 256 KiB (a GSO packet is up to 64 KiB).
    burst=$(python3 -c "print(max(int(float('$rate') * 1e6 * 0.02), 256 * 1024))")
    tc -n "$a" qdisc add dev "$ia" root tbf rate "${bits}bit" burst "$burst" latency 50ms
    tc -n "$b" qdisc add dev "$ib" root tbf rate "${bits}bit" burst "$burst" latency 50ms
}
link "$ns_doomed" store 10.77.1.1 "$ns_store" doomed 10.77.1.2 "$store_rate"
link "$ns_peer1" store 10.77.2.1 "$ns_store" peer1 10.77.2.2 "$peer_store_rate"
link "$ns_peer2" store 10.77.3.1 "$ns_store" peer2 10.77.3.2 "$peer_store_rate"
link "$ns_doomed" peer1 10.77.11.1 "$ns_peer1" doomed 10.77.11.2 "$peer_rate"
link "$ns_doomed" peer2 10.77.12.1 "$ns_peer2" doomed 10.77.12.2 "$peer_rate"

rt=()
if [ "${BENCH_RT_PRIO:-10}" != 0 ] && command -v chrt >/dev/null 2>&1; then
    rt=(chrt -r "${BENCH_RT_PRIO:-10}")
fi
"${rt[@]}" python3 "$here/relay_bench.py" --spotguard "$SPOTGUARD" --work "$work" \
    --repo "$repo" --store-rate "$store_rate" --peer-rate "$peer_rate" \
    --peer-store-rate "$peer_store_rate" --notice "${BENCH_NOTICE:-30}" \
    --drain-reserve "${BENCH_DRAIN_RESERVE:-}" --start-mib "${BENCH_START_MIB:-32}" \
    --step "${BENCH_STEP:-1.5}" --max-mib "${BENCH_MAX_MIB:-4096}" --arms "${BENCH_ARMS:-off,auto}" --refine "${BENCH_REFINE:-1}" \
    --wait "${BENCH_WAIT_S:-0}" --rt "${rt[*]:-none}" \
    --ns-store "$ns_store" --ns-doomed "$ns_doomed" --ns-peers "$ns_peer1,$ns_peer2"
