#!/bin/bash
# Session 15: the records behind BENCHMARKS.md's session-15 section, one
# after the other, on an otherwise idle machine. From the repository root.
D=results/benchmarks/cpu_vs_torch/session15
source /work/venv/bin/activate 2>/dev/null || true
export PYTHONPATH=.
q() { grep -v Warn; }
python results/benchmarks/cpu_vs_torch/session14/faults.py two_digit_capsnet 128 40 2>&1 | q > $D/faults_40_steps.log
python $D/passes.py 128 2>&1 | q > $D/passes_b128.log
python $D/kernel_grad.py 128 2>&1 | q > $D/kernel_grad_b128.log
python $D/gemm_peaks.py 2>&1 | q > $D/gemm_peaks.log
XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-individual_convolution,-individual_dot \
  python $D/gemm_peaks.py 2>&1 | q >> $D/gemm_peaks.log
for f in "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution" \
 "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution --xla_cpu_use_xnnpack=true --xla_cpu_experimental_xnn_fusion_type=individual_convolution" \
 "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution --xla_cpu_use_xnnpack=true --xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY" \
 "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution --xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true" \
 "--xla_cpu_experimental_ynn_fusion_type=individual_convolution"; do
  CAPSJAX_YNN_CONVOLUTIONS=1 XLA_FLAGS="$f" python $D/conv_flags.py 128 2>&1 | q
done > $D/conv_flags_b128.log
python $D/batch_per_image.py two_digit_capsnet 2>&1 | q > $D/batch_per_image.log
echo records done
