#!/bin/bash
# Session 11: whole models, conv2d's CPU implementation x YNNPACK's
# convolution fusion on/off, each a separate process with --compare=torch.
# From the repository root: bash results/benchmarks/cpu_vs_torch/conv_backward_trial/sweep.sh
D=results/benchmarks/cpu_vs_torch/conv_backward_trial
export PYTHONPATH=.
NOYNN=--xla_cpu_experimental_ynn_fusion_type=-individual_convolution
for mb in "two_digit_capsnet 128" "two_digit_capsnet 64" "two_digit_baseline 128" "two_digit_baseline 64" "capsnet_mnist:smoke 128" "capsnet_mnist:smoke 64" "baseline_cnn_mnist 64" "capsnet_mnist 64" "matrix_capsnet_mnist:smoke 64"; do
  set -- $mb
  for cfg in "patches|" "patches|$NOYNN" "direct|$NOYNN" "space_to_depth|$NOYNN"; do
    impl=${cfg%%|*}; fl=${cfg#*|}
    steps=3; [ $1 = capsnet_mnist ] && steps=2
    out=$(CONV_IMPL_OVERRIDE=$impl XLA_FLAGS="$fl" python $D/bench_impl.py --model=$1 --batch_size=$2 --steps=$steps --rounds=3 --compare=torch 2>&1 | tail -2 | head -1)
    echo "$1 b$2 impl=$impl ynn_conv=$([ -n "$fl" ] && echo off || echo on) $out"
  done
done
