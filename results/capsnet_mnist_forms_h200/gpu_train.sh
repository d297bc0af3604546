#!/usr/bin/env bash
# One device call: full-length CapsNet MNIST runs of the paper suite, two at
# once on the one GPU, each in its own workdir under the ignored .gpuruns/,
# which resume from their checkpoints when rerun (the workdirs did not
# survive between device calls; see README.md).
# Usage: gpu_train.sh COMMIT MAX_SECONDS NAME...
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); COMMIT=$1; MAX=$2; shift 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD
{ date -u +%FT%TZ; echo "commit $COMMIT (working tree as sent)"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c "import jax,flax,optax,sys;print(sys.version.split()[0],'jax',jax.__version__,jax.devices(),'flax',flax.__version__,'optax',optax.__version__)"; nproc; } > $OUT/env.txt 2>&1
pids=()
for name in "$@"; do
  mkdir -p .gpuruns/$name
  echo "window start $(date -u +%FT%TZ) max_seconds=$MAX device=gpu commit=$COMMIT" >> .gpuruns/$name/windows.log
  ( s=$(date +%s); python3 -m experiments.reproduce --workdir=.gpuruns/$name --suite=paper --only=$name \
      --data_dir=.data --max_seconds=$MAX > .gpuruns/$name/reproduce_calls.log 2>&1; rc=$?
    echo "window end $(date -u +%FT%TZ) rc=$rc wall_s=$(( $(date +%s) - s ))" >> .gpuruns/$name/windows.log ) &
  pids+=($!)
done
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv -l 30 > $OUT/nvidia_smi.log 2>&1 &
SMI=$!
wait "${pids[@]}"
kill $SMI 2>/dev/null
for name in "$@"; do
  mkdir -p $OUT/$name
  (cd .gpuruns/$name && find . -path ./$name/checkpoints -prune -o -path ./$name/best -prune -o -type f -print | \
     while read f; do mkdir -p "$OUT/$name/$(dirname "$f")"; cp "$f" "$OUT/$name/$f"; done)
done
echo "total $(( $(date +%s) - T0 )) s" > $OUT/total.txt
