#!/bin/bash
# Session 15 prototype: Su's two models with their 3x3 layers through
# oneDNN, against PyTorch, each a separate process. From the repository root.
D=results/benchmarks/cpu_vs_torch/session15/onednn_ffi
source /work/venv/bin/activate 2>/dev/null || true
export PYTHONPATH=. OMP_NUM_THREADS=2
for r in 1 2; do
  for mb in two_digit_capsnet:128 two_digit_capsnet:64 two_digit_baseline:128 two_digit_baseline:64; do
    IFS=: read -r model batch <<< "$mb"
    name=${model}_b${batch}_onednn_$r
    python $D/benchmark_with_onednn.py --model=$model --batch_size=$batch \
      --steps=3 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1
    echo "$model b$batch onednn $r: $(grep '^| '$model $D/$name.log | tail -1)"
  done
done
