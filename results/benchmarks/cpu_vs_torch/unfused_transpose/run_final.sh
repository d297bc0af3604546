#!/bin/bash
# Session 12: the final code (NEW: eigen_conv on stride-1 / space-to-depth
# convolutions, every fusion boundary keyed on the input) against 14bb2ab
# (OLD: the boundary only in taps_conv, keyed on the cotangent): the paper
# CapsNet at 128 and Su's capsule model at 64, alternated, one process each.
# From the repository root: OLD=/work/runs/old14 bash this
D=$PWD/results/benchmarks/cpu_vs_torch/unfused_transpose
NEW=$PWD
source /work/venv/bin/activate 2>/dev/null || true
for mb in "capsnet_mnist 128 2" "two_digit_capsnet 64 3" "two_digit_baseline 128 3"; do
  set -- $mb
  for side in new old; do
    dir=$NEW; [ $side = old ] && dir=$OLD
    name=${1}_b$2_${side}_final
    (cd $dir && PYTHONPATH=$dir python -m experiments.benchmark --model=$1 --batch_size=$2 \
      --steps=$3 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1)
    echo "$1 b$2 $side: $(tail -2 $D/$name.log | head -1)"
  done
done
