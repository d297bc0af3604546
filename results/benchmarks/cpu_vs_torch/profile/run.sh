#!/bin/bash
# Re-runs this folder's CPU profiles of the train step (issue: CPU speed).
# From the repository root: bash results/benchmarks/cpu_vs_torch/profile/run.sh
set -x
P=results/benchmarks/cpu_vs_torch/profile
mkdir -p /tmp/capsjax_profile
export PYTHONPATH=.
# Page faults per train step, glibc defaults (0) and retained (1), with PyTorch's.
NSTEPS=8 python $P/mallopt.py two_digit_capsnet 128 0 > $P/faults_su_b128_default.txt 2>&1
NSTEPS=8 python $P/mallopt.py two_digit_capsnet 128 1 > $P/faults_su_b128_retained.txt 2>&1
# Per-kernel times of one train step (XLA's profiler, 3 steps averaged).
CAPSJAX_RETAIN_HOST_MEMORY=0 python $P/trace.py two_digit_capsnet 128 > /dev/null 2>&1
python $P/readtrace.py /tmp/capsjax_profile/trace_two_digit_capsnet 3 25 > $P/kernels_su_b128_default.txt
python $P/with_hm.py $P/trace.py two_digit_capsnet 128 > /dev/null 2>&1
python $P/readtrace.py /tmp/capsjax_profile/trace_two_digit_capsnet 3 25 > $P/kernels_su_b128_retained.txt
# Su's four convolutions alone, train (fwd+bwd) ms: patches path, row-patches variant, PyTorch.
python $P/with_hm.py $P/rowvjp.py 128 > $P/convs_su_b128_retained.txt 2>&1
# XLA CPU flags on the same convolutions.
for fl in "" "--xla_cpu_use_onednn=true" "--xla_cpu_experimental_ynn_fusion_type=+individual_convolution" "--xla_cpu_use_xnnpack=true --xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY"; do
  echo "XLA_FLAGS=$fl" >> $P/convs_su_b128_xla_flags.txt
  XLA_FLAGS="$fl" python $P/flagconv.py 2>&1 | grep -v Warn >> $P/convs_su_b128_xla_flags.txt
done
# The EM smoke model (2 iterations) kernel count and top kernels.
python $P/with_hm.py $P/trace2.py matrix_capsnet_mnist:smoke 32 num_iterations=2 > $P/em_smoke_it2_b32.txt 2>&1
python $P/readtrace.py /tmp/capsjax_profile/trace_em 3 25 >> $P/em_smoke_it2_b32.txt
