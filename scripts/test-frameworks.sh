#!/usr/bin/env bash
# Framework drills: every recipe of docs/training-integration.md run under `spotguard drill` with
# the real frameworks (torch, Lightning, transformers, Accelerate), plus the helper's torch tests
# (two gloo ranks), the DDP example repeated under torchrun + the launcher, and elastic training:
# `spotguard drill --elastic` with two torchrun nodes (the launcher's PASS, and bare torchrun's
# FAIL) and, when Horovod is built (HOROVOD=1 runs scripts/build-horovod.sh first, ~20 min),
# Horovod elastic.
#
# Not part of scripts/test.sh (CI): PyPI's torch wheel pulls ~5 GB of CUDA packages. Run it by hand
# or in a nightly job:
#
#   bash scripts/test-frameworks.sh              # venv in target/frameworks-venv (reused)
#   DDP_REPEAT=10 LOAD=1 bash scripts/test-frameworks.sh   # DDP drills while `cargo build` runs
#
# Uses the wheel from target/wheels (built with maturin when missing) installed into the venv, so
# the binary and the helper under test are the ones `pip install spotguard` gives. Each drill
# writes a JUnit file into target/frameworks/. Exit 0 when every drill passed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

VENV="${SPOTGUARD_FRAMEWORKS_VENV:-target/frameworks-venv}"
DDP_REPEAT="${DDP_REPEAT:-3}"
LOAD="${LOAD:-0}"
OUT=target/frameworks
PY="$VENV/bin/python"

echo "==> venv $VENV with torch, lightning, transformers, accelerate (PyPI)"
[ -x "$PY" ] || python3 -m venv "$VENV"
VENV="$(cd "$VENV" && pwd)"   # absolute from here on
PY="$VENV/bin/python"
if ! "$PY" -c 'import torch, lightning, transformers, accelerate, pytest' >/dev/null 2>&1; then
  "$PY" -m pip install --quiet --disable-pip-version-check \
    'torch>=2.4' 'lightning>=2.2' 'transformers>=4.40' 'accelerate>=0.30' 'pytest>=7,<9'
fi
"$PY" -c 'import torch, lightning, transformers, accelerate; print("torch", torch.__version__, "| lightning", lightning.__version__, "| transformers", transformers.__version__, "| accelerate", accelerate.__version__)'

echo "==> the wheel (target/wheels)"
if ! ls target/wheels/spotguard-*.whl >/dev/null 2>&1; then
  bash scripts/deps/python.sh
  python3 -m maturin build --locked --profile wheel --out target/wheels
fi
"$PY" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps target/wheels/spotguard-*.whl
export PATH="$VENV/bin:$PATH"
command -v spotguard

rm -rf "$OUT"
mkdir -p "$OUT"
failed=()
summary=()

# drill NAME [drill flags] -- CMD...: one drill in a fresh checkpoint dir ($CK), JSON kept.
drill() {
  local name=$1; shift
  local t0=$SECONDS
  if spotguard drill --junit "$OUT/$name.xml" --json "$@" > "$OUT/$name.json" 2> "$OUT/$name.log"; then
    summary+=("PASS  $name  $((SECONDS - t0))s")
  else
    summary+=("FAIL  $name  $((SECONDS - t0))s  (see $OUT/$name.log, $OUT/$name.json)")
    failed+=("$name")
  fi
  "$PY" - "$OUT/$name.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for i, r in enumerate(doc["runs"], 1):
    steps = sorted({a["step"] for a in r["acks"] if a["state"] == "done"})
    h = r["handler"]
    print(f"  run {i}: {'PASS' if r['pass'] else 'FAIL'}  handler after {h.get('after_start_s', 0):.1f}s  "
          f"signal->result {(r['result_s'] or 0) - (r['signal_sent_s'] or 0):.2f}s  acks {len(r['acks'])} "
          f"done steps {steps}  exit {r['exit'] and r['exit']['code']}  — {r['reason']}")
PY
}

ck() { rm -rf "$OUT/ck-$1"; mkdir -p "$OUT/ck-$1"; echo "$PWD/$OUT/ck-$1"; }

echo "==> helper tests with torch (two gloo ranks agree on one step; the gloo side group)"
PATH="$VENV/bin:$PATH" "$PY" -m pytest -q clients/python/tests

