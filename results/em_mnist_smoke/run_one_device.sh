#!/usr/bin/env bash
# After em_kernel_bench.sh, on the idle machine: the routing floors of
# ConvCaps1 (XLA and kernel), the reproduction suite's bench rows, and the
# EM smoke row of the reproduction suite (one device, kernel).
# Usage: em_kernel_after.sh COMMIT
set -u
COMMIT=$1
SRC=/work/runs/src-$COMMIT
[ -d "$SRC" ] || git -C /work/main worktree add --detach "$SRC" "$COMMIT" > /dev/null
OUT=/work/runs/em_kernel_after-$COMMIT
mkdir -p "$OUT/em_smoke"
source /work/venv/bin/activate
cd "$SRC"
log() { echo "$(date -u +%FT%TZ) $*" >> "$OUT/progress.log"; }
log "start routing floors"; t0=$(date +%s)
python -m experiments.benchmark --routing_only --routing_cases=em_convcaps1,em_convcaps1_kernel \
  --batch_size=8 --steps=3 --warmup=1 --output="$OUT/routing_floors.json" > "$OUT/routing_floors.log" 2>&1
log "end routing floors rc=$? wall_s=$(( $(date +%s) - t0 )) load=$(cut -d' ' -f1-3 /proc/loadavg)"
log "start bench suite"; t0=$(date +%s)
python -m experiments.reproduce --workdir="$OUT/bench_suite" --suite=bench --bench_steps=5 \
  --max_seconds=1200 --benchmarks="$OUT/bench_suite/BENCHMARKS.md" > "$OUT/bench_suite.log" 2>&1
log "end bench suite rc=$? wall_s=$(( $(date +%s) - t0 )) load=$(cut -d' ' -f1-3 /proc/loadavg)"
export CAPSJAX_NO_PROGRESS=1
for run in kernel_seed0 kernel_seed1 kernel_seed2 xla_seed0; do
  seed=${run##*seed}
  env=""; [ "${run%%_*}" = xla ] && env="CAPSJAX_EM_KERNEL=0"
  log "start em smoke $run"; t0=$(date +%s)
  env $env python -m experiments.matrix_capsnet --workdir="$OUT/em_smoke/$run" \
    --config=experiments/configs/matrix_capsnet_mnist.py:smoke \
    --config.data_dir=/work/shared/data --config.seed=$seed > "$OUT/em_smoke/$run.log" 2>&1
  log "end em smoke $run rc=$? wall_s=$(( $(date +%s) - t0 )) load=$(cut -d' ' -f1-3 /proc/loadavg)"
done
