#!/usr/bin/env bash
# Full-length runs of the paper suite on a lent GPU without internet, all
# NAMEs at once on the one GPU, each in its own workdir under the ignored
# .gpuruns/, and their evidence in at most 8 files under $OUT.
#
# Before the GPU run, in the repository root: the wheels the GPU image
# lacks in .whl/ (benchmarks/gpu_session.sh says how) and the MNIST IDX
# files in .data/mnist/ (a copy of the local data folder); both ignored.
# On the GPU machine, with both folders copied along and 10 minutes:
#   OUT=DIR bash tools/gpu_train.sh 540 capsnet_mnist_annealed \
#       capsnet_mnist_annealed_seed1
# MAX_SECONDS bounds each run (`reproduce --max_seconds`): a run cut short
# keeps its rows out, and its checkpoints (about 100 MB for the CapsNet) do
# not come back, so give it the whole call. $OUT receives env.txt,
# summary.txt (each run's exit status, wall time and last lines) and
# NAME.tar.gz (its workdir without checkpoints: summary.json, metrics,
# logs, TensorBoard events). Afterwards, here, with the archives extracted
# into one workdir W:
#   python -m experiments.reproduce --workdir=W --suite=paper --only=NAME \
#       --readme=docs/paper_suite_results.md
# `CPU_DRY_RUN=1 bash tools/gpu_train.sh 60 NAME` checks the script on a CPU
# (no wheels, a minute of training, into $OUT or /tmp/gpu_train_dry).
set -u
MAX=${1:?usage: gpu_train.sh MAX_SECONDS NAME...}; shift
[ $# -gt 0 ] && [ $# -le 6 ] || { echo 'gpu_train.sh: 1 to 6 run names' >&2; exit 2; }
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
T0=$(date +%s)
[ -d .data/mnist ] || { echo 'gpu_train.sh: no .data/mnist (copy the MNIST IDX files there)' >&2; exit 2; }
if [ "${CPU_DRY_RUN:-0}" = 1 ]; then
  OUT=${OUT:-/tmp/gpu_train_dry}; RUNS=$(mktemp -d /tmp/gpuruns.XXXXXX)
  export JAX_PLATFORMS=cpu PYTHONPATH=$PWD
else
  : "${OUT:?set OUT to the folder for the evidence}"; RUNS=.gpuruns
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 9
  export PYTHONPATH=/tmp/site:$PWD
fi
mkdir -p "$OUT" "$RUNS"
{ date -u +%FT%TZ; echo "commit $(git rev-parse HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) changed paths"
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import jax,flax,optax,sys;print(sys.version.split()[0],'jax',jax.__version__,jax.devices(),'flax',flax.__version__,'optax',optax.__version__)"
  nproc; } > "$OUT/env.txt" 2>&1
pids=()
for name in "$@"; do
  mkdir -p "$RUNS/$name"
  ( s=$(date +%s)
    "$PY" -m experiments.reproduce --workdir="$RUNS/$name" --suite=paper \
      --only="$name" --data_dir=.data --max_seconds="$MAX" \
      > "$RUNS/$name/reproduce_call.log" 2>&1
    echo "$name rc=$? wall $(( $(date +%s) - s )) s, ended $(date -u +%FT%TZ)" \
      > "$RUNS/$name/call_end.txt" ) &
  pids+=($!)
done
timeout $(( MAX + 60 )) nvidia-smi --query-gpu=utilization.gpu,memory.used \
  --format=csv -l 30 > "$RUNS/nvidia_smi.log" 2>&1 &
SMI=$!
wait "${pids[@]}"
kill "$SMI" 2>/dev/null
{ echo "gpu_train.sh $MAX $* at $(date -u +%FT%TZ), $(( $(date +%s) - T0 )) s"
  for name in "$@"; do
    cat "$RUNS/$name/call_end.txt"
    tr '\r' '\n' < "$RUNS/$name/reproduce_call.log" | grep -v '^\s*$' | tail -n 4
    cp "$RUNS/nvidia_smi.log" "$RUNS/$name/" 2>/dev/null
    tar -czf "$OUT/$name.tar.gz" -C "$RUNS" --exclude=checkpoints --exclude=best "$name"
  done; } > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