echo "==> recipe drills"
drill torch-single -- "$PY" examples/torch_train.py --ckpt-dir "$(ck torch)"
drill torch-single-resume -- "$PY" examples/torch_train.py --ckpt-dir "$OUT/ck-torch"
drill lightning -- "$PY" examples/lightning_train.py --root "$(ck lightning)"
drill lightning-resume -- "$PY" examples/lightning_train.py --root "$OUT/ck-lightning"
drill hf-trainer -- "$PY" examples/hf_trainer.py --output-dir "$(ck hf)"
drill hf-trainer-resume -- "$PY" examples/hf_trainer.py --output-dir "$OUT/ck-hf"
drill accelerate -- "$PY" examples/accelerate_train.py --ckpt-dir "$(ck acc)"
drill dcp-async-gce --cloud gce -- "$PY" examples/dcp_async.py --ckpt-dir "$(ck dcp)"
drill dcp-async-2rank-gce --cloud gce -- "$PY" -m spotguard launch -- \
  torchrun --nproc-per-node 2 examples/dcp_async.py --ckpt-dir "$(ck dcp2)"

echo "==> Accelerate: 2 CPU processes (--multi_gpu: --cpu would run one)"
drill accelerate-2proc -- "$PY" -m spotguard launch -- "$VENV/bin/accelerate" launch --multi_gpu \
  --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
  examples/accelerate_train.py --ckpt-dir "$(ck acc2)"
"$PY" - "$OUT/accelerate-2proc.json" <<'PY' || failed+=("accelerate-2proc-processes")
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
print(f"  signalled {r['processes_signalled']} process(es); warnings {r['warnings']}")
sys.exit(0 if r["processes_signalled"] == 2 and not r["warnings"] else 1)
PY

# elastic NAME MAX_AGAIN_S EXPECT [drill flags] -- CMD...: `spotguard drill --elastic` (two local
# nodes, a GCE notice on node 2, node 2's process tree killed 30 s later); EXPECT pass|fail.
elastic() {
  local name=$1 max_again=$2 expect=$3; shift 3
  local t0=$SECONDS rc=0
  spotguard drill --elastic --cloud gce --kill-after 30s --junit "$OUT/$name.xml" --json "$@" \
    > "$OUT/$name.json" 2> "$OUT/$name.log" || rc=$?
  if "$PY" - "$OUT/$name.json" "$max_again" "$expect" <<'PY'; then
import json, sys
doc = json.load(open(sys.argv[1]))
r = doc["runs"][0]
again = r["training_again_s"]
left = r["nodes"][r["interrupted_node"] - 1]
print(f"  {'PASS' if r['pass'] else 'FAIL'}: step saved {r['step_saved']}, node left: "
      f"{left['label']} at +{left['exited_s'] or 0:.1f}s (exit {left['exit'] and left['exit']['code']}), "
      + ", ".join(f"{s['label']} resumed step {s['resumed_step']} at +{s['resumed_s'] or 0:.1f}s"
                  for s in r["survivors"])
      + f", steps lost {r['steps_lost']}, training again {again if again is None else round(again, 1)}s")
print(f"  verdict: {r['reason']}")
if sys.argv[3] == "fail":
    sys.exit(0 if not r["pass"] else 1)
ok = r["pass"] and r["steps_lost"] == 0 and again is not None and again < float(sys.argv[2])
sys.exit(0 if ok else 1)
PY
    summary+=("PASS  $name  $((SECONDS - t0))s  (drill exit $rc, expected $expect)")
  else
    summary+=("FAIL  $name  $((SECONDS - t0))s  (see $OUT/$name.log, $OUT/$name.json)")
    failed+=("$name")
  fi
}

echo "==> elastic torchrun: 2 nodes x 2 ranks, c10d, a notice on node 2; survivors within 15 s, 0 steps lost"
elastic elastic-torchrun 15 pass -- "$PY" -m spotguard launch -- torchrun --nnodes=1:2 \
  --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=localhost:29400 --rdzv-id=fw-elastic \
  --max-restarts=3 examples/ddp_train.py --ckpt-dir "$(ck elastic)"
