#!/bin/bash
# Session 12: the paper CapsNet at batch 64, the final code (taps with the
# kernel gradient reading the stored input) against 59b3e18, two
# alternated pairs. OLD=/work/runs/old59 bash this (repository root).
D=$PWD/results/benchmarks/cpu_vs_torch/unfused_transpose
NEW=$PWD
source /work/venv/bin/activate 2>/dev/null || true
for round in 1 2; do
  for side in new old; do
    dir=$NEW; [ $side = old ] && dir=$OLD
    name=capsnet_mnist_b64_${side}_r$round
    (cd $dir && PYTHONPATH=$dir python -m experiments.benchmark --model=capsnet_mnist --batch_size=64 \
      --steps=3 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1)
    echo "capsnet_mnist b64 $side r$round: $(tail -2 $D/$name.log | head -1)"
  done
done
