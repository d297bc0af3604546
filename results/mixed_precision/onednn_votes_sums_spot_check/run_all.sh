#!/usr/bin/env bash
# bfloat16 spot checks after the oneDNN votes product and bias sums (6a37f63):
# Su's capsule model on his two-digit protocol and the CapsNet smoke config, seed 0.
set -u
SRC=/work/runs/src-6a37f63
OUT=/work/runs/bf16_check
source /work/venv/bin/activate
cd "$SRC"
export CAPSJAX_NO_PROGRESS=1
w="$OUT/capsnet_smoke_bfloat16_seed0"
echo "start capsnet smoke bfloat16 seed 0 $(date -u +%FT%TZ)" >> "$OUT/runs.log"; t0=$(date +%s)
nice -n 15 python -m experiments.capsnet_mnist --workdir="$w" \
  --config=experiments/configs/capsnet_mnist.py:smoke \
  --config.data_dir=/work/shared/data --config.seed=0 \
  --config.compute_dtype=bfloat16 --config.max_train_seconds=0 > "$w.log" 2>&1
echo "end capsnet smoke bfloat16 seed 0 rc=$? wall_s=$(( $(date +%s) - t0 )) $(date -u +%FT%TZ)" >> "$OUT/runs.log"
w="$OUT/su_two_digit_bfloat16_seed0"
echo "start su bfloat16 seed 0 $(date -u +%FT%TZ)" >> "$OUT/runs.log"; t0=$(date +%s)
nice -n 15 python -m experiments.two_digit_transfer --workdir="$w" \
  --config=experiments/configs/two_digit_transfer.py \
  "--config.models=('two_digit_capsnet',)" \
  --config.data_dir=/work/shared/data --config.seed=0 \
  --config.compute_dtype=bfloat16 > "$w.log" 2>&1
echo "end su bfloat16 seed 0 rc=$? wall_s=$(( $(date +%s) - t0 )) $(date -u +%FT%TZ)" >> "$OUT/runs.log"
