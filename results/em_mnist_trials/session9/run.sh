#!/usr/bin/env bash
# #14 section 2: coordinate addition ('grid' vs 'authors') and the conv-capsule
# E-step normalisation (within each window vs across every parent of a child)
# on the EM smoke model, 4 host devices, as CI trains it. Resumable.
set -u
source /work/venv/bin/activate
cd /work/runs/code2
export CAPSJAX_NO_PROGRESS=1 CAPSJAX_DATA_DIR=/work/shared/data
export XLA_FLAGS=--xla_force_host_platform_device_count=4
run() {  # name seed overrides...
  local name=$1 seed=$2; shift 2
  local start=$(date +%s)
  echo "=== $name seed $seed start $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD) overrides: $*"
  python -m experiments.matrix_capsnet --workdir=/work/runs/em_trials/${name}_s$seed \
    --config=experiments/configs/matrix_capsnet_mnist.py:smoke --config.seed=$seed "$@" | grep -v "^$"
  echo "=== $name seed $seed exit ${PIPESTATUS[0]} wall $(( $(date +%s) - start )) s"
}
for seed in ${SEEDS:-0}; do [ -n "${BOTH:-}" ] && break
  [ -e /work/runs/em_trials/grid_window_s$seed/summary.json ] || run grid_window $seed
  [ -e /work/runs/em_trials/authors_coordinates_s$seed/summary.json ] || run authors_coordinates $seed --config.model_options.coordinate_form=authors
  run across_positions $seed --config.model_options.normalize_across_positions=True
done
if [ -n "${BOTH:-}" ]; then
  for seed in ${SEEDS:-0}; do
    run both $seed --config.model_options.coordinate_form=authors --config.model_options.normalize_across_positions=True
  done
fi
