"""Session 15: each pass of Su's three convolutions (batch B) as XLA runs
them (space_to_depth, taps), through oneDNN by XLA FFI (capsjax.onednn,
the onednn extra), and in PyTorch; values checked against XLA's.
PYTHONPATH=. python this [B]"""
import os, sys, time, numpy as np
from capsjax.training import host_memory
print('host memory:', host_memory.retain_freed_memory())
import jax, jax.numpy as jnp, torch
from capsjax import layers
from capsjax import onednn

B = int(sys.argv[1]) if len(sys.argv) > 1 else 128
torch.set_num_threads(2)
rng = np.random.default_rng(0)
for h, w, c, f in ((26, 26, 64, 64), (12, 12, 64, 128), (10, 10, 128, 128)):
  print(f'{h}x{w}x{c}->{f} oneDNN kernels: {onednn.kernels(B, h, c, f)}')
  x = rng.standard_normal((B, h, w, c), np.float32)
  k = rng.standard_normal((3, 3, c, f), np.float32) * 0.1
  dy = rng.standard_normal((B, h - 2, w - 2, f), np.float32)
  xj, kj, dyj = map(jnp.asarray, (x, k, dy))
  sides = {}
  xla_impl = 'taps' if h < 20 else 'space_to_depth'  # the pre-oneDNN default
  for name, conv in (('capsjax', lambda x, k: layers.conv2d(x, k, impl=xla_impl)),
                     ('onednn', lambda x, k: layers.conv2d(x, k, impl='onednn'))):
    fwd = jax.jit(conv)
    dx = jax.jit(lambda x, k, dy, conv=conv: jax.vjp(lambda x: conv(x, k), x)[1](dy)[0])
    dk = jax.jit(lambda x, k, dy, conv=conv: jax.vjp(lambda k: conv(x, k), k)[1](dy)[0])
    sides[name] = (fwd, dx, dk)
  for i, what in enumerate(('forward', 'input grad', 'kernel grad')):
    args = (xj, kj) if i == 0 else (xj, kj, dyj)
    ref = np.asarray(sides['capsjax'][i](*args), np.float64)
    got = np.asarray(sides['onednn'][i](*args), np.float64)
    print(f'  {what}: max |oneDNN - XLA| / max |XLA| = {np.abs(got - ref).max() / np.abs(ref).max():.1e}')
  xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
  kt = torch.from_numpy(k).permute(3, 2, 0, 1).contiguous()
  dyt = torch.from_numpy(dy).permute(0, 3, 1, 2).contiguous()
  runs = {}
  for name, (fwd, dx, dk) in sides.items():
    runs[f'{name} forward'] = lambda fwd=fwd: jax.block_until_ready(fwd(xj, kj))
    runs[f'{name} input grad'] = lambda dx=dx: jax.block_until_ready(dx(xj, kj, dyj))
    runs[f'{name} kernel grad'] = lambda dk=dk: jax.block_until_ready(dk(xj, kj, dyj))
  runs['torch forward'] = lambda: torch.nn.functional.conv2d(xt, kt)
  runs['torch input grad'] = lambda: torch.nn.grad.conv2d_input(xt.shape, kt, dyt)
  runs['torch kernel grad'] = lambda: torch.nn.grad.conv2d_weight(xt, kt.shape, dyt)
  times = {n: [] for n in runs}
  for fn in runs.values(): fn(); fn()
  for _ in range(7):
    for n, fn in runs.items():
      t = time.perf_counter(); fn(); fn(); fn()
      times[n].append((time.perf_counter() - t) / 3)
  for side in ('capsjax', 'onednn', 'torch'):
    ms = [np.median(times[f'{side} {p}']) * 1e3 for p in ('forward', 'input grad', 'kernel grad')]
    print(f'  {side}: ' + ', '.join(f'{p} {m:.1f}' for p, m in zip(('forward', 'input grad', 'kernel grad'), ms))
          + f', sum {sum(ms):.1f} ms', flush=True)
