#!/bin/bash
# Session 12: eigen_conv (b65944a) with the boundary keyed on x itself
# (token x.reshape(-1)[0], so it need not wait for the cotangent) in a
# worktree /work/runs/xtok, against main (ce349ea code: no boundary on
# stride-1 convolutions), Su's capsule model at batch 128; rounds 3-6 ran
# with "for round in 3 4 5 6". run_xtoken.log collects the rows.
source /work/venv/bin/activate
D=/work/main/results/benchmarks/cpu_vs_torch/unfused_transpose
for round in 1 2; do
for side in xtok main; do
  dir=/work/main; [ $side = xtok ] && dir=/work/runs/xtok
  name=two_digit_capsnet_b128_${side}_r$round
  (cd $dir && PYTHONPATH=$dir python -m experiments.benchmark --model=two_digit_capsnet --batch_size=128 \
      --steps=3 --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1)
  echo "two_digit_capsnet b128 $side r$round: $(tail -2 $D/$name.log | head -1)"
done
done
