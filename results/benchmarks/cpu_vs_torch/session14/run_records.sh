#!/bin/bash
# Session 14: the records behind BENCHMARKS.md's session-14 section, one
# after the other. From the repository root; /work/runs/aadfd86 is a
# worktree of aadfd86 with this session's profile/train_step.py.
D=results/benchmarks/cpu_vs_torch/session14
P=results/benchmarks/cpu_vs_torch/profile_session14
source /work/venv/bin/activate 2>/dev/null || true
export PYTHONPATH=.
python $D/faults.py two_digit_capsnet 128 2>&1 | grep -v Warn > $D/faults_retained.log
CAPSJAX_RETAIN_HOST_MEMORY=0 python $D/faults.py two_digit_capsnet 128 2>&1 | grep -v Warn > $D/faults_default.log
python $D/torch_profile.py two_digit_capsnet 128 2>&1 | grep -v "Warn\|detach\|return float\|USDT" > $D/torch_profile_two_digit_capsnet_b128.log
for f in "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution" \
         "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution --xla_cpu_use_onednn=true" \
         "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution --xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=individual_convolution"; do
  echo "== XLA_FLAGS=$f"; XLA_FLAGS="$f" python $D/onednn_probe.py 2>&1 | grep -v Warn
done > $D/onednn_probe.log
python $D/transpose.py 2>&1 | grep -v Warn > $D/transpose.log
python results/benchmarks/cpu_vs_torch/profile_session12/profile.py two_digit_capsnet 128 2>&1 | grep -v Warn > $P/two_digit_capsnet_b128.txt
(cd /work/runs/aadfd86 && PYTHONPATH=/work/runs/aadfd86 python results/benchmarks/cpu_vs_torch/profile_session12/profile.py two_digit_capsnet 128 2>&1 | grep -v Warn) > $P/two_digit_capsnet_b128_aadfd86.txt
bash $D/run.sh new3 3 two_digit_capsnet:128:3 two_digit_capsnet:64:3 >> $D/run3.log
bash $D/run.sh new3 2 capsnet_mnist:128:2 capsnet_mnist:64:2 >> $D/run3.log
echo records done
