"""Session 14: each convolution of Su's trunk alone at batch B, capsjax's
default CPU lowering (conv2d) against PyTorch's nn.functional.conv2d, in
one process, alternated: forward, and forward + both gradients with a
fixed cotangent (loss = sum(conv(x) * r): the convolution, one multiply-
reduce, and its backward). Host memory retained on both sides, 2 threads.
PYTHONPATH=. python this [B] [ROUNDS]"""
import sys, time, numpy as np
from capsjax.training import host_memory
print('host memory:', host_memory.retain_freed_memory())
import jax, jax.numpy as jnp, torch
from capsjax import layers, cpu_convolutions

B = int(sys.argv[1]) if len(sys.argv) > 1 else 128
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
torch.set_num_threads(2)
rng = np.random.default_rng(0)
# (H, W, C, F) of Su's four 3x3 VALID layers on 28x28 inputs.
for h, w, c, f in ((28, 28, 1, 64), (26, 26, 64, 64), (12, 12, 64, 128),
                   (10, 10, 128, 128)):
  x = rng.standard_normal((B, h, w, c), np.float32)
  k = rng.standard_normal((3, 3, c, f), np.float32) * 0.1
  r = rng.standard_normal((B, h - 2, w - 2, f), np.float32)
  impl = cpu_convolutions.cpu_conv_impl(c, 1, h * w, (h - 2) * (w - 2))
  fwd = jax.jit(lambda x, k: layers.conv2d(x, k))
  grad = jax.jit(jax.value_and_grad(
      lambda x, k, r: jnp.sum(layers.conv2d(x, k) * r), argnums=(0, 1)))
  xj, kj, rj = map(jnp.asarray, (x, k, r))
  xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().requires_grad_()
  kt = torch.from_numpy(k).permute(3, 2, 0, 1).contiguous().requires_grad_()
  rt = torch.from_numpy(r).permute(0, 3, 1, 2).contiguous()
  def torch_fwd():
    with torch.no_grad():
      return torch.nn.functional.conv2d(xt, kt)
  def torch_grad():
    xt.grad = kt.grad = None
    y = torch.nn.functional.conv2d(xt, kt)
    loss = (y * rt).sum()
    loss.backward()
    return float(loss), kt.grad
  sides = {'capsjax fwd': lambda: jax.block_until_ready(fwd(xj, kj)),
           'torch fwd': torch_fwd,
           'capsjax train': lambda: jax.block_until_ready(grad(xj, kj, rj)),
           'torch train': torch_grad}
  times = {n: [] for n in sides}
  for n, fn in sides.items(): fn(); fn()
  for _ in range(rounds):
    for n, fn in sides.items():
      t = time.perf_counter(); fn(); fn(); fn()
      times[n].append((time.perf_counter() - t) / 3)
  print(f'{h}x{w}x{c}->{f} ({impl}), b{B}: ' + ', '.join(
      f'{n} {np.median(ts) * 1e3:.1f} ms' for n, ts in times.items()), flush=True)
