"""Session 14: each convolution of Su's trunk alone at batch B, train step
(loss = sum(conv(x) * r): forward, one multiply-reduce, both gradients)
under each conv2d lowering and PyTorch's, alternated in one process, host
memory retained, 2 threads. PYTHONPATH=. python this [B] [ROUNDS] [IMPL...]"""
import sys, time, numpy as np
from capsjax.training import host_memory
print('host memory:', host_memory.retain_freed_memory())
import jax, jax.numpy as jnp, torch
from capsjax import layers

B = int(sys.argv[1]) if len(sys.argv) > 1 else 128
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
impls = sys.argv[3:] or ['space_to_depth', 'patches', 'taps', 'direct']
torch.set_num_threads(2)
rng = np.random.default_rng(0)
for h, w, c, f in ((26, 26, 64, 64), (12, 12, 64, 128), (10, 10, 128, 128)):
  x = rng.standard_normal((B, h, w, c), np.float32)
  k = rng.standard_normal((3, 3, c, f), np.float32) * 0.1
  r = rng.standard_normal((B, h - 2, w - 2, f), np.float32)
  xj, kj, rj = map(jnp.asarray, (x, k, r))
  sides = {}
  for impl in impls:
    step = jax.jit(jax.value_and_grad(
        lambda x, k, r, impl=impl: jnp.sum(layers.conv2d(x, k, impl=impl) * r),
        argnums=(0, 1)))
    sides[impl] = lambda step=step: jax.block_until_ready(step(xj, kj, rj))
  xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().requires_grad_()
  kt = torch.from_numpy(k).permute(3, 2, 0, 1).contiguous().requires_grad_()
  rt = torch.from_numpy(r).permute(0, 3, 1, 2).contiguous()
  def torch_step():
    xt.grad = kt.grad = None
    loss = (torch.nn.functional.conv2d(xt, kt) * rt).sum()
    loss.backward()
    return loss.item(), kt.grad
  sides['torch'] = torch_step
  times = {n: [] for n in sides}
  for fn in sides.values(): fn(); fn()
  for _ in range(rounds):
    for n, fn in sides.items():
      t = time.perf_counter(); fn(); fn(); fn()
      times[n].append((time.perf_counter() - t) / 3)
  print(f'{h}x{w}x{c}->{f}, b{B}, train step: ' + ', '.join(
      f'{n} {np.median(ts) * 1e3:.1f} ms' for n, ts in times.items()), flush=True)
