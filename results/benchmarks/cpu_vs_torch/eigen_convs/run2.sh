#!/bin/bash
# Session 11, after run.sh (stopped): the remaining models at 2f754e0, whose
# conv2d takes the patches path for PrimaryCaps; "new" the default, "old"
# CAPSJAX_YNN_CONVOLUTIONS=1 (YNNPACK convolutions, every conv as patches,
# as before this session), alternated, one process each, idle machine.
# From the repository root: bash results/benchmarks/cpu_vs_torch/eigen_convs/run2.sh
D=results/benchmarks/cpu_vs_torch/eigen_convs
source /work/venv/bin/activate 2>/dev/null || true
for mb in "two_digit_baseline 128 3" "two_digit_baseline 64 3" \
          "capsnet_mnist:smoke 128 3" "capsnet_mnist:smoke 64 3" "baseline_cnn_mnist 64 2" \
          "matrix_capsnet_mnist:smoke 64 3"; do
  set -- $mb
  for side in new old; do
    yn=0; [ $side = old ] && yn=1
    name=${1/:/_}_b$2_$side
    CAPSJAX_YNN_CONVOLUTIONS=$yn python -m experiments.benchmark --model=$1 --batch_size=$2 \
      --steps=$3 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1
    echo "$1 b$2 $side: $(tail -2 $D/$name.log | head -1)"
  done
done
