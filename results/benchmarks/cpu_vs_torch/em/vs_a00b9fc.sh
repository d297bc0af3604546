#!/usr/bin/env bash
# The EM smoke model's train step (2 EM iterations, batch 32, 1 device) at
# a00b9fc (the commit the CPU-speed issue measured) and at this checkout,
# separate processes alternated 3 rounds. From the repository root:
#   A00=/path/to/checkout/of/a00b9fc bash results/benchmarks/cpu_vs_torch/em/vs_a00b9fc.sh
set -u
D=results/benchmarks/cpu_vs_torch/em
for iterations in ${ITERATIONS:-2 1}; do
  for round in 1 2 3; do
    for dir in "$A00" "$PWD"; do
      row=$(cd "$dir" && PYTHONPATH="$dir" python -m experiments.benchmark \
            --model=matrix_capsnet_mnist:smoke --batch_size=32 --steps=30 \
            --model_option=num_iterations=$iterations 2>&1 | grep -E "^\| matrix" | tail -1)
      echo "iterations $iterations round $round $(cd "$dir" && git rev-parse --short HEAD) $row" | tee -a $D/vs_a00b9fc.log
    done
  done
done
