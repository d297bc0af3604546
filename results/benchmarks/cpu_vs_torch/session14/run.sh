#!/bin/bash
# Session 14: the ratio rows of the top table, each a separate process of
# experiments.benchmark --compare=torch, alternated model by model, REPEAT
# times, into $D (default this folder). From the repository root: bash results/benchmarks/cpu_vs_torch/session14/run.sh TAG REPEAT MODEL:BATCH:STEPS...
D=${D:-results/benchmarks/cpu_vs_torch/session14}
source /work/venv/bin/activate 2>/dev/null || true
tag=$1; repeat=$2; shift 2
for r in $(seq 1 $repeat); do
  for mbs in "$@"; do
    IFS=: read -r model batch steps <<< "$mbs"
    name=${model}_b${batch}_${tag}_$r
    python -m experiments.benchmark --model=$model --batch_size=$batch \
      --steps=$steps --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1
    echo "$model b$batch $tag $r: $(tail -2 $D/$name.log | head -1)"
  done
done
