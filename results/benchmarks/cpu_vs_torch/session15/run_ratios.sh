#!/bin/bash
# Session 15: more ratio processes at ed1a44d for the top table (Su's
# capsule model and the paper CapsNet), via session14/run.sh. From the
# repository root.
export D=results/benchmarks/cpu_vs_torch/session15
start=$(date +%s)
bash results/benchmarks/cpu_vs_torch/session14/run.sh s15 4 two_digit_capsnet:128:3 two_digit_capsnet:64:3 >> $D/run.log
bash results/benchmarks/cpu_vs_torch/session14/run.sh s15 2 capsnet_mnist:128:2 capsnet_mnist:64:2 >> $D/run.log
echo "done in $(( $(date +%s) - start )) s" >> $D/run.log
