#!/usr/bin/env bash
# Idle machine: the A/B of 6a37f63's two bfloat16 changes and each bfloat16
# pass of Su's convolutions against PyTorch's.
set -u
SRC=/work/runs/src-6a37f63
R=/work/main/results/benchmarks/best_modes_idle/onednn_votes_and_sums
OUT=/work/runs/ab_idle; mkdir -p $OUT
source /work/venv/bin/activate
cd "$SRC"
if pgrep -f "experiments\.|pytest" > /dev/null; then echo "not idle" > $OUT/ABORTED; exit 1; fi
{ date -u +%FT%TZ; uptime; } > $OUT/machine.txt
cp $R/ab.py $OUT/ab.py
for spec in "two_digit_capsnet 128 7 5" "capsnet_mnist 128 3 2" "capsnet_mnist:smoke 128 7 10"; do
  set -- $spec
  echo "$(date -u +%FT%TZ) start ab $spec" >> $OUT/progress.log
  python $OUT/ab.py $spec > $OUT/ab_${1/:/_}_b$2.log 2>&1
  echo "$(date -u +%FT%TZ) end rc=$? load=$(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/progress.log
done
echo "$(date -u +%FT%TZ) start su_conv_passes bfloat16" >> $OUT/progress.log
python -m benchmarks.su_conv_passes 128 7 bfloat16 > $OUT/su_conv_passes_bf16.log 2>&1
echo "$(date -u +%FT%TZ) end rc=$? load=$(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/progress.log
