#!/bin/bash
# Session 16: oneDNN for every float32 CPU convolution (strides and padding
# added; the paper CapsNet's PrimaryCaps with oneDNN's input gradient only)
# against PyTorch, each a separate process of the command at the top of the
# BENCHMARKS section, alternated model by model, R times (default 1). From
# the repository root: bash results/benchmarks/cpu_vs_torch/session16/run_ratios.sh [MODEL/BATCH/STEPS...]
D=results/benchmarks/cpu_vs_torch/session16
source /work/venv/bin/activate 2>/dev/null || true
R=${R:-1}; TAG=${TAG:-onednn}
rows=("$@")
[ ${#rows[@]} -eq 0 ] && rows=(capsnet_mnist/128/3 capsnet_mnist/64/3
  capsnet_mnist:smoke/128/10 capsnet_mnist:smoke/64/10
  baseline_cnn_mnist/128/2 baseline_cnn_mnist/64/2)
for r in $(seq 1 $R); do
  for row in "${rows[@]}"; do
    IFS=/ read -r model batch steps <<< "$row"
    name=${model/:/_}_b${batch}_${TAG}_$r
    python -m experiments.benchmark --model=$model --batch_size=$batch \
      --steps=$steps --rounds=3 --compare=torch --output=$D/$name.json > $D/$name.log 2>&1
    echo "$model b$batch $TAG $r: $(tail -2 $D/$name.log | head -1)" | tee -a $D/run.log
  done
done
