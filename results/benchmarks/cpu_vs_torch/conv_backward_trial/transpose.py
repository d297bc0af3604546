"""Session 11: the NHWC -> CHWN transpose that the kernel gradient's
convolution needs (x of Su's second 3x3 layer, [128, 26, 26, 64]), as XLA
emits it and in two steps (a 2-D transpose, then whole rows moved)."""
import time, numpy as np, jax, jax.numpy as jnp
from experiments import launcher  # noqa: F401


def bench(f, *args, n=9):
  jax.block_until_ready(f(*args)); ts = []
  for _ in range(n):
    t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
  return np.median(ts) * 1e3


def one_step(x):
  return jnp.transpose(x, (3, 1, 2, 0))


def two_steps(x):
  n, h, w, c = x.shape
  y = x.reshape(n, h * w * c).T                   # [(h, w, c), n]
  y = jax.lax.optimization_barrier(y)
  return y.reshape(h, w, c, n).transpose(2, 0, 1, 3)  # rows of n moved whole


def blocked(x, block=8):
  """Transpose in blocks of `block` images: [N/b, b, H, W, C] -> ... keeps
  each read run C long and each write run b long."""
  n, h, w, c = x.shape
  y = x.reshape(n // block, block, h, w, c).transpose(4, 2, 3, 0, 1)
  return y.reshape(c, h, w, n)


x = jnp.asarray(np.random.default_rng(0).standard_normal((128, 26, 26, 64), np.float32))
for f in (one_step, two_steps, blocked):
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), np.asarray(x).transpose(3, 1, 2, 0))
for rep in range(2):
  print({f.__name__: round(bench(jax.jit(f), x), 2) for f in (one_step, two_steps, blocked)}, flush=True)
dy = jnp.asarray(np.random.default_rng(0).standard_normal((128, 24, 24, 64), np.float32))
print('dy NHWF->HWNF', round(bench(jax.jit(lambda d: d.transpose(1, 2, 0, 3)), dy), 2))
