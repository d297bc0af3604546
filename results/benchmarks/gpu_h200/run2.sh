#!/usr/bin/env bash
# Second device call: the routing tests on the GPU, the paper EM model at
# batch 16 and the paper CapsNet at batch 64 against PyTorch's modes.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD
date -u +%FT%TZ > $OUT/env2.txt
step() { local t=$1 name=$2; shift 2; local s=$(date +%s);
  echo "=== $name start $(( s - T0 )) s" | tee -a $OUT/all2.log
  timeout $t "$@" >> $OUT/all2.log 2>&1; local rc=$?
  echo "=== $name rc=$rc wall $(( $(date +%s) - s )) s" | tee -a $OUT/all2.log; }
B="python3 -m experiments.benchmark"
step 100 tests_gpu python3 -m pytest -q -p no:cacheprovider -rfE tests/test_routing.py tests/test_released_em.py
step 110 em_paper_b16 $B --model=matrix_capsnet_mnist --batch_size=16 --steps=5 --warmup=2 --rounds=3 --compare=torch --output=$OUT/em_b16.json
step 70 capsnet_b64 $B --model=capsnet_mnist --batch_size=64 --steps=10 --warmup=2 --rounds=3 --compare=torch --output=$OUT/capsnet_b64.json
echo "total $(( $(date +%s) - T0 )) s" | tee -a $OUT/all2.log
