#!/usr/bin/env bash
# Idle-machine benchmarks (only once the full-length CapsNet run has ended):
# capsjax f32/bf16 against PyTorch eager/compile x f32/bf16, alternating in
# one process per model and batch; the paper EM model at batches 8, 16, 64;
# EM routing against its floor; the whole vs chunked EM step.
# Usage: idle_bench.sh COMMIT [STEPS_SCALE]   (results in /work/runs/idle_bench/<stamp>)
set -u
COMMIT=$1
SRC=/work/runs/src-$COMMIT
[ -d "$SRC" ] || git -C /work/main worktree add --detach "$SRC" "$COMMIT"
OUT=/work/runs/idle_bench/$(date -u +%Y%m%dT%H%M%SZ)-$COMMIT
mkdir -p "$OUT"
source /work/venv/bin/activate
cd "$SRC"
if pgrep -f "experiments.capsnet_mnist|experiments.reproduce|pytest" > /dev/null; then
  echo "not idle: a training run or tests are running" | tee "$OUT/ABORTED"; exit 1
fi
{ echo "commit $(git rev-parse HEAD)"; date -u +%FT%TZ; uptime; lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200
  python -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__)"; } > "$OUT/machine.txt" 2>&1
run() {  # name, then benchmark flags
  local name=$1; shift
  echo "$(date -u +%FT%TZ) start $name: $*" >> "$OUT/progress.log"
  local t0=$(date +%s)
  python -m experiments.benchmark "$@" --output="$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$(date -u +%FT%TZ) end $name rc=$? wall_s=$(( $(date +%s) - t0 )) load=$(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/progress.log"
}
CMP="--compare=torch --rounds=3"
# The targets first: paper CapsNet at 64 and 128, Su's capsule model at 128.
run capsnet_b64   --model=capsnet_mnist --batch_size=64 --steps=3 $CMP
run capsnet_b128  --model=capsnet_mnist --batch_size=128 --steps=3 $CMP
run su_b128       --model=two_digit_capsnet --batch_size=128 --steps=3 $CMP
# The paper EM model at 8, 16 and 64.
run em_b8         --model=matrix_capsnet_mnist --batch_size=8 --steps=2 $CMP
run em_b16        --model=matrix_capsnet_mnist --batch_size=16 --steps=2 $CMP
run em_b64        --model=matrix_capsnet_mnist --batch_size=64 --steps=1 $CMP
# The rest, as measured.
run su_b64        --model=two_digit_capsnet --batch_size=64 --steps=3 $CMP
run smoke_b128    --model=capsnet_mnist:smoke --batch_size=128 --steps=10 $CMP
run su_base_b128  --model=two_digit_baseline --batch_size=128 --steps=3 $CMP
run em_smoke_b64  --model=matrix_capsnet_mnist:smoke --batch_size=64 --steps=5 $CMP
run cnn_b128      --model=baseline_cnn_mnist --batch_size=128 --steps=2 $CMP
# EM routing alone against its floor (flops / peak, bytes / bandwidth).
run em_routing    --routing_only --routing_cases=em_convcaps1,em_class --steps=5
# Whole vs chunked EM train step, alternating, with XLA's memory analysis.
echo "$(date -u +%FT%TZ) start em_memory" >> "$OUT/progress.log"
python -m benchmarks.em_memory time --batches=8,16 --impls=whole,auto --rounds=3 > "$OUT/em_memory_time.log" 2>&1
python -m benchmarks.em_memory steps --batches=8,16,64 > "$OUT/em_memory_steps.log" 2>&1
echo "$(date -u +%FT%TZ) end em_memory load=$(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/progress.log"
echo done >> "$OUT/progress.log"
