"""Session 15: float32 matrix-product throughput of XLA:CPU (this process's
XLA_FLAGS) against PyTorch's, alternated in one process, 2 threads: a
2048^3 product and the 26x26x64->64 layer's forward as one product over
patches at batch 128 ([73728, 576] x [576, 64]).
PYTHONPATH=. [XLA_FLAGS=...] python this"""
import os, time, numpy as np
from capsjax.training import host_memory
print('host memory:', host_memory.retain_freed_memory())
print('XLA_FLAGS:', os.environ.get('XLA_FLAGS'))
import jax, jax.numpy as jnp, torch
torch.set_num_threads(2)
rng = np.random.default_rng(0)
for m, k, n in ((2048, 2048, 2048), (73728, 576, 64), (576, 73728, 64)):
  a = rng.standard_normal((m, k), np.float32); b = rng.standard_normal((k, n), np.float32)
  aj, bj = jnp.asarray(a), jnp.asarray(b)
  at, bt = torch.from_numpy(a), torch.from_numpy(b)
  f = jax.jit(lambda a, b: a @ b)
  hlo = f.lower(aj, bj).compile().as_text()
  kind = 'ynn_fusion' if 'ynn_fusion' in hlo else ('onednn' if 'onednn' in hlo else 'dot')
  sides = {'xla': lambda: jax.block_until_ready(f(aj, bj)), 'torch': lambda: at @ bt}
  times = {s: [] for s in sides}
  for fn in sides.values(): fn()
  for _ in range(7):
    for s, fn in sides.items():
      t = time.perf_counter(); fn(); fn(); times[s].append((time.perf_counter() - t) / 2)
  flops = 2 * m * k * n
  print(f'[{m}, {k}] x [{k}, {n}] (XLA: {kind}): ' + ', '.join(
      f'{s} {np.median(ts) * 1e3:.1f} ms = {flops / np.median(ts) / 1e9:.0f} GFLOP/s'
      for s, ts in times.items()), flush=True)
