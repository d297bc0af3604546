#!/usr/bin/env bash
# The reproduction suite's bench rows on the idle machine: pause the
# background training (SIGSTOP), run, resume it (SIGCONT) whatever happens.
set -u
SRC=/work/runs/src-16fb55a
WORK=/work/runs/bench_suite
mkdir -p "$WORK"
LOG=$WORK/paused.log
PIDS=$(pgrep -f "experiments.reproduce --workdir=/work/runs/paper|experiments.capsnet_mnist" | tr '\n' ' ')
trap 'kill -CONT $PIDS 2>/dev/null; echo "$(date -u +%FT%TZ) resumed $PIDS" >> "$LOG"' EXIT
kill -STOP $PIDS; echo "$(date -u +%FT%TZ) paused $PIDS" >> "$LOG"
sleep 3
source /work/venv/bin/activate
cd "$SRC"
t0=$(date +%s)
python -m experiments.reproduce --workdir="$WORK" --suite=bench --bench_steps=5 \
  --max_seconds=1200 --benchmarks="$WORK/BENCHMARKS.md" > "$WORK/suite.log" 2>&1
echo "$(date -u +%FT%TZ) suite rc=$? wall_s=$(( $(date +%s) - t0 ))" >> "$LOG"
