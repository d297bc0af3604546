#!/usr/bin/env bash
# One or more training windows of the Efficient-CapsNet at its authors protocol on MNIST
# from the pinned worktree; each window's wall time logged.
# usage: window_efficient.sh MAX_SECONDS COMMIT
set -u
secs=$1; commit=$2
src=/work/runs/src-$commit
source /work/venv/bin/activate
cd "$src"
start=$(date -u +%FT%TZ); t0=$(date +%s)
echo "window start $start commit $commit max_seconds $secs" >> /work/runs/windows_efficient.log
nice -n 15 python -m experiments.reproduce --workdir=/work/runs/efficient --suite=paper \
  --only=efficient_capsnet_mnist --data_dir=/work/shared/data --max_seconds=$secs \
  >> /work/runs/reproduce_calls_efficient.log 2>&1
rc=$?
echo "window end $(date -u +%FT%TZ) rc $rc wall_s $(( $(date +%s) - t0 ))" >> /work/runs/windows_efficient.log
