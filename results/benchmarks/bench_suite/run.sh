#!/usr/bin/env bash
# Idle machine: the reproduction suite's bench rows at COMMIT (into a copy
# of BENCHMARKS.md), then the EM smoke config on one device through XLA's
# routing (CAPSJAX_EM_KERNEL=0), seeds 1 and 2, beside the kernel's seeds.
set -u
COMMIT=$1
SRC=/work/runs/src-$COMMIT
[ -d "$SRC" ] || git -C /work/main worktree add --detach "$SRC" "$COMMIT" > /dev/null
OUT=/work/runs/em_kernel_after-0c2abb4
source /work/venv/bin/activate
cd "$SRC"
log() { echo "$(date -u +%FT%TZ) $*" >> "$OUT/progress.log"; }
mkdir -p "$OUT/bench_suite_$COMMIT"
cp BENCHMARKS.md "$OUT/bench_suite_$COMMIT/BENCHMARKS.md"
log "start bench suite at $COMMIT"; t0=$(date +%s)
python -m experiments.reproduce --workdir="$OUT/bench_suite_$COMMIT" --suite=bench --bench_steps=5 \
  --max_seconds=1200 --benchmarks="$OUT/bench_suite_$COMMIT/BENCHMARKS.md" > "$OUT/bench_suite_$COMMIT.log" 2>&1
log "end bench suite rc=$? wall_s=$(( $(date +%s) - t0 )) load=$(cut -d' ' -f1-3 /proc/loadavg)"
export CAPSJAX_NO_PROGRESS=1
for seed in 1 2; do
  run=xla_seed$seed
  log "start em smoke $run at $COMMIT"; t0=$(date +%s)
  CAPSJAX_EM_KERNEL=0 python -m experiments.matrix_capsnet --workdir="$OUT/em_smoke/$run" \
    --config=experiments/configs/matrix_capsnet_mnist.py:smoke \
    --config.data_dir=/work/shared/data --config.seed=$seed > "$OUT/em_smoke/$run.log" 2>&1
  log "end em smoke $run rc=$? wall_s=$(( $(date +%s) - t0 )) load=$(cut -d' ' -f1-3 /proc/loadavg)"
done
