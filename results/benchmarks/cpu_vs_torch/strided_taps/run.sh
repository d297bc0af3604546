#!/bin/bash
# Session 12: the paper CapsNet with PrimaryCaps as "taps" (the new default:
# XLA's strided convolution forward and kernel gradient, the input gradient
# tap by tap) against "patches" (session 11's default), alternated, one
# process each, idle machine, --compare=torch.
# From the repository root: bash results/benchmarks/cpu_vs_torch/strided_taps/run.sh
D=results/benchmarks/cpu_vs_torch/strided_taps
source /work/venv/bin/activate 2>/dev/null || true
for mb in "capsnet_mnist 64 3" "capsnet_mnist 128 2"; do
  set -- $mb
  for impl in taps patches; do
    name=${1/:/_}_b$2_$impl
    python -m experiments.benchmark --model=$1 --batch_size=$2 --model_option=conv_impl=$impl \
      --steps=$3 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1
    echo "$1 b$2 $impl: $(tail -2 $D/$name.log | head -1)"
  done
done
