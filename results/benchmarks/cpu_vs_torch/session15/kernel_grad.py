"""Session 15: the kernel gradient of Su's 26x26x64->64 3x3 convolution
alone at batch B: XLA's (the transposing convolution, as eigen_conv runs it),
one product of row-shifted inputs against column-shifted cotangents
('blocks': [B*24*26, 3C]^T @ [B*24*26, 3F], all nine taps at once), and
PyTorch's. PYTHONPATH=. python this [B] [ROUNDS]"""
import sys, time, numpy as np
from capsjax.training import host_memory
print('host memory:', host_memory.retain_freed_memory())
import jax, jax.numpy as jnp, torch
from capsjax import layers

B = int(sys.argv[1]) if len(sys.argv) > 1 else 128
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
torch.set_num_threads(2)
rng = np.random.default_rng(0)
H = W = 26; C = F = 64; K = 3
x = rng.standard_normal((B, H, W, C), np.float32)
k = rng.standard_normal((K, K, C, F), np.float32) * 0.1
dy = rng.standard_normal((B, H - 2, W - 2, F), np.float32)
xj, kj, dyj = map(jnp.asarray, (x, k, dy))

@jax.jit
def xla_grad(x, k, dy):
  return layers._kernel_gradient(x, k, dy, 1, 'VALID', x)

@jax.jit
def blocks_grad(x, k, dy):
  b, h, w, c = x.shape
  kh, kw, _, f = k.shape
  oh, ow = h - kh + 1, w - kw + 1
  lhs = jnp.concatenate([x[:, i:i + oh] for i in range(kh)], axis=-1)
  rhs = jnp.concatenate(
      [jnp.pad(dy, ((0, 0), (0, 0), (j, w - ow - j), (0, 0)))
       for j in range(kw)], axis=-1)
  g = jax.lax.dot_general(lhs.reshape(-1, kh * c), rhs.reshape(-1, kw * f),
                          (((0,), (0,)), ((), ())))
  return g.reshape(kh, c, kw, f).transpose(0, 2, 1, 3)

@jax.jit
def blocks_grad_flat(x, k, dy):
  # Row-shifted inputs as offsets into each image's flattened rows.
  b, h, w, c = x.shape
  kh, kw, _, f = k.shape
  oh, ow = h - kh + 1, w - kw + 1
  flat = x.reshape(b, h * w, c)
  lhs = jnp.concatenate([flat[:, i * w:i * w + oh * w] for i in range(kh)], -1)
  rhs = jnp.concatenate(
      [jnp.pad(dy, ((0, 0), (0, 0), (j, w - ow - j), (0, 0)))
       for j in range(kw)], axis=-1)
  g = jax.lax.dot_general(lhs, rhs.reshape(b, oh * w, kw * f),
                          (((0, 1), (0, 1)), ((), ())))
  return g.reshape(kh, c, kw, f).transpose(0, 2, 1, 3)

ref = np.asarray(xla_grad(xj, kj, dyj))
for fn in (blocks_grad, blocks_grad_flat):
  got = np.asarray(fn(xj, kj, dyj))
  print(fn.__name__, 'max |diff| / max |ref|:',
        float(np.abs(got - ref).max() / np.abs(ref).max()))
xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
kt = torch.from_numpy(k).permute(3, 2, 0, 1).contiguous()
dyt = torch.from_numpy(dy).permute(0, 3, 1, 2).contiguous()
def torch_grad():
  return torch.nn.grad.conv2d_weight(xt, kt.shape, dyt)
got = torch_grad().permute(2, 3, 1, 0).numpy()
print('torch max |diff| / max |ref|:', float(np.abs(got - ref).max() / np.abs(ref).max()))
sides = {'xla': lambda: jax.block_until_ready(xla_grad(xj, kj, dyj)),
         'blocks': lambda: jax.block_until_ready(blocks_grad(xj, kj, dyj)),
         'blocks_flat': lambda: jax.block_until_ready(blocks_grad_flat(xj, kj, dyj)),
         'torch': torch_grad}
times = {n: [] for n in sides}
for fn in sides.values(): fn(); fn()
for _ in range(rounds):
  for n, fn in sides.items():
    t = time.perf_counter(); fn(); fn(); fn()
    times[n].append((time.perf_counter() - t) / 3)
print(f'kernel gradient 26x26x64->64, b{B}: ' + ', '.join(
    f'{n} {np.median(ts) * 1e3:.1f} ms' for n, ts in times.items()), flush=True)
