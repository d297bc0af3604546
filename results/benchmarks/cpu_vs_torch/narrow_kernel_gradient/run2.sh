#!/bin/bash
# Session 13: every model's ratio with narrow_conv (the committed code),
# one process each, --compare=torch, idle machine, from the repository root:
# bash results/benchmarks/cpu_vs_torch/narrow_kernel_gradient/run2.sh
D=$PWD/results/benchmarks/cpu_vs_torch/narrow_kernel_gradient
source /work/venv/bin/activate 2>/dev/null || true
run() {  # model batch steps tag
  name=${1/:/_}_b$2_now_$4
  start=$(date +%s)
  PYTHONPATH=$PWD python -m experiments.benchmark --model=$1 --batch_size=$2 \
    --steps=$3 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1
  echo "$1 b$2 $4 ($(( $(date +%s) - start )) s): $(tail -2 $D/$name.log | head -1)"
}
run two_digit_capsnet 128 3 r1
run two_digit_capsnet 64 3 r1
run capsnet_mnist:smoke 64 3 r1
run capsnet_mnist:smoke 128 3 r1
run matrix_capsnet_mnist:smoke 64 3 r1
run matrix_capsnet_mnist:smoke 128 3 r1
run two_digit_capsnet 128 3 r2
run two_digit_capsnet 64 3 r2
run capsnet_mnist 64 2 r1
run capsnet_mnist 128 2 r1
run two_digit_baseline 64 3 r1
run two_digit_baseline 128 3 r1
run two_digit_capsnet 128 3 r3
run two_digit_capsnet 64 3 r3
run baseline_cnn_mnist 64 2 r1
run baseline_cnn_mnist 128 2 r1
