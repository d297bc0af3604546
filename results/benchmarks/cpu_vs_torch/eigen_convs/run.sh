#!/bin/bash
# Session 11: every model against PyTorch with XLA:CPU's Eigen convolutions
# and conv2d's per-layer CPU lowering ("new", the default) and with the
# YNNPACK convolutions and the patches path ("old", CAPSJAX_YNN_CONVOLUTIONS=1,
# what the code did before), alternated model by model, one process each.
# From the repository root: bash results/benchmarks/cpu_vs_torch/eigen_convs/run.sh
D=results/benchmarks/cpu_vs_torch/eigen_convs
source /work/venv/bin/activate 2>/dev/null || true
for mb in "two_digit_capsnet 128 3" "two_digit_capsnet 64 3" "capsnet_mnist 64 2" "capsnet_mnist 128 2" \
          "two_digit_baseline 128 3" "two_digit_baseline 64 3" "capsnet_mnist:smoke 128 3" "capsnet_mnist:smoke 64 3" \
          "baseline_cnn_mnist 64 2" "baseline_cnn_mnist 128 2" "matrix_capsnet_mnist:smoke 64 3" \
          "matrix_capsnet_mnist:smoke 128 3" "matrix_capsnet_mnist 64 2"; do
  set -- $mb
  for side in new old; do
    yn=0; [ $side = old ] && yn=1
    name=${1/:/_}_b$2_$side
    CAPSJAX_YNN_CONVOLUTIONS=$yn python -m experiments.benchmark --model=$1 --batch_size=$2 \
      --steps=$3 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1
    echo "$1 b$2 $side: $(tail -2 $D/$name.log | head -1)"
  done
done
