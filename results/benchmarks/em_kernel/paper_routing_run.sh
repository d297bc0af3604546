#!/usr/bin/env bash
# Idle machine: the paper EM model with the paper's routing options (3
# iterations everywhere, the lambda schedule; :paper) against PyTorch's
# modes, one process per batch. Usage: em_paper_variant_bench.sh COMMIT
set -u
COMMIT=$1
SRC=/work/runs/src-$COMMIT
[ -d "$SRC" ] || git -C /work/main worktree add --detach "$SRC" "$COMMIT" > /dev/null
OUT=/work/runs/idle_bench/$(date -u +%Y%m%dT%H%M%SZ)-$COMMIT-em-paper
mkdir -p "$OUT"
source /work/venv/bin/activate
cd "$SRC"
if pgrep -f "experiments\.|pytest" > /dev/null; then
  echo "not idle: a training run or tests are running" | tee "$OUT/ABORTED"; exit 1
fi
{ echo "commit $(git rev-parse HEAD)"; date -u +%FT%TZ; uptime;
  python -c "from capsjax import em_kernel; print('em kernel:', em_kernel.status())"; } > "$OUT/machine.txt" 2>&1
run() {
  local name=$1; shift
  echo "$(date -u +%FT%TZ) start $name: $*" >> "$OUT/progress.log"
  local t0=$(date +%s)
  python -m experiments.benchmark "$@" --output="$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$(date -u +%FT%TZ) end $name rc=$? wall_s=$(( $(date +%s) - t0 )) load=$(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/progress.log"
}
CMP="--compare=torch --rounds=3"
run paper_b8  --model=matrix_capsnet_mnist:paper --batch_size=8 --steps=2 $CMP
run paper_b16 --model=matrix_capsnet_mnist:paper --batch_size=16 --steps=2 $CMP
run paper_b64 --model=matrix_capsnet_mnist:paper --batch_size=64 --steps=1 $CMP
echo "$OUT"
