#!/usr/bin/env bash
# Idle machine, nothing else running: capsjax's modes against PyTorch's
# (eager/compile x float32/bf16), alternating in one process, each model and
# batch in 3 separate processes. Usage: repeat_bench.sh COMMIT
set -u
COMMIT=$1
SRC=/work/runs/src-$COMMIT
[ -d "$SRC" ] || git -C /work/main worktree add --detach "$SRC" "$COMMIT" > /dev/null
OUT=/work/runs/idle_bench/$(date -u +%Y%m%dT%H%M%SZ)-$COMMIT-repeat
mkdir -p "$OUT"
source /work/venv/bin/activate
cd "$SRC"
if pgrep -f "experiments\.|pytest" > /dev/null; then
  echo "not idle: a training run or tests are running" | tee "$OUT/ABORTED"; exit 1
fi
{ echo "commit $(git rev-parse HEAD)"; date -u +%FT%TZ; uptime; lscpu | grep -E "Model name|^CPU\(s\)" ;
  python -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__)"; } > "$OUT/machine.txt" 2>&1
run() {
  local name=$1; shift
  echo "$(date -u +%FT%TZ) start $name: $*" >> "$OUT/progress.log"
  local t0=$(date +%s)
  python -m experiments.benchmark "$@" --output="$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$(date -u +%FT%TZ) end $name rc=$? wall_s=$(( $(date +%s) - t0 )) load=$(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/progress.log"
}
CMP="--compare=torch --rounds=5"
for i in 1 2 3; do
  run su_b128_p$i     --model=two_digit_capsnet --batch_size=128 --steps=5 $CMP
  run capsnet_b64_p$i  --model=capsnet_mnist --batch_size=64 --steps=3 $CMP
  run capsnet_b128_p$i --model=capsnet_mnist --batch_size=128 --steps=3 $CMP
done
run su_b64       --model=two_digit_capsnet --batch_size=64 --steps=5 $CMP
run smoke_b128   --model=capsnet_mnist:smoke --batch_size=128 --steps=10 $CMP
run su_base_b128 --model=two_digit_baseline --batch_size=128 --steps=3 $CMP
echo "$OUT"
