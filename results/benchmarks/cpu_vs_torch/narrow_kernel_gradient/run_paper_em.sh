#!/bin/bash
# Session 13: the paper EM model with narrow_conv's first layer, one process
# each, --compare=torch (session 10's commands), from the repository root.
D=$PWD/results/benchmarks/cpu_vs_torch/narrow_kernel_gradient
source /work/venv/bin/activate 2>/dev/null || true
for bs in "8 3" "64 1"; do
  set -- $bs
  name=matrix_capsnet_mnist_b$1_now
  start=$(date +%s)
  PYTHONPATH=$PWD python -m experiments.benchmark --model=matrix_capsnet_mnist --batch_size=$1 \
    --steps=$2 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1
  echo "matrix_capsnet_mnist b$1 ($(( $(date +%s) - start )) s): $(tail -2 $D/$name.log | head -1)"
done
