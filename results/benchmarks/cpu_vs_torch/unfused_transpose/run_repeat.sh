#!/bin/bash
# Session 12, after run.sh: two more alternated pairs of the two models at
# batch 128 (run.sh's single pair was within PyTorch's process-to-process
# noise). Same setup; files end in _r<round>.
D=$PWD/results/benchmarks/cpu_vs_torch/unfused_transpose
NEW=$PWD
source /work/venv/bin/activate 2>/dev/null || true
for round in 2 3; do
for mb in "two_digit_capsnet 128 3" "capsnet_mnist 128 2"; do
  set -- $mb
  for side in old new; do
    dir=$NEW; [ $side = old ] && dir=$OLD
    name=${1/:/_}_b$2_${side}_r$round
    (cd $dir && PYTHONPATH=$dir python -m experiments.benchmark --model=$1 --batch_size=$2 \
      --steps=$3 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1)
    echo "$1 b$2 $side r$round: $(tail -2 $D/$name.log | head -1)"
  done
done
done
