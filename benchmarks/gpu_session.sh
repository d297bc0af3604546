#!/usr/bin/env bash
# One prepared GPU session, at most 9 minutes on a fresh machine without
# internet: the environment, profiles of the paper CapsNet's and the paper
# EM model's train steps, capsjax's best mode against PyTorch's best for
# each model at two batch sizes, the Pallas routing kernels against XLA,
# the routing, Pallas and EM kernel tests, and all
# the evidence in at most 8 files under $OUT.
#
# Before the call, once, in the repository root (on a machine with pip's
# internet; the GPU image lacks ml_collections and tensorboardX, and
# hypothesis is insurance for the tests):
#   grep -qx '/.whl/' .gitignore || echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl \
#     ml_collections tensorboardX hypothesis sortedcontainers
# On the GPU machine, with .whl/ copied along and 10 minutes (the script
# stops itself after 540 s):
#   OUT=DIR bash benchmarks/gpu_session.sh
# What comes back in $OUT: env.txt (machine and versions), summary.txt (each
# step's exit status and wall time, then the comparison tables), all.log
# (every step's output as it ran), profile_capsnet_b128.txt and
# profile_em_b64.txt (the top ops), evidence.tar.gz (the JSON rows and the
# logs, repacked after every step so that a cut-off call still has them).
#
# Check it on a CPU first: `bash benchmarks/gpu_session.sh --dry-run` (or
# CPU_DRY_RUN=1) runs every step at tiny sizes and short timeouts, no
# nvidia-smi and no wheel install, into $OUT or /tmp/gpu_session_dry.
set -u

DRY=${CPU_DRY_RUN:-0}
[ "${1:-}" = --dry-run ] && DRY=1
[ "$DRY" = 0 ] || DRY=1
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# Each step is a new process: a persistent compilation cache lets the
# comparisons reuse the train steps the profiles compiled.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/capsjax_jax_cache}
if [ "$DRY" = 1 ]; then
  OUT=${OUT:-/tmp/gpu_session_dry}
  export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=
  TOTAL=${SESSION_SECONDS:-420}; PACK=15; TESTS_RESERVE=30
else
  TOTAL=${SESSION_SECONDS:-540}; PACK=25; TESTS_RESERVE=90
fi
OUT=${OUT:?set OUT to the folder for the evidence}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_session.XXXXXX)
mkdir -p "$WORK/json"
LOG=$OUT/all.log
SUMMARY=$OUT/summary.txt
T0=$(date +%s)
: > "$LOG"
echo "gpu_session dry=$DRY start $(date -u +%FT%TZ) budget ${TOTAL} s" > "$SUMMARY"

# Seconds left before packing must start, less what later steps reserve.
left() { echo $(( T0 + TOTAL - PACK - ${1:-0} - $(date +%s) )); }

pack() {
  cp "$LOG" "$SUMMARY" "$WORK/" 2>/dev/null
  tar -czf "$OUT/evidence.tar.gz.part" -C "$WORK" --exclude='*.part' . 2>/dev/null \
    && mv "$OUT/evidence.tar.gz.part" "$OUT/evidence.tar.gz"
}

# step CAP NAME [TEE_FILE] -- COMMAND...: COMMAND under a timeout of CAP
# seconds or what the budget leaves (RESERVE seconds kept for later steps),
# skipped when under 15 s remain; output appended to all.log (and TEE_FILE).
step() {
  local cap=$1 name=$2 tee_file=/dev/null; shift 2
  if [ "$1" != -- ]; then tee_file=$1; shift; fi
  shift
  local avail; avail=$(left "${RESERVE:-0}")
  local t=$(( cap < avail ? cap : avail )) s; s=$(date +%s)
  if [ "$t" -lt 15 ]; then
    echo "=== $name skipped: $avail s left" | tee -a "$LOG" "$SUMMARY"
    return
  fi
  echo "=== $name start $(( s - T0 )) s, timeout $t s: $*" >> "$LOG"
  timeout --kill-after=5 "$t" "$@" 2>&1 | tee -a "$LOG" > "$tee_file"
  local rc=${PIPESTATUS[0]}
  local line="=== $name rc=$rc wall $(( $(date +%s) - s )) s (at $(( $(date +%s) - T0 )) s)"
  [ "$rc" = 124 ] && line="$line TIMEOUT"
  echo "$line" | tee -a "$LOG" "$SUMMARY"
  pack
}

