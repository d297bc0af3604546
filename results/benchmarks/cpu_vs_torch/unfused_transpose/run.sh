#!/bin/bash
# Session 12: eigen_conv (kernel gradients reading the stored input, commit
# "new") against 59b3e18 ("old": XLA fuses the input's bias and ReLU into
# the kernel gradient's transpose), alternated, one process each,
# --compare=torch, idle machine. OLD is a worktree of 59b3e18.
# From the repository root: OLD=/work/runs/old59 bash results/benchmarks/cpu_vs_torch/unfused_transpose/run.sh
D=$PWD/results/benchmarks/cpu_vs_torch/unfused_transpose
NEW=$PWD
source /work/venv/bin/activate 2>/dev/null || true
for mb in "two_digit_capsnet 128 3" "capsnet_mnist 128 2" "two_digit_capsnet 64 3" "two_digit_baseline 128 3"; do
  set -- $mb
  for side in new old; do
    dir=$NEW; [ $side = old ] && dir=$OLD
    name=${1/:/_}_b$2_$side
    (cd $dir && PYTHONPATH=$dir python -m experiments.benchmark --model=$1 --batch_size=$2 \
      --steps=$3 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1)
    echo "$1 b$2 $side: $(tail -2 $D/$name.log | head -1)"
  done
done
