#!/usr/bin/env bash
# One GPU lease: timings of capsjax against PyTorch's modes, the
# routing floors, a smoke training run and the routing tests.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD
{ date -u +%FT%TZ; echo "commit $1 (working tree as sent)"; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv;
  python3 -c "import jax,torch,flax,optax,sys;print(sys.version.split()[0],'jax',jax.__version__,jax.devices(),'torch',torch.__version__,'flax',flax.__version__,'optax',optax.__version__)"; nproc; } > $OUT/env.txt 2>&1
step() { local t=$1 name=$2; shift 2; local s=$(date +%s);
  echo "=== $name start $(( s - T0 )) s" | tee -a $OUT/all.log
  timeout $t "$@" >> $OUT/all.log 2>&1; local rc=$?
  echo "=== $name rc=$rc wall $(( $(date +%s) - s )) s" | tee -a $OUT/all.log; }
B="python3 -m experiments.benchmark"
step 130 capsnet_b128 $B --model=capsnet_mnist --batch_size=128 --steps=10 --warmup=2 --rounds=3 --compare=torch --output=$OUT/compare.json
step 140 em_paper_b64 $B --model=matrix_capsnet_mnist --batch_size=64 --steps=5 --warmup=2 --rounds=3 --compare=torch --output=$OUT/compare.json
step 80 su_b128 $B --model=two_digit_capsnet --batch_size=128 --steps=10 --warmup=2 --rounds=3 --compare=torch --output=$OUT/compare.json
step 40 routing_b64 $B --routing_only --batch_size=64 --steps=20 --output=$OUT/routing.json
step 80 train_smoke python3 -m experiments.capsnet_mnist --workdir=/tmp/smoke --config=experiments/configs/capsnet_mnist.py:smoke --config.data_dir=.data/mnist
cp /tmp/smoke/summary.json $OUT/train_smoke_summary.json 2>/dev/null
step 70 tests_routing python3 -m pytest -q -p no:cacheprovider tests/test_routing.py
echo "total $(( $(date +%s) - T0 )) s" | tee -a $OUT/all.log
