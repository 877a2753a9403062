#!/usr/bin/env bash
# Framework drills: every recipe of docs/training-integration.md run under `spotguard drill` with
# the real frameworks (torch, Lightning, transformers, Accelerate), plus the helper's torch tests
# (two gloo ranks) and the DDP example repeated under torchrun + the launcher.
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
export PATH="$PWD/$VENV/bin:$PATH"
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
PATH="$PWD/$VENV/bin:$PATH" "$PY" -m pytest -q clients/python/tests

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