echo "==> elastic torchrun without the launcher (the failure the launcher prevents: expected FAIL)"
elastic elastic-torchrun-bare 15 fail -- env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
  torchrun --nnodes=1:2 --nproc-per-node=2 \
  --rdzv-backend=c10d --rdzv-endpoint=localhost:29401 --rdzv-id=fw-elastic-bare --max-restarts=3 \
  --rdzv-conf=last_call_timeout=2 examples/ddp_train.py --ckpt-dir "$(ck elastic-bare)"

if [ "${HOROVOD:-0}" = 1 ]; then
  bash scripts/build-horovod.sh "$VENV"
fi
if "$PY" -c 'import horovod.torch' >/dev/null 2>&1; then
  echo "==> Horovod elastic: hosts localhost and $(hostname) (both local), 2 slots each, a notice on one"
  hvd="$PWD/$OUT/horovod"
  rm -rf "$hvd"; mkdir -p "$hvd"
  printf 'localhost:2\n%s:2\n' "$(hostname)" > "$hvd/hosts"
  printf '#!/bin/sh\nexec "%s" -m spotguard horovod-hosts --hosts "%s/hosts" --leaving "%s/leaving"\n' \
    "$PY" "$hvd" "$hvd" > "$hvd/discover.sh"
  chmod +x "$hvd/discover.sh"
  # Nodes are told apart by HOROVOD_HOSTNAME; the notice goes to the second in name order.
  elastic horovod-elastic 15 pass --node-env HOROVOD_HOSTNAME --interrupt-node 2 -- \
    "$VENV/bin/horovodrun" -np 4 --min-np 2 --max-np 4 --host-discovery-script "$hvd/discover.sh" \
    "$PY" examples/horovod_elastic.py --ckpt-dir "$hvd/ckpt" --leaving "$hvd/leaving"
else
  echo "==> Horovod elastic: skipped (horovod not built in $VENV: HOROVOD=1 builds it, ~20 min)"
  summary+=("SKIP  horovod-elastic  (HOROVOD=1 builds Horovod first)")
fi

echo "==> Kubeflow Pipelines recipe compiles (examples/kfp_pipeline.py, kfp v2 SDK)"
"$PY" -c 'import kfp, kfp.kubernetes' >/dev/null 2>&1 || \
  "$PY" -m pip install --quiet --disable-pip-version-check 'kfp>=2.7,<3' 'kfp-kubernetes>=1.2,<3'
if "$PY" examples/kfp_pipeline.py --out "$OUT/kfp-pipeline.yaml" && "$PY" - "$OUT/kfp-pipeline.yaml" <<'PY'
import sys
text = open(sys.argv[1]).read()
for want in ("maxRetryCount: 10", "spotguard.io/checkpoint: 'true'", "spotguard.io/checkpoint-dir",
             "mountPath: /var/run/spotguard", "mountPath: /ckpt", "gke-spot", "SPOTGUARD_DIR",
             "spotguard", "launch"):
    assert want in text, want
print("  compiled: retries, spot placement, spotguard annotations, notice dir, checkpoint PVC")
PY
then summary+=("PASS  kfp-pipeline-compiles"); else summary+=("FAIL  kfp-pipeline-compiles"); failed+=("kfp-pipeline"); fi

echo "==> DDP example: 2 ranks under torchrun + the launcher, default drill settings, $DDP_REPEAT runs"
load_pid=
if [ "$LOAD" = 1 ]; then
  echo "--> loading the machine: cargo build --release into $OUT/load-target"
  CARGO_TARGET_DIR="$PWD/$OUT/load-target" cargo build --release --locked > "$OUT/load-build.log" 2>&1 &
  load_pid=$!
fi
drill ddp-torchrun --repeat "$DDP_REPEAT" -- "$PY" -m spotguard launch -- \
  torchrun --nproc-per-node 2 examples/ddp_train.py --ckpt-dir "$(ck ddp)"
if [ -n "$load_pid" ]; then
  if kill -0 "$load_pid" 2>/dev/null; then echo "--> the load build was still running during every DDP run"; kill "$load_pid"; fi
  wait "$load_pid" 2>/dev/null || true
fi

echo "==> summary"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}" >&2
  exit 1
fi
