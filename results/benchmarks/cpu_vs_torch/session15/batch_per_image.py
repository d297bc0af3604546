"""Session 15: Su's capsule model's compiled train step per image at
batches 16-128, alternated in one process (does a smaller working set, one
that stays in cache, train faster per image?). PYTHONPATH=. python this"""
import sys
sys.path.insert(0, 'results/benchmarks/cpu_vs_torch/profile')
import jax, numpy as np, time
from train_step import compiled_train_step
model = sys.argv[1] if len(sys.argv) > 1 else 'two_digit_capsnet'
entries = {}
for b in (16, 32, 64, 128):
  _, comp, (state, images, labels, key) = compiled_train_step([model, str(b)])
  entries[b] = [comp, state, images, labels, key]
times = {b: [] for b in entries}
for r in range(6):
  for b, e in entries.items():
    comp, state, images, labels, key = e
    n = 128 // b * 2
    state, _ = comp(state, images, labels, key); jax.block_until_ready(state)
    t = time.perf_counter()
    for _ in range(n):
      state, _ = comp(state, images, labels, key)
    jax.block_until_ready(state)
    times[b].append((time.perf_counter() - t) / n / b)
    e[1] = state
for b, ts in times.items():
  print(f'{model} b{b}: {np.median(ts) * 1e3:.3f} ms per image, {1 / np.median(ts):.1f} img/s')
