#!/bin/bash
# Session 12, after run.sh: the smoke CapsNet (its PrimaryCaps 9x9 stride 2
# on 20x20 also takes the taps path), taps against patches, alternated;
# then the rows not yet measured with the session-11/12 default (baseline
# CNN at 128, the EM smoke model at 64 and 128). --compare=torch, one
# process each, idle machine.
# From the repository root: bash results/benchmarks/cpu_vs_torch/strided_taps/run2.sh
D=results/benchmarks/cpu_vs_torch/strided_taps
source /work/venv/bin/activate 2>/dev/null || true
for mb in "capsnet_mnist:smoke 64 3" "capsnet_mnist:smoke 128 3"; do
  set -- $mb
  for impl in taps patches; do
    name=${1/:/_}_b$2_$impl
    python -m experiments.benchmark --model=$1 --batch_size=$2 --model_option=conv_impl=$impl \
      --steps=$3 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1
    echo "$1 b$2 $impl: $(tail -2 $D/$name.log | head -1)"
  done
done
for mb in "matrix_capsnet_mnist:smoke 64 3" "matrix_capsnet_mnist:smoke 128 3" "baseline_cnn_mnist 128 2"; do
  set -- $mb
  name=${1/:/_}_b$2_default
  python -m experiments.benchmark --model=$1 --batch_size=$2 \
    --steps=$3 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1
  echo "$1 b$2 default: $(tail -2 $D/$name.log | head -1)"
done
