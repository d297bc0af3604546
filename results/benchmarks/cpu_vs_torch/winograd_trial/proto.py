import time, sys
from capsjax.training import host_memory
print(host_memory.retain_freed_memory())
import numpy as np, jax, jax.numpy as jnp
from capsjax import layers

BT = np.array([[1,0,-1,0],[0,1,1,0],[0,-1,1,0],[0,1,0,-1]], np.float32)
G = np.array([[1,0,0],[.5,.5,.5],[.5,-.5,.5],[0,0,1]], np.float32)
AT = np.array([[1,1,1,0],[0,1,-1,-1]], np.float32)

def _tile_transform(x, axis, tiles):
  # rows 2t..2t+3 of each tile, combined by B^T: [4, ...] stacked in front
  s = lambda k: jax.lax.slice_in_dim(x, k, k + 2 * tiles - 1, 2, axis)
  x0, x1, x2, x3 = s(0), s(1), s(2), s(3)
  return jnp.stack([x0 - x2, x1 + x2, x2 - x1, x1 - x3])

def winograd_conv(x, kernel):
  n, h, w, c = x.shape
  f = kernel.shape[-1]
  ho, wo = h - 2, w - 2
  th, tw = -(-ho // 2), -(-wo // 2)
  x = jnp.pad(x, ((0,0), (0, 2*th + 2 - h), (0, 2*tw + 2 - w), (0,0)))
  v = _tile_transform(x, 1, th)            # [4(row), N, Th, W', C]
  v = _tile_transform(v, 3, tw)            # [4(col), 4(row), N, Th, Tw, C]
  v = v.reshape(16, n * th * tw, c)
  u = jnp.einsum('ai,ijcf,bj->bacf', G, kernel, G).reshape(16, c, f)
  m = jnp.matmul(v, u).reshape(4, 4, n, th, tw, f)   # [col, row, ...]
  # A^T over rows, then over columns, written as sums of slices so that XLA
  # fuses the whole output transform and the interleave into one pass.
  r = [m[:, 0] + m[:, 1] + m[:, 2], m[:, 1] - m[:, 2] - m[:, 3]]  # [4(col), N, Th, Tw, F]
  y = [[ri[0] + ri[1] + ri[2], ri[1] - ri[2] - ri[3]] for ri in r]
  y = jnp.stack([jnp.stack(yi, axis=3) for yi in y], axis=2)  # [N, Th, 2, Tw, 2, F]
  return y.reshape(n, 2 * th, 2 * tw, f)[:, :ho, :wo]

def bench(fn, args, steps=10):
  fn(*args)[0].block_until_ready() if isinstance(fn(*args), tuple) else None
  ts = []
  for _ in range(steps):
    t = time.perf_counter(); r = fn(*args); jax.block_until_ready(r); ts.append(time.perf_counter() - t)
  return np.median(ts) * 1e3

shapes = [(128, 28, 28, 1, 64), (128, 26, 26, 64, 64), (128, 12, 12, 64, 128), (128, 10, 10, 128, 128)]
if len(sys.argv) > 1: shapes = [shapes[int(a)] for a in sys.argv[1:]]
for (n, h, w, c, f) in shapes:
  kx, kk = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (n, h, w, c)); k = jax.random.normal(kk, (3, 3, c, f)) * 0.1
  ref = layers._lax_conv(x.astype(jnp.float64) if False else x, k)
  out = jax.jit(winograd_conv)(x, k)
  err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
  res = {}
  for name, conv in (('patches', layers.patches_conv), ('winograd', winograd_conv), ('patches', layers.patches_conv), ('winograd', winograd_conv)):
    step = jax.jit(jax.grad(lambda x, k: jnp.sum(jnp.sin(conv(x, k))), argnums=(0, 1)))
    res.setdefault(name, []).append(bench(step, (x, k)))
  print(f'{h}x{w}x{c}->{f}: rel err {err:.1e}; train step ms ' + ', '.join(f'{k} {v}' for k, v in res.items()), flush=True)
