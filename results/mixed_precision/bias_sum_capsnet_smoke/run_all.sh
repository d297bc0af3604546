#!/usr/bin/env bash
# bfloat16 accuracy after the float32 sum of the bias gradients:
# capsnet_mnist:smoke, seeds 0-2, from the frozen worktree of e337569 (the
# float32 runs compile to the same program as before: ../onednn_bf16_capsnet_smoke).
set -u
SRC=/work/runs/src-e337569
OUT=/work/runs/bf16_bias_sum
mkdir -p "$OUT"
source /work/venv/bin/activate
cd "$SRC"
export CAPSJAX_NO_PROGRESS=1
for seed in 0 1 2; do
  w="$OUT/capsnet_smoke_bfloat16_seed${seed}"
  [ -f "$w/summary.json" ] && continue
  echo "start bfloat16 seed $seed $(date -u +%FT%TZ)" >> "$OUT/runs.log"
  t0=$(date +%s)
  nice -n 15 python -m experiments.capsnet_mnist --workdir="$w" \
    --config=experiments/configs/capsnet_mnist.py:smoke \
    --config.data_dir=/work/shared/data --config.seed=$seed \
    --config.compute_dtype=bfloat16 --config.max_train_seconds=0 \
    > "$w.log" 2>&1
  echo "end bfloat16 seed $seed rc=$? wall_s=$(( $(date +%s) - t0 )) $(date -u +%FT%TZ)" >> "$OUT/runs.log"
done
