#!/usr/bin/env bash
# #14 §2: the authors' (released code's) EM option set on the EM smoke model,
# thousands of steps, 4 host devices; then single-option changes. Resumable.
set -u
source /work/venv/bin/activate
cd /work/runs/code3
export CAPSJAX_NO_PROGRESS=1 CAPSJAX_DATA_DIR=/work/shared/data
export XLA_FLAGS=--xla_force_host_platform_device_count=4
run() {  # name variant seed overrides...
  local name=$1 variant=$2 seed=$3; shift 3
  local start=$(date +%s)
  echo "=== $name seed $seed start $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD) variant $variant overrides: $*"
  nice -n 19 python -m experiments.matrix_capsnet --workdir=/work/runs/em_authors/${name}_s$seed \
    --config=experiments/configs/matrix_capsnet_mnist.py:$variant --config.seed=$seed \
    --config.num_train_steps=3000 --config.max_train_seconds=900 \
    --config.eval_every_steps=500 --config.checkpoint_every_steps=500 "$@" | grep -v "^$"
  echo "=== $name seed $seed exit ${PIPESTATUS[0]} wall $(( $(date +%s) - start )) s"
}
"$@"
