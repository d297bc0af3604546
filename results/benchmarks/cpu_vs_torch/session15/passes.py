"""Session 15: each pass of each convolution of Su's trunk alone at batch B
(forward; input gradient; kernel gradient) as capsjax runs it on this CPU
(layers.conv2d's automatic choice) and as PyTorch does, alternated in one
process, host memory retained, 2 threads. PYTHONPATH=. python this [B] [ROUNDS]"""
import sys, time, numpy as np
from capsjax.training import host_memory
print('host memory:', host_memory.retain_freed_memory())
import jax, jax.numpy as jnp, torch
from capsjax import layers

B = int(sys.argv[1]) if len(sys.argv) > 1 else 128
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
torch.set_num_threads(2)
rng = np.random.default_rng(0)
for h, w, c, f in ((26, 26, 64, 64), (12, 12, 64, 128), (10, 10, 128, 128)):
  x = rng.standard_normal((B, h, w, c), np.float32)
  k = rng.standard_normal((3, 3, c, f), np.float32) * 0.1
  dy = rng.standard_normal((B, h - 2, w - 2, f), np.float32)
  xj, kj, dyj = map(jnp.asarray, (x, k, dy))
  conv = lambda x, k: layers.conv2d(x, k)
  fwd = jax.jit(conv)
  dx = jax.jit(lambda x, k, dy: jax.vjp(lambda x: conv(x, k), x)[1](dy))
  dk = jax.jit(lambda x, k, dy: jax.vjp(lambda k: conv(x, k), k)[1](dy))
  xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
  kt = torch.from_numpy(k).permute(3, 2, 0, 1).contiguous()
  dyt = torch.from_numpy(dy).permute(0, 3, 1, 2).contiguous()
  sides = {
      'forward': lambda: jax.block_until_ready(fwd(xj, kj)),
      'input grad': lambda: jax.block_until_ready(dx(xj, kj, dyj)),
      'kernel grad': lambda: jax.block_until_ready(dk(xj, kj, dyj)),
      'torch forward': lambda: torch.nn.functional.conv2d(xt, kt),
      'torch input grad': lambda: torch.nn.grad.conv2d_input(xt.shape, kt, dyt),
      'torch kernel grad': lambda: torch.nn.grad.conv2d_weight(xt, kt.shape, dyt),
  }
  times = {n: [] for n in sides}
  for fn in sides.values(): fn(); fn()
  for _ in range(rounds):
    for n, fn in sides.items():
      t = time.perf_counter(); fn(); fn(); fn()
      times[n].append((time.perf_counter() - t) / 3)
  # From 53e651d the default is oneDNN's where the onednn extra is
  # installed; CAPSJAX_ONEDNN=0 gives XLA's, as recorded in passes_b128.log.
  impl = layers.cpu_convolutions.cpu_conv_impl(
      c, 1, h * w, (h - 2) * (w - 2), onednn=layers.onednn.available())
  print(f'{h}x{w}x{c}->{f} ({impl}), b{B}: ' + ', '.join(
      f'{n} {np.median(ts) * 1e3:.1f}' for n, ts in times.items()) + ' ms',
      flush=True)
