#!/usr/bin/env bash
# bfloat16 against float32 accuracy: Su's capsule model on his two-digit
# protocol (two_digit_transfer.py), seeds 0-2, from the frozen worktree of
# fc41d29. A rerun resumes an interrupted run from its checkpoint.
set -u
SRC=/work/runs/src-fc41d29
OUT=/work/runs/bf16_acc
mkdir -p "$OUT"
source /work/venv/bin/activate
cd "$SRC"
export CAPSJAX_NO_PROGRESS=1
for seed in 0 1 2; do
  for dtype in float32 bfloat16; do
    w="$OUT/su_${dtype}_seed${seed}"
    [ -f "$w/summary.json" ] && continue
    echo "start su $dtype seed $seed $(date -u +%FT%TZ)" >> "$OUT/runs.log"
    t0=$(date +%s)
    nice -n 15 python -m experiments.two_digit_transfer --workdir="$w" \
      --config=experiments/configs/two_digit_transfer.py \
      "--config.models=('two_digit_capsnet',)" \
      --config.data_dir=/work/shared/data --config.seed=$seed \
      --config.compute_dtype=$dtype >> "$w.log" 2>&1
    echo "end su $dtype seed $seed rc=$? wall_s=$(( $(date +%s) - t0 )) $(date -u +%FT%TZ)" >> "$OUT/runs.log"
  done
done
