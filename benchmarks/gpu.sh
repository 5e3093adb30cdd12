#!/usr/bin/env bash
# The GPU figures of benchmarks/RESULTS.md in one go (one short lease of one GPU):
# attention blockwise vs xla vs cuDNN at long T (bf16, the 1B config's heads), GAE
# methods vs rlax and a CUDA per-token torch loop, the bf16 PPO train step's MFU, then
# the GPU-only and numerics tests. Logs and JSON go to $OUT (default /tmp/gpu_out).
#
#   bash benchmarks/gpu.sh                      # all parts
#   PARTS="gae tests" bash benchmarks/gpu.sh    # some of them
#
# rlax is optional (bench extra): where it is missing or does not import, its columns
# are NaN. Each part has its own time limit, so one stuck part leaves the others' rows.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
PARTS=${PARTS:-attention gae train_step tests}
part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  [[ " $PARTS " == *" $name "* ]] || return 0
  echo "=== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "=== $name exit ${PIPESTATUS[0]}"
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
$PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, jax.devices())"
part attention 100 $PY benchmarks/attention.py --dtype bfloat16 --heads 16 --kv-heads 8 \
  --head-dim 128 --seq-lens 2048 8192 32768 --block-sizes 256 512 --repeats 5 \
  --json "$OUT/attention.json"
# 5 rounds: a 32768-step loop costs milliseconds a call on a GPU (a kernel per step).
part gae 100 $PY benchmarks/gae.py --rounds 5 --json "$OUT/gae.json"
part train_step 170 $PY -m benchmarks.train_step --dtype bfloat16 --matmul-n 8192 \
  --cases small:16:2048 1b:8:2048 1b:1:16384 --json "$OUT/train_step.json"
# Tests on the GPU: default XLA pipeline (no CPU compile flags, no cache), no memory
# preallocation so that the worker processes share the card, and float32 matmuls in
# full float32: the tests' float32 tolerances (1e-5) are for true float32 products,
# while a GPU's default precision rounds their inputs to TF32 (10-bit mantissa), which
# moved 22 of the comparisons by ~1e-3 relative on an H200.
JAXRL_LLM_TEST_FAST=0 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest \
  part tests 110 $PY -m pytest -q -p no:cacheprovider -n 4 -o addopts="" \
  tests/test_attention.py tests/test_advantages.py tests/test_logprobs.py \
  tests/test_losses.py tests/test_sampler.py
