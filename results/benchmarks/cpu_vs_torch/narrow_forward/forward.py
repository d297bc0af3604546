"""Session 14: the forward pass of the narrow (1-channel) first layers alone,
XLA's convolution (narrow_conv's forward) against one product over
patches ([B*H'*W', Kh*Kw*C] @ [Kh*Kw*C, F]), and PyTorch's, alternated in
one process, host memory retained. PYTHONPATH=. python this [B] [ROUNDS]"""
import sys, time, numpy as np
from capsjax.training import host_memory
print('host memory:', host_memory.retain_freed_memory())
import jax, jax.numpy as jnp, torch
from capsjax import layers

B = int(sys.argv[1]) if len(sys.argv) > 1 else 128
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
torch.set_num_threads(2)
rng = np.random.default_rng(0)
# (H, W, C, K, F): Su's conv1, the paper CapsNet's, the baseline CNN's
# (SAME, so padded to 32x32), the smoke CapsNet's.
for h, w, c, kk, f in ((28, 28, 1, 3, 64), (28, 28, 1, 9, 256),
                       (32, 32, 1, 5, 256), (28, 28, 1, 9, 32)):
  x = rng.standard_normal((B, h, w, c), np.float32)
  k = rng.standard_normal((kk, kk, c, f), np.float32) * 0.1
  xj, kj = jnp.asarray(x), jnp.asarray(k)
  conv = jax.jit(layers._checked_valid_conv)
  patches = jax.jit(layers._patches_matmul)
  np.testing.assert_allclose(conv(xj, kj), patches(xj, kj), rtol=2e-4, atol=2e-4)
  xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
  kt = torch.from_numpy(k).permute(3, 2, 0, 1).contiguous()
  def torch_fwd():
    with torch.no_grad():
      return torch.nn.functional.conv2d(xt, kt)
  sides = {'xla conv': lambda: jax.block_until_ready(conv(xj, kj)),
           'patches @ kernel': lambda: jax.block_until_ready(patches(xj, kj)),
           'torch': torch_fwd}
  times = {n: [] for n in sides}
  for fn in sides.values(): fn(); fn()
  for _ in range(rounds):
    for n, fn in sides.items():
      t = time.perf_counter(); fn(); fn(); fn()
      times[n].append((time.perf_counter() - t) / 3)
  print(f'{h}x{w}x{c} {kk}x{kk} -> {f}, b{B}, forward: ' + ', '.join(
      f'{n} {np.median(ts) * 1e3:.1f} ms' for n, ts in times.items()), flush=True)
