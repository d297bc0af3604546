#!/bin/bash
# Session 12: transpose.py under the XLA flag settings tried, one process
# each (capsjax's own flag is appended to each). From this folder:
# bash fused_transpose.sh > fused_transpose.log 2>&1
source /work/venv/bin/activate 2>/dev/null || true
for f in "" "--xla_cpu_use_fusion_emitters=false" "--xla_cpu_use_fusion_emitters=true" \
         "--xla_cpu_experimental_enable_tiling_propagation=true"; do
  XLA_FLAGS="$f" PYTHONPATH=../../../.. python transpose.py 2>&1 | grep -v "^[EWI]1124"
done