# (a) The wheels the image lacks, then the environment.
if [ "$DRY" = 0 ]; then
  if ls .whl/*.whl > /dev/null 2>&1; then
    step 60 install -- "$PY" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  else
    echo "=== install skipped: no .whl/*.whl carried" | tee -a "$LOG" "$SUMMARY"
  fi
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
  ls .whl 2>/dev/null | sed 's/^/wheel carried: /' >> "$LOG"
fi
{
  date -u +%FT%TZ
  echo "working tree: $(git rev-parse HEAD 2>/dev/null || echo 'no git') $(git status --porcelain 2>/dev/null | wc -l) changed paths"
  uname -a; nproc; free -g | head -2
  if [ "$DRY" = 0 ]; then
    timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    timeout 20 nvidia-smi
  fi
  timeout 60 "$PY" -c "
import importlib, sys
print('python', sys.version.split()[0])
for name in ('jax', 'jaxlib', 'flax', 'optax', 'orbax.checkpoint', 'chex', 'torch',
             'triton', 'ml_collections', 'tensorboardX', 'hypothesis', 'pytest', 'numpy'):
  try:
    print(name, getattr(importlib.import_module(name), '__version__', '?'))
  except Exception as e:
    print(name, 'MISSING', type(e).__name__, e)
import jax
print('jax devices', jax.devices(), 'backend', jax.default_backend())
try:
  import torch
  print('torch cuda', torch.version.cuda, torch.cuda.is_available(),
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')
except Exception as e:
  print('torch', e)
"
  "$PY" -m pip list 2>/dev/null | grep -i -E 'jax|cuda|cudnn|cupti|nvidia|torch|flax|optax'
} > "$OUT/env.txt" 2>&1
echo "=== env at $(( $(date +%s) - T0 )) s" | tee -a "$LOG" "$SUMMARY"
pack

# Sizes: the GPU's, or tiny ones for the CPU check.
if [ "$DRY" = 1 ]; then
  CAPSNET=capsnet_mnist:smoke; EM=matrix_capsnet_mnist:smoke
  CAPS_B=(2 4); EM_B=(2 4); PROFILE_B=(4 2); PROFILE_STEPS=2
  TORCH=eager_float32; DTYPES=float32; EM_DTYPES=float32
  FAST="--steps=1 --warmup=0 --rounds=1"; SLOW="--steps=1 --warmup=0 --rounds=1"
  CAP_PROFILE=60; CAP_FAST=60; CAP_EM=60; CAP_TESTS=60; CAP_KERNELS=60
  ROUTING_KERNELS=(--tiny); EM_KERNELS=(--tiny)
  TESTS_ARGS=(--co)
else
  CAPSNET=capsnet_mnist; EM=matrix_capsnet_mnist
  CAPS_B=(128 64); EM_B=(64 16); PROFILE_B=(128 64); PROFILE_STEPS=5
  # Each side's best mode: PyTorch's was torch.compile (float32 or bfloat16)
  # on the H200, eager float32 stays as the rows' common reference.
  TORCH=${TORCH_MODES:-eager_float32,compile_float32,compile_bfloat16}
  DTYPES=float32,bfloat16
  # capsjax's bfloat16 EM step was slower than float32 on the H200 and its
  # compile costs about 20 s, more than this session can spare.
  EM_DTYPES=${EM_DTYPES:-float32}
  FAST="--steps=10 --warmup=2 --rounds=3"; SLOW="--steps=5 --warmup=2 --rounds=3"
  CAP_PROFILE=70; CAP_FAST=60; CAP_EM=110; CAP_TESTS=150; CAP_KERNELS=60
  ROUTING_KERNELS=(--batch_sizes=64,128); EM_KERNELS=(--batch_sizes=16,64)
  TESTS_ARGS=(-x -q -p no:cacheprovider -rfE --durations=15)
fi

# (b) Where the train steps spend their time.
RESERVE=$TESTS_RESERVE
step "$CAP_PROFILE" profile_capsnet_b${PROFILE_B[0]} "$OUT/profile_capsnet_b128.txt" -- \
  "$PY" -m benchmarks.profile_step --model=$CAPSNET --batch_size=${PROFILE_B[0]} \
  --steps=$PROFILE_STEPS --top=25
step "$CAP_PROFILE" profile_em_b${PROFILE_B[1]} "$OUT/profile_em_b64.txt" -- \
  "$PY" -m benchmarks.profile_step --model=$EM --batch_size=${PROFILE_B[1]} \
  --steps=$PROFILE_STEPS --top=25

# (c) Best mode against best mode, the targets first: one process and one
# JSON per row, so that a timeout loses one row only.
B="$PY -m experiments.benchmark --compare=torch --torch_modes=$TORCH"
compare() {  # CAP NAME MODEL BATCH DTYPES STEPS...
  local cap=$1 name=$2 model=$3 batch=$4 dtypes=$5; shift 5
  step "$cap" "$name" -- $B --model="$model" --batch_size="$batch" \
    --compare_dtypes="$dtypes" "$@" --output="$WORK/json/$name.json"
}
compare "$CAP_FAST" capsnet_b${CAPS_B[0]} $CAPSNET ${CAPS_B[0]} $DTYPES $FAST
compare "$CAP_EM" em_b${EM_B[0]} $EM ${EM_B[0]} $EM_DTYPES $SLOW
# The Pallas kernels (never the default until measured here): the routing
# alone against XLA's, then the train steps that route with them.
step "$CAP_KERNELS" routing_kernels -- "$PY" -m benchmarks.routing_kernels \
  "${ROUTING_KERNELS[@]}" --output="$WORK/json/routing_kernels.jsonl"
step "$CAP_KERNELS" em_kernels -- "$PY" -m benchmarks.em_kernels \
  "${EM_KERNELS[@]}" --output="$WORK/json/em_kernels.jsonl"
step "$CAP_FAST" capsnet_pallas_b${CAPS_B[0]} -- "$PY" -m experiments.benchmark \
  --model=$CAPSNET --batch_size=${CAPS_B[0]} --model_option=implementation=pallas \
  $FAST --output="$WORK/json/capsnet_pallas.json"
step "$CAP_EM" em_pallas_b${EM_B[0]} -- "$PY" -m experiments.benchmark \
  --model=$EM --batch_size=${EM_B[0]} --model_option=implementation=pallas \
  $SLOW --output="$WORK/json/em_pallas.json"
compare "$CAP_FAST" capsnet_b${CAPS_B[1]} $CAPSNET ${CAPS_B[1]} $DTYPES $FAST
compare "$CAP_EM" em_b${EM_B[1]} $EM ${EM_B[1]} $EM_DTYPES $SLOW
compare "$CAP_FAST" su_b${CAPS_B[0]} two_digit_capsnet ${CAPS_B[0]} $DTYPES $FAST
compare "$CAP_FAST" su_b${CAPS_B[1]} two_digit_capsnet ${CAPS_B[1]} $DTYPES $FAST
# Efficient-CapsNet has no PyTorch reference: capsjax in float32 alone.
step "$CAP_FAST" efficient -- "$PY" -m experiments.benchmark \
  --model=efficient_capsnet_mnist --sweep=batch_size:${CAPS_B[1]},${CAPS_B[0]} \
  $FAST --output="$WORK/json/efficient.json"

# (d) The routing and EM kernel tests on this device.
RESERVE=0
step "$CAP_TESTS" tests -- "$PY" -m pytest "${TESTS_ARGS[@]}" \
  tests/test_routing.py tests/test_em_kernel.py tests/test_released_em.py \
  tests/test_pallas_routing.py tests/test_pallas_em.py

# (e) The comparison tables into the summary, then the last pack.
{
  echo
  timeout 30 "$PY" - "$WORK/json" <<'EOF'
import glob, json, os, sys
from benchmarks import harness
rows, plain = [], []
for path in sorted(glob.glob(os.path.join(sys.argv[1], '*.json'))):
  try:
    for row in json.load(open(path))['rows']:
      (rows if row.get('compare') == 'torch' else plain).append(row)
  except Exception as e:
    print(f'{path}: {type(e).__name__}: {e}')
if rows:
  print(harness.compare_table(rows))
for row in plain:
  print(f"{row['model']} batch {row['batch_size']} {row['dtype']}: train "
        f"{row.get('train_images_per_s') or 0:.0f} img/s, compile "
        f"{row.get('compile_s') or 0:.1f} s")
for path in sorted(glob.glob(os.path.join(sys.argv[1], '*.jsonl'))):
  print(os.path.basename(path))
  for line in open(path):
    print(' ', line.strip())
EOF
  echo "total $(( $(date +%s) - T0 )) s"
} >> "$SUMMARY" 2>&1
pack
rm -f "$OUT/evidence.tar.gz.part"
cat "$SUMMARY"
