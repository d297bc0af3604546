#!/bin/bash
# Session 15: the shipped oneDNN path (capsjax.onednn, 'onednn' extra
# installed) against PyTorch, each a separate process of the command at the
# top of the BENCHMARKS section, via session14/run.sh. From the repository root.
export D=results/benchmarks/cpu_vs_torch/session15
bash results/benchmarks/cpu_vs_torch/session14/run.sh onednn 2 two_digit_capsnet:128:3 two_digit_capsnet:64:3 >> $D/run_onednn.log
bash results/benchmarks/cpu_vs_torch/session14/run.sh onednn 1 two_digit_baseline:128:3 two_digit_baseline:64:3 >> $D/run_onednn.log
