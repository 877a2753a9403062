#!/usr/bin/env bash
# Framework drills: every recipe of docs/training-integration.md run under `spotguard drill` with
# the real frameworks (torch, Lightning, transformers, Accelerate), plus the helper's torch tests
# (two gloo ranks), the DDP example repeated under torchrun + the launcher, elastic training:
# `spotguard drill --elastic` with two torchrun nodes (the launcher's PASS, and bare torchrun's
# FAIL) and, when Horovod is built (HOROVOD=1 runs scripts/build-horovod.sh first, ~20 min),
# Horovod elastic; the Kubeflow Pipelines recipe compiled and its training step run through KFP's
# local runner; ChainerMN under `mpiexec -n 2` (Open MPI from apt, Chainer in a venv of its own).
#
# Not part of scripts/test.sh (CI): PyPI's torch wheel pulls ~5 GB of CUDA packages. Run it by hand
# or in a nightly job:
#
#   bash scripts/test-frameworks.sh              # venv in target/frameworks-venv (reused)
#   DDP_REPEAT=10 LOAD=1 bash scripts/test-frameworks.sh   # DDP drills while `cargo build` runs
#   ONLY="elastic kfp chainermn" bash scripts/test-frameworks.sh   # some sections only
#
# Sections (ONLY, default all): helper recipes elastic horovod kfp chainermn ddp.
# Uses the wheel from target/wheels (built with maturin when missing) installed into the venv, so
# the binary and the helper under test are the ones `pip install spotguard` gives;
# FROM_CHECKOUT=1 uses the checkout's helper and the `cargo build` binary instead (quicker). Each
# drill writes a JUnit file into target/frameworks/. Exit 0 when every drill passed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

VENV="${SPOTGUARD_FRAMEWORKS_VENV:-target/frameworks-venv}"
CHAINER_VENV="${SPOTGUARD_CHAINER_VENV:-target/chainer-venv}"   # Chainer needs numpy<1.24
DDP_REPEAT="${DDP_REPEAT:-3}"
LOAD="${LOAD:-0}"
OUT=target/frameworks
PY="$VENV/bin/python"
ONLY="${ONLY:-}"
FROM_CHECKOUT="${FROM_CHECKOUT:-0}"
want() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }
# install_spotguard PYTHON: the helper under test into that venv.
install_spotguard() {
  if [ "$FROM_CHECKOUT" = 1 ]; then
    "$1" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps ./clients/python
  else
    "$1" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps target/wheels/spotguard-*.whl
  fi
}

echo "==> venv $VENV with torch, lightning, transformers, accelerate (PyPI)"
[ -x "$PY" ] || python3 -m venv "$VENV"
VENV="$(cd "$VENV" && pwd)"   # absolute from here on
PY="$VENV/bin/python"
if ! "$PY" -c 'import torch, lightning, transformers, accelerate, pytest' >/dev/null 2>&1; then
  "$PY" -m pip install --quiet --disable-pip-version-check \
    'torch>=2.4' 'lightning>=2.2' 'transformers>=4.40' 'accelerate>=0.30' 'pytest>=7,<9'
fi
"$PY" -c 'import torch, lightning, transformers, accelerate; print("torch", torch.__version__, "| lightning", lightning.__version__, "| transformers", transformers.__version__, "| accelerate", accelerate.__version__)'

if [ "$FROM_CHECKOUT" = 1 ]; then
  echo "==> the checkout's helper (clients/python) and binary (cargo build)"
  cargo build --locked --bin spotguard
  install_spotguard "$PY"
  export PATH="$(cargo metadata --format-version 1 --no-deps | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')/debug:$VENV/bin:$PATH"
else
  echo "==> the wheel (target/wheels)"
  if ! ls target/wheels/spotguard-*.whl >/dev/null 2>&1; then
    bash scripts/deps/python.sh
    python3 -m maturin build --locked --profile wheel --out target/wheels
  fi
  install_spotguard "$PY"
  export PATH="$VENV/bin:$PATH"
fi
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
  "$PY" - "$OUT/$name.json" <<'PY' || echo "  no verdict in $OUT/$name.json (see $OUT/$name.log)"
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

if want helper; then
echo "==> helper tests with torch (two gloo ranks agree on one step; the gloo side group)"
PATH="$VENV/bin:$PATH" "$PY" -m pytest -q clients/python/tests
fi

if want recipes; then
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
fi

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

if want elastic; then
echo "==> elastic torchrun: 2 nodes x 2 ranks, c10d, a notice on node 2; survivors within 15 s, 0 steps lost"
elastic elastic-torchrun 15 pass -- "$PY" -m spotguard launch -- torchrun --nnodes=1:2 \
  --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=localhost:29400 --rdzv-id=fw-elastic \
  --max-restarts=3 examples/ddp_train.py --ckpt-dir "$(ck elastic)"
