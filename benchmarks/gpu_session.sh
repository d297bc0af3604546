#!/usr/bin/env bash
# One prepared GPU session, at most 9 minutes on a fresh machine without
# internet: the environment, then the variants of the train steps that
# decide where capsjax goes on a GPU, one process per model, routing
# implementation and convolution layout, each a grid of float32 and
# bfloat16 at batches 64, 128 and 16 (experiments.benchmark --sweep, the
# train step only): the paper CapsNet and the paper EM model with XLA's
# routing (then a profile of the bfloat16 CapsNet step), the EM model
# with the Pallas window kernel, the CapsNet with the Pallas routing
# kernel, the CapsNet with its convolutions forced to NCHW
# (--conv_layout=nchw; XLA's own choice on Hopper is NHWC:
# docs/gpu_plan.md); last a profile of the bfloat16 EM step.
# Steps run in that order while the budget lasts; one it no longer fits
# is skipped and says so, and one cut off keeps the rows it finished (its
# JSON is rewritten after each row).
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
# What comes back in $OUT (6 files): env.txt (machine and versions),
# summary.txt (each step's exit status and wall time, every row, then the
# variant tables: bfloat16 against float32, Pallas against XLA, NCHW
# against XLA's layout), all.log (every step's output as it ran),
# profile_capsnet_b128_bf16.txt and profile_em_b64_bf16.txt (the top ops
# and what the compiled step runs), evidence.tar.gz (the JSON rows, with
# each compiled step's fusions and cuDNN convolution layouts, and the
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
# Each step is a new process: a persistent compilation cache lets a
# later one reuse a program an earlier one compiled.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/capsjax_jax_cache}
if [ "$DRY" = 1 ]; then
  OUT=${OUT:-/tmp/gpu_session_dry}
  export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=
  TOTAL=${SESSION_SECONDS:-420}; PACK=15
else
  TOTAL=${SESSION_SECONDS:-540}; PACK=25
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

# Sizes: the GPU's, or tiny ones for the CPU check (where the Pallas
# kernels run in their interpreter: one row each).
if [ "$DRY" = 1 ]; then
  CAPSNET=capsnet_mnist:smoke; EM=matrix_capsnet_mnist:smoke
  CAPS_GRID='batch_size:4,2;dtype:float32,bfloat16'; EM_GRID=$CAPS_GRID
  EM_PALLAS_GRID='batch_size:2;dtype:float32'; CAPS_PALLAS_GRID=$EM_PALLAS_GRID
  LAYOUT_GRID='batch_size:2;dtype:float32,bfloat16'
  PROFILE_CAPS_B=4; PROFILE_EM_B=2; PROFILE_STEPS=2
  TIMING="--steps=1 --warmup=0"
  CAP_CAPS=90; CAP_EM=90; CAP_PALLAS=90; CAP_LAYOUT=60; CAP_PROFILE=60
else
  CAPSNET=capsnet_mnist; EM=matrix_capsnet_mnist
  CAPS_GRID='batch_size:64,128,16;dtype:float32,bfloat16'
  EM_GRID='batch_size:64,16,128;dtype:float32,bfloat16'
  EM_PALLAS_GRID=$EM_GRID; CAPS_PALLAS_GRID=$CAPS_GRID
  LAYOUT_GRID='batch_size:64,128;dtype:float32,bfloat16'
  PROFILE_CAPS_B=128; PROFILE_EM_B=64; PROFILE_STEPS=5
  TIMING="--steps=10 --warmup=2"
  # A row's compile on the H100/H200: CapsNet 6-11 s; the EM model 18-35 s
  # with XLA's routing, 12 s with the Pallas window kernel.
  CAP_CAPS=90; CAP_EM=150; CAP_PALLAS=100; CAP_LAYOUT=60; CAP_PROFILE=50
fi

# (b) The variants: one process per model, implementation and layout, a
# row per point of its grid, one JSON each.
B="$PY -m experiments.benchmark --train_only $TIMING"
variants() {  # CAP NAME MODEL IMPLEMENTATION GRID [FLAGS...]
  local cap=$1 name=$2 model=$3 implementation=$4 grid=$5; shift 5
  step "$cap" "$name" -- $B --model="$model" \
    --model_option=implementation="$implementation" --sweep="$grid" "$@" \
    --output="$WORK/json/$name.json"
}
variants "$CAP_CAPS" capsnet_xla $CAPSNET xla "$CAPS_GRID"
# Where the bfloat16 CapsNet step spends its time (the float32 steps'
# profiles: results/benchmarks/gpu_h100).
step "$CAP_PROFILE" profile_capsnet_b${PROFILE_CAPS_B}_bf16 \
  "$OUT/profile_capsnet_b128_bf16.txt" -- \
  "$PY" -m benchmarks.profile_step --model=$CAPSNET --dtype=bfloat16 \
  --batch_size=$PROFILE_CAPS_B --steps=$PROFILE_STEPS --top=25
variants "$CAP_EM" em_xla $EM xla "$EM_GRID"
variants "$CAP_PALLAS" em_pallas $EM pallas "$EM_PALLAS_GRID"
variants "$CAP_CAPS" capsnet_pallas $CAPSNET pallas "$CAPS_PALLAS_GRID"
variants "$CAP_LAYOUT" capsnet_nchw $CAPSNET xla "$LAYOUT_GRID" --conv_layout=nchw

# (c) Where the bfloat16 EM step spends its time.
step "$CAP_PROFILE" profile_em_b${PROFILE_EM_B}_bf16 \
  "$OUT/profile_em_b64_bf16.txt" -- \
  "$PY" -m benchmarks.profile_step --model=$EM --dtype=bfloat16 \
  --batch_size=$PROFILE_EM_B --steps=$PROFILE_STEPS --top=25

# (d) Every row and the variant tables into the summary, then the last
# pack.
{
  echo
  timeout 30 "$PY" - "$WORK/json" <<'EOF'
import glob, json, os, sys
from benchmarks import harness
rows = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], '*.json'))):
  try:
    rows += json.load(open(path))['rows']
  except Exception as e:
    print(f'{path}: {type(e).__name__}: {e}')
for row in rows:
  ops = row.get('compiled_ops', {})
  print(f"{row['label']} conv_layout={row.get('conv_layout')}: train "
        f"{row.get('train_images_per_s') or 0:.1f} img/s, compile "
        f"{row.get('compile_s') or 0:.1f} s, {ops.get('fusions')} fusions "
        f"({ops.get('layout_fusions')} transpose/copy), "
        f"{len(ops.get('convolutions', []))} convolution custom calls, peak "
        f"{(row.get('peak_memory_bytes') or 0) / 2**30:.2f} GiB")
print()
print(harness.variant_table(rows))
EOF
  echo "total $(( $(date +%s) - T0 )) s"
} >> "$SUMMARY" 2>&1
pack
rm -f "$OUT/evidence.tar.gz.part"
cat "$SUMMARY"
