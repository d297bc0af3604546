#!/bin/bash
# Session 12: YNNPACK elementwise fusions (+eltwise: a product's bias and
# ReLU fused into its YNNPACK fusion) on top of capsjax's default
# (-individual_convolution), alternated, one process each, --compare=torch.
# From the repository root: bash results/benchmarks/cpu_vs_torch/ynn_eltwise/run.sh
D=results/benchmarks/cpu_vs_torch/ynn_eltwise
source /work/venv/bin/activate 2>/dev/null || true
for mb in "capsnet_mnist 128 2" "two_digit_capsnet 128 3"; do
  set -- $mb
  for side in eltwise default; do
    flags=-individual_convolution; [ $side = eltwise ] && flags=$flags,+eltwise
    name=${1/:/_}_b$2_$side
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=$flags python -m experiments.benchmark --model=$1 --batch_size=$2 \
      --steps=$3 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1
    echo "$1 b$2 $side: $(tail -2 $D/$name.log | head -1)"
  done
done
