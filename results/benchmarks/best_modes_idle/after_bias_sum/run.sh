#!/usr/bin/env bash
# Pause the background training (SIGSTOP), time on the otherwise idle
# machine, resume it (SIGCONT) whatever happens. Usage: paused_bench.sh COMMIT
set -u
COMMIT=$1
SRC=/work/runs/src-$COMMIT
OUT=/work/runs/idle_bench/$(date -u +%Y%m%dT%H%M%SZ)-$COMMIT-paused
mkdir -p "$OUT"
PIDS=$(pgrep -f "experiments.reproduce|experiments.capsnet_mnist" | tr '\n' ' ')
trap 'kill -CONT $PIDS 2>/dev/null; echo "$(date -u +%FT%TZ) resumed $PIDS" >> "$OUT/progress.log"' EXIT
kill -STOP $PIDS; echo "$(date -u +%FT%TZ) paused $PIDS" >> "$OUT/progress.log"
sleep 3
source /work/venv/bin/activate
cd "$SRC"
{ echo "commit $(git rev-parse HEAD)"; date -u +%FT%TZ; uptime; } > "$OUT/machine.txt"
run() {
  local name=$1; shift
  echo "$(date -u +%FT%TZ) start $name: $*" >> "$OUT/progress.log"
  local t0=$(date +%s)
  python -m experiments.benchmark "$@" --output="$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$(date -u +%FT%TZ) end $name rc=$? wall_s=$(( $(date +%s) - t0 )) load=$(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/progress.log"
}
CMP="--compare=torch --rounds=3"
run capsnet_b64   --model=capsnet_mnist --batch_size=64 --steps=3 $CMP
run capsnet_b128  --model=capsnet_mnist --batch_size=128 --steps=3 $CMP
run su_b128       --model=two_digit_capsnet --batch_size=128 --steps=3 $CMP
run su_b64        --model=two_digit_capsnet --batch_size=64 --steps=3 $CMP
run smoke_b128    --model=capsnet_mnist:smoke --batch_size=128 --steps=10 $CMP
echo "$(date -u +%FT%TZ) start bias_ab" >> "$OUT/progress.log"
python /work/runs/bias_ab.py two_digit_capsnet 128 bfloat16 5 3 > "$OUT/bias_ab_su_b128.log" 2>&1
python /work/runs/bias_ab.py capsnet_mnist:smoke 128 bfloat16 5 5 > "$OUT/bias_ab_smoke_b128.log" 2>&1
echo "$(date -u +%FT%TZ) end bias_ab" >> "$OUT/progress.log"
echo "$OUT"
