#!/bin/bash
# From the repository root; alternates the two settings, one process each.
D=results/benchmarks/cpu_vs_torch/eigen_dots
source /work/venv/bin/activate 2>/dev/null || true
for round in 1 2; do
  XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-individual_convolution python $D/dots.py
  XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-individual_convolution,-individual_dot python $D/dots.py
done
