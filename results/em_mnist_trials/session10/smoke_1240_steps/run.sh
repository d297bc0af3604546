#!/usr/bin/env bash
# #12 item 4: the EM smoke config with 1.2x the steps (its schedule scaled), in the
# wall time that 1035 steps took before the parent-major routing. 4 host devices, as CI.
set -u
source /work/venv/bin/activate
cd /work/runs/code5
export CAPSJAX_NO_PROGRESS=1 CAPSJAX_DATA_DIR=/work/shared/data
export XLA_FLAGS=--xla_force_host_platform_device_count=4
for seed in ${SEEDS:-0 1}; do
  start=$(date +%s)
  echo "=== seed $seed start $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD)"
  python -m experiments.matrix_capsnet --workdir=/work/runs/em_smoke1240/s$seed \
    --config=experiments/configs/matrix_capsnet_mnist.py:smoke --config.seed=$seed \
    --config.num_train_steps=1240 --config.lr_decay_steps=206 --config.margin_steps=990 \
    --config.eval_every_steps=310 --config.checkpoint_every_steps=310 | grep -v "^$"
  echo "=== seed $seed exit ${PIPESTATUS[0]} wall $(( $(date +%s) - start )) s"
done
