"""Session 12: the paper CapsNet's DigitCaps (1152 x 8 -> 10 x 16, 3 routing
iterations) train step, gradients of x and W, in three layouts:

  shipped       vector_votes ('bid,iode->bioe') + routing.dynamic_routing
                (its sums are einsums: XLA dots over [B, O, D, I] copies)
  sums          the same votes, the routing's two sums as multiply + sum
                (PyTorch's form)
  batch_minor   votes as XLA's batched product leaves them, [I, O, D, B],
                and the routing written over that layout with multiply +
                sum (no transposes)
BATCH=128 PYTHONPATH=. python this
"""
import os, time, numpy as np, jax, jax.numpy as jnp
from experiments import launcher  # noqa: F401
from capsjax import routing, votes as votes_lib

B = int(os.environ.get('BATCH', 128))
I, DIN, O, DOUT, ITERS = 1152, 8, 10, 16, 3


def bench(f, *args, n=7):
  jax.block_until_ready(f(*args)); ts = []
  for _ in range(n):
    t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
  return np.median(ts) * 1e3


def squash(s, axis):
  n2 = jnp.sum(s * s, axis=axis, keepdims=True)
  return s * (n2 / (1 + n2)) / jnp.sqrt(n2 + 1e-7)


def shipped(x, w, bias):
  v, _ = routing.dynamic_routing(votes_lib.vector_votes(x, w), ITERS, bias=bias)
  return v


def sums(x, w, bias):
  u = votes_lib.vector_votes(x, w)                       # [B, I, O, D]
  b = jnp.zeros(u.shape[:3])
  for it in range(ITERS):
    c = jax.nn.softmax(b, axis=-1)
    s = jnp.sum(c[..., None] * u, axis=1) + bias         # [B, O, D]
    v = squash(s, -1)
    if it < ITERS - 1:
      b = b + jnp.sum(u * v[:, None], axis=-1)
  return v


def batch_minor(x, w, bias):
  u = jnp.einsum('bid,iode->ioeb', x, w)                 # [I, O, D, B]
  b = jnp.zeros((I, O, x.shape[0]))
  for it in range(ITERS):
    c = jax.nn.softmax(b, axis=1)                        # over O
    s = jnp.sum(c[:, :, None] * u, axis=0) + bias[..., None]  # [O, D, B]
    v = squash(s, 1)
    if it < ITERS - 1:
      b = b + jnp.sum(u * v[None], axis=2)               # [I, O, B]
  return v.transpose(2, 0, 1)


r = np.random.default_rng(0)
x = jnp.asarray(r.standard_normal((B, I, DIN), np.float32) * 0.3)
w = jnp.asarray(r.standard_normal((I, O, DIN, DOUT), np.float32) * 0.1)
bias = jnp.full((O, DOUT), 0.1, jnp.float32)
target = jnp.asarray(r.standard_normal((B, O, DOUT), np.float32))


def step(f):
  return jax.jit(jax.grad(lambda x, w: jnp.vdot(f(x, w, bias), target), argnums=(0, 1)))


ref = step(shipped)(x, w)
for f in (shipped, sums, batch_minor):
  got = step(f)(x, w)
  err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, ref))
  fwd = bench(jax.jit(lambda x, w: f(x, w, bias)), x, w)
  print(f'{f.__name__:12s} B={B}: train (grads of x, W) {bench(step(f), x, w):7.1f} ms, '
        f'forward {fwd:6.1f} ms, max rel err vs shipped {err:.1e}', flush=True)
