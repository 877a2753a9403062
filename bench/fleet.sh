#!/usr/bin/env bash
# The fleet bench: N nodes, each with spotguard as the DaemonSet runs it (agent + prefetcher
# processes with the shipped capabilities, the node's own EC2 metadata emulator), against one
# real API server; idle API load and memory per node, a mass reclaim of 25 % of the nodes
# within one second, and single drains of 2 and 30 pods. See benches/fleet.rs. Takes minutes
# (N = 100: about 4 on 2 cores), so scripts/test.sh does not run it; tests/fleet.rs is its
# CI-sized guard.
#
#   bench/fleet.sh [N]                 (default 100)
#
# Environment: FLEET_PODS (30 per node), FLEET_GRACE (30 s), FLEET_IDLE_SECS (120),
# FLEET_RECLAIM (0.25), FLEET_SCENARIOS (idle,reclaim,drains), SPOTGUARD_FLEET_BIN (another
# spotguard build for the nodes, e.g. an older one to compare with). Needs root (cgroups,
# setpriv), etcd (scripts/deps/etcd.sh) and the Kubernetes binaries (docs/contributing.md).
# The results go to target/fleet-N.json too (FLEET_OUT: elsewhere), and a table row is printed
# at the end.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/.."
n="${1:-100}"
out="${FLEET_OUT:-$PWD/target/fleet-$n.json}"
FLEET_N="$n" FLEET_OUT="$out" cargo bench --bench fleet
python3 - "$out" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
def f(x, scale=1.0, fmt="{:.1f}"):
    return "n/a" if x is None else fmt.format(x * scale)
i, c = r.get("idle", {}), r.get("reclaim", {})
if i and c:
    # A 404 to a pod GET is how the old drain learnt that a pod was gone: not an error.
    print("| N | idle req/s per node beyond watches | open watches per node | RSS per node (agent + prefetcher) | notice seen → signal p50 / p99 (box-wide: the trainer's handler ran) | per agent: seen → signal sent p50 / p99 (its own clock) | CPU per reclaimed agent p50 / max | notice visible → signal p50 / p99 (1 s poll) | drained p50 / p99 | margin to deadline (min) | API p99 during reclaim | pod GETs in reclaim (peak/s) | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("| {n} | {req} | {w} | {ra} + {rp} MiB | {s50} / {s99} ms | {o50} / {o99} ms | {c50} / {cmax} s | {v50} / {v99} ms | {d50} / {d99} s | {m} s | {api} ms | {gets} ({peak}) | {err} |".format(
        n=r["n"], req=f(i["requests_per_s_per_node"], fmt="{:.4f}"), w=f(i["open_watches_per_node"]),
        ra=f(i["agent_rss_mib"]["p50"]), rp=f(i["prefetch_rss_mib"]["p50"]),
        s50=f(c["signal_from_seen_s"]["p50"], 1e3), s99=f(c["signal_from_seen_s"]["p99"], 1e3),
        o50=f(c.get("agent_seen_to_sent_s", {}).get("p50"), 1e3), o99=f(c.get("agent_seen_to_sent_s", {}).get("p99"), 1e3),
        c50=f(c["cpu_seconds"]["per_reclaimed_agent_s"]["p50"], fmt="{:.2f}"), cmax=f(c["cpu_seconds"]["per_reclaimed_agent_s"]["max"], fmt="{:.2f}"),
        v50=f(c["signal_from_visible_s"]["p50"], 1e3), v99=f(c["signal_from_visible_s"]["p99"], 1e3),
        d50=f(c["drained_s"]["p50"]), d99=f(c["drained_s"]["p99"]), m=f(c["margin_s"]["min"]),
        api=f(c["api_p99_s"], 1e3), gets=c.get("pod_gets", 0), peak=c.get("peak_pod_gets_per_s", 0),
        err=sum(v for k, v in c.get("proxy_errors", {}).items() if k != "PodGet 404") + int(c.get("agent_errors", 0)) + int(c.get("blocked_pods", 0)) + len(c.get("problems", []))))
elif i:
    print("idle: {} req/s per node beyond watches, {} open watches per node, RSS {} + {} MiB".format(
        f(i["requests_per_s_per_node"], fmt="{:.4f}"), f(i["open_watches_per_node"]),
        f(i["agent_rss_mib"]["p50"]), f(i["prefetch_rss_mib"]["p50"])))
for d in r.get("drains", []):
    print("drain of {} pods: {} requests ({} pod GETs, {} evictions), drained in {} s".format(
        d["pods"], d["requests"], d["pod_gets"], d["evictions"], f(d["drained_s"])))
EOF
