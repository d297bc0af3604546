#!/usr/bin/env bash
# Idle machine: the paper EM model with the fused EM kernel against PyTorch's
# modes (eager/compile x float32/bf16), alternating in one process, 2
# processes per batch; the EM smoke model; kernel vs XLA's chunked routing
# in one process; compiled memory. Usage: em_kernel_bench.sh COMMIT
set -u
COMMIT=$1
SRC=/work/runs/src-$COMMIT
[ -d "$SRC" ] || git -C /work/main worktree add --detach "$SRC" "$COMMIT" > /dev/null
OUT=/work/runs/idle_bench/$(date -u +%Y%m%dT%H%M%SZ)-$COMMIT-em-kernel
mkdir -p "$OUT"
source /work/venv/bin/activate
cd "$SRC"
if pgrep -f "experiments\.|pytest" > /dev/null; then
  echo "not idle: a training run or tests are running" | tee "$OUT/ABORTED"; exit 1
fi
{ echo "commit $(git rev-parse HEAD)"; date -u +%FT%TZ; uptime; lscpu | grep -E "Model name|^CPU\(s\)" ;
  python -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__)";
  python -c "from capsjax import em_kernel; print('em kernel:', em_kernel.status())"; } > "$OUT/machine.txt" 2>&1
run() {
  local name=$1; shift
  echo "$(date -u +%FT%TZ) start $name: $*" >> "$OUT/progress.log"
  local t0=$(date +%s)
  python -m experiments.benchmark "$@" --output="$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$(date -u +%FT%TZ) end $name rc=$? wall_s=$(( $(date +%s) - t0 )) load=$(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/progress.log"
}
CMP="--compare=torch --rounds=3"
for i in 1 2; do
  run em_b8_p$i  --model=matrix_capsnet_mnist --batch_size=8 --steps=2 $CMP
  run em_b16_p$i --model=matrix_capsnet_mnist --batch_size=16 --steps=2 $CMP
  run em_b64_p$i --model=matrix_capsnet_mnist --batch_size=64 --steps=1 $CMP
done
run em_smoke_b64 --model=matrix_capsnet_mnist:smoke --batch_size=64 --steps=5 $CMP
echo "$(date -u +%FT%TZ) start em_memory" >> "$OUT/progress.log"
python -m benchmarks.em_memory time --batches=8,16,64 --impls=kernel,auto --rounds=3 > "$OUT/em_memory_time.log" 2>&1
python -m benchmarks.em_memory steps --batches=8,16,64 --impls=kernel,auto > "$OUT/em_memory_steps.log" 2>&1
echo "$(date -u +%FT%TZ) end em_memory load=$(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/progress.log"
echo "$OUT"
