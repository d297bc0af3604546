#!/usr/bin/env bash
# bfloat16 against float32 accuracy: capsnet_mnist:smoke, seeds 0-2, from the
# frozen worktree of fc41d29. Each run resumes if rerun.
set -u
SRC=/work/runs/src-fc41d29
OUT=/work/runs/bf16_acc
mkdir -p "$OUT"
source /work/venv/bin/activate
cd "$SRC"
export CAPSJAX_NO_PROGRESS=1
for seed in 0 1 2; do
  for dtype in float32 bfloat16; do
    w="$OUT/capsnet_smoke_${dtype}_seed${seed}"
    [ -f "$w/summary.json" ] && continue
    echo "start $dtype seed $seed $(date -u +%FT%TZ)" >> "$OUT/runs.log"
    t0=$(date +%s)
    nice -n 15 python -m experiments.capsnet_mnist --workdir="$w" \
      --config=experiments/configs/capsnet_mnist.py:smoke \
      --config.data_dir=/work/shared/data --config.seed=$seed \
      --config.compute_dtype=$dtype --config.max_train_seconds=0 \
      > "$w.log" 2>&1
    echo "end $dtype seed $seed rc=$? wall_s=$(( $(date +%s) - t0 )) $(date -u +%FT%TZ)" >> "$OUT/runs.log"
  done
done
