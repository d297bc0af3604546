"""Session 14: page faults and wall time of each compiled train step, with
and without glibc keeping freed memory (host_memory, which train_step.py
applies; CAPSJAX_RETAIN_HOST_MEMORY=0 leaves it off, as sessions 12-13's
profile scripts did by importing the launcher without calling it).
[CAPSJAX_RETAIN_HOST_MEMORY=0] PYTHONPATH=. python this MODEL BATCH [STEPS=8]"""
import resource, sys, time
sys.path.insert(0, 'results/benchmarks/cpu_vs_torch/profile')
import jax
from train_step import compiled_train_step
config, comp, (state, images, labels, key) = compiled_train_step(sys.argv[1:3])
for i in range(int(sys.argv[3]) if len(sys.argv) > 3 else 8):
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  t = time.perf_counter()
  state, _ = comp(state, images, labels, key); jax.block_until_ready(state)
  print(f'step {i}: {resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults} '
        f'page faults, {(time.perf_counter() - t) * 1e3:.1f} ms')
