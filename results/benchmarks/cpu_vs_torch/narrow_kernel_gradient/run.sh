#!/bin/bash
# Session 13: narrow_conv (NEW: first layers' kernel gradient as one product
# over channel-major patches) against 5891acb (OLD: patches_conv),
# alternated, one process each, --compare=torch, idle machine. OLD is a
# worktree of 5891acb. From the repository root:
# OLD=/work/runs/old_s13 bash results/benchmarks/cpu_vs_torch/narrow_kernel_gradient/run.sh
D=$PWD/results/benchmarks/cpu_vs_torch/narrow_kernel_gradient
NEW=$PWD
source /work/venv/bin/activate 2>/dev/null || true
run() {  # model batch steps tag
  for side in new old; do
    dir=$NEW; [ $side = old ] && dir=$OLD
    name=${1/:/_}_b$2_${side}_$4
    start=$(date +%s)
    (cd $dir && PYTHONPATH=$dir python -m experiments.benchmark --model=$1 --batch_size=$2 \
      --steps=$3 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1)
    echo "$1 b$2 $side $4 ($(( $(date +%s) - start )) s): $(tail -2 $D/$name.log | head -1)"
  done
}
run two_digit_capsnet 128 3 r1
run two_digit_capsnet 64 3 r1
run two_digit_capsnet 128 3 r2
run two_digit_capsnet 64 3 r2
run capsnet_mnist 128 2 r1
run two_digit_baseline 128 3 r1
run two_digit_baseline 64 3 r1
run two_digit_capsnet 128 3 r3
run capsnet_mnist 64 2 r1
run capsnet_mnist:smoke 64 3 r1
run capsnet_mnist:smoke 128 3 r1
run baseline_cnn_mnist 64 2 r1
run baseline_cnn_mnist 128 2 r1
run capsnet_mnist 128 2 r2
run matrix_capsnet_mnist:smoke 64 3 r1
run matrix_capsnet_mnist:smoke 128 3 r1