echo "==> elastic torchrun without the launcher (the failure the launcher prevents: expected FAIL)"
elastic elastic-torchrun-bare 15 fail -- env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
  torchrun --nnodes=1:2 --nproc-per-node=2 \
  --rdzv-backend=c10d --rdzv-endpoint=localhost:29401 --rdzv-id=fw-elastic-bare --max-restarts=3 \
  --rdzv-conf=last_call_timeout=2 examples/ddp_train.py --ckpt-dir "$(ck elastic-bare)"
fi

if want horovod && [ "${HOROVOD:-0}" = 1 ]; then
  bash scripts/build-horovod.sh "$VENV"
fi
if ! want horovod; then
  :
elif "$PY" -c 'import horovod.torch' >/dev/null 2>&1; then
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

if want kfp; then
echo "==> Kubeflow Pipelines recipe compiles (examples/kfp_pipeline.py, kfp v2 SDK)"
# kfp 2.17 or later: its local runner (below) honours set_retry.
"$PY" -c 'import kfp, kfp.kubernetes, sys; sys.exit(tuple(map(int, kfp.__version__.split(".")[:2])) < (2, 17))' >/dev/null 2>&1 || \
  "$PY" -m pip install --quiet --disable-pip-version-check 'kfp>=2.17,<3' 'kfp-kubernetes>=1.2,<3'
if "$PY" examples/kfp_pipeline.py --out "$OUT/kfp-pipeline.yaml" && "$PY" - "$OUT/kfp-pipeline.yaml" <<'PY'
import sys
text = open(sys.argv[1]).read()
for want in ("maxRetryCount: 10", "spotguard.io/checkpoint: 'true'", "spotguard.io/checkpoint-dir",
             "mountPath: /var/run/spotguard", "mountPath: /ckpt", "gke-spot", "SPOTGUARD_DIR",
             "spotguard.install()", "spotguard.exit_after_checkpoint()"):
    assert want in text, want
print("  compiled: retries, spot placement, spotguard annotations, notice dir, checkpoint PVC")
PY
then summary+=("PASS  kfp-pipeline-compiles"); else summary+=("FAIL  kfp-pipeline-compiles"); failed+=("kfp-pipeline"); fi

echo "==> Kubeflow Pipelines local runner (kfp.local.SubprocessRunner): the recipe's training step under the drill"
kfp_ck="$(ck kfp-local)"
# Without retries: the step checkpoints on the notice and exits 143; KFP's local runner fails the
# pipeline (exit 1), which spotguard's launcher turns back into 143 after this run's done ack.
drill kfp-local-no-retry --exit-timeout 60s -- "$PY" -m spotguard launch -- "$PY" \
  examples/kfp_pipeline.py --local --retries 0 --ckpt-root "$kfp_ck/no-retry" --steps 100000
# The recipe's set_retry (backoff 1 s here): the retry resumes from the step saved and trains to
# the end (1000 steps), so the pipeline succeeds (exit 0). The drill judges its command as one pod and calls
# that exit 0 a FAIL; this check judges the pipeline instead.
t0=$SECONDS
mkdir -p "$kfp_ck/notice"
spotguard drill --after 10s --exit-timeout 300s --notice-dir "$kfp_ck/notice" --json -- "$PY" examples/kfp_pipeline.py \
  --local --ckpt-root "$kfp_ck/retry" --steps 1000 > "$OUT/kfp-local-retry.json" 2> "$OUT/kfp-local-retry.log" || true
if "$PY" - "$OUT/kfp-local-retry.json" "$OUT/kfp-local-retry.log" <<'PY'; then
import json, pathlib, re, sys
r = json.load(open(sys.argv[1]))["runs"][0]
log = re.sub(r"\x1b\[[0-9;]*m", "", open(sys.argv[2]).read())
saved = sorted({a["step"] for a in r["acks"] if a["state"] == "done"})
raised = r["notice_raised_unix"]
acked = {a["file"][len("ack-"):-len(".json")] for a in r["acks"] if a["state"] == "done"}
# The retry's resume record: a process other than the one that acked (the first attempt's
# record may come after the notice too, on a loaded machine).
recs = sorted(((p.stem[len("resume-"):].split("-")[0], json.loads(p.read_text()))
               for p in pathlib.Path(r["notice_dir"]).glob("resume-*.json")), key=lambda x: x[1]["ts"])
after = [x for pid, x in recs if x["ts"] > raised and pid not in acked]
resumed = after[0]["step"] if after else None
again = after[0]["ts"] - raised if after else None
lost = saved[0] - resumed if saved and resumed is not None else None
exit_code = r["exit"] and r["exit"]["code"]
retried = log.count("Executing task 'train'") >= 2 and "Task 'train' finished with status FAILURE" in log
print(f"  steps saved {saved}, the step exited 143: {'exiting 143' in log}, KFP retried: {retried}, "
      f"resumed {resumed}, lost {lost}, training again {again if again is None else round(again, 1)}s "
      f"after the notice, pipeline exit {exit_code}, finished: {'trained to step 1000' in log}")
