#!/usr/bin/env bash
# One window of the full-length CapsNet MNIST run (official form), from the
# frozen worktree of the commit it started at. Usage: window.sh MAX_SECONDS
set -u
SRC=/work/runs/src-a00e459
WORK=/work/runs/paper
LOG=/work/runs/windows.log
mkdir -p "$WORK"
source /work/venv/bin/activate
cd "$SRC"
start=$(date -u +%FT%TZ); t0=$(date +%s)
echo "window start $start max_seconds=$1 host=$(hostname) commit=$(git rev-parse HEAD)" >> "$LOG"
nice -n 10 python -m experiments.reproduce --workdir="$WORK" --suite=paper \
  --only=capsnet_mnist --data_dir=/work/shared/data --max_seconds="$1" \
  >> /work/runs/reproduce_calls.log 2>&1
rc=$?
end=$(date -u +%FT%TZ)
echo "window end $end rc=$rc wall_s=$(( $(date +%s) - t0 ))" >> "$LOG"
tail -n 3 "$WORK/capsnet_mnist/reproduce.log" | tr '\r' '\n' | tail -n 2 >> "$LOG"