ok = (len(saved) == 1 and "exiting 143" in log and retried and lost == 0 and exit_code == 0
      and "trained to step 1000" in log)
sys.exit(0 if ok else 1)
PY
  summary+=("PASS  kfp-local-retry  $((SECONDS - t0))s  (checkpoint, 143, KFP's retry resumed, pipeline exit 0)")
else
  summary+=("FAIL  kfp-local-retry  $((SECONDS - t0))s  (see $OUT/kfp-local-retry.log, $OUT/kfp-local-retry.json)")
  failed+=("kfp-local-retry")
fi
fi

if want chainermn; then
echo "==> ChainerMN: venv $CHAINER_VENV (Chainer 7.8.1, numpy<1.24, mpi4py), Open MPI from Debian"
if ! command -v mpiexec >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
  SUDO=""; if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openmpi-bin libopenmpi-dev
fi
[ -x "$CHAINER_VENV/bin/python" ] || python3.11 -m venv "$CHAINER_VENV"
CHAINER_VENV="$(cd "$CHAINER_VENV" && pwd)"
CPY="$CHAINER_VENV/bin/python"
if ! "$CPY" -c 'import chainer, chainermn, mpi4py' >/dev/null 2>&1; then
  "$CPY" -m pip install --quiet --disable-pip-version-check 'setuptools<70' wheel 'numpy<1.24'
  "$CPY" -m pip install --quiet --disable-pip-version-check --no-build-isolation 'chainer==7.8.1' mpi4py
fi
install_spotguard "$CPY"
"$CPY" -c 'import chainer, mpi4py; print("chainer", chainer.__version__, "| mpi4py", mpi4py.__version__)'
echo "==> ChainerMN: mpiexec -n 2, both ranks save one iteration; then the resume"
cmn="$(ck chainermn)"
mkdir -p "$cmn/notice-1" "$cmn/notice-2"
mpi_root=()
if [ "$(id -u)" -eq 0 ]; then mpi_root=(--allow-run-as-root); fi   # as in a root container
# mpiexec forwards SIGUSR1 to the ranks by default, and so catches it itself: forwarding off, the
# agent signals the ranks (the processes that catch it), not mpiexec.
cmn_job=(mpiexec "${mpi_root[@]}" --mca ess_base_forward_signals none -n 2 "$CPY"
  examples/chainermn_train.py --ckpt-dir "$cmn/ckpt")
drill chainermn --notice-dir "$cmn/notice-1" -- "${cmn_job[@]}"
cmn_t0=$(date +%s.%N)
drill chainermn-resume --notice-dir "$cmn/notice-2" -- "${cmn_job[@]}"
if "$PY" - "$OUT/chainermn.json" "$OUT/chainermn-resume.json" "$cmn_t0" <<'PY'; then
import json, pathlib, sys
def run(f):
    return json.load(open(f))["runs"][0]
r1, r2 = run(sys.argv[1]), run(sys.argv[2])
def saved(r):
    return [a["step"] for a in r["acks"] if a["state"] == "done"]
s1 = saved(r1)
recs = [json.loads(p.read_text()) for p in pathlib.Path(r2["notice_dir"]).glob("resume-*.json")]
resumed = sorted(x["step"] for x in recs)
again = max(x["ts"] for x in recs) - float(sys.argv[3]) if recs else None
lost = max(s1) - min(resumed) if s1 and resumed else None
print(f"  run 1: {r1['processes_signalled']} ranks signalled, both saved iteration(s) {sorted(set(s1))} "
      f"({len(s1)} done acks), exit {r1['exit'] and r1['exit']['code']}; run 2: ranks resumed from {resumed}, "
      f"lost {lost}, training again {again if again is None else round(again, 1)}s after the relaunch "
      f"(mpiexec, imports, MPI init, snapshot load), saved {sorted(set(saved(r2)))}")
ok = (r1["processes_signalled"] == 2 and len(s1) == 2 and len(set(s1)) == 1 and len(resumed) == 2
      and set(resumed) == set(s1) and lost == 0 and r1["pass"] and r2["pass"])
sys.exit(0 if ok else 1)
PY
  summary+=("PASS  chainermn-both-ranks-resumed  (one iteration saved by both ranks, resumed by both, 0 lost)")
else
  summary+=("FAIL  chainermn-both-ranks-resumed  (see $OUT/chainermn*.log)")
  failed+=("chainermn-resume")
fi
fi

if want ddp; then
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
fi

echo "==> summary"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}" >&2
  exit 1
fi
