"""Session 14: the paper CapsNet's DigitCaps (1152 x 8 -> 10 x 16, 3 routing
iterations) train step, gradients of x and W, host memory retained, with
the votes as

  shipped   vector_votes: einsum 'bid,iode->bioe' (XLA: a batched product
            over I, [I, O*D, B], then copies to [B, I, O, D])
  sum8      the Din-term sum of broadcast products, sum_d x[b,i,d] w[i,o,d,e]
            (one loop writing [B, I, O, D]; autodiff's gradients)
  sum8_dot  sum8 forward; custom_vjp whose gradients are einsums
BATCH=128 PYTHONPATH=. python this
"""
import os, sys, time, numpy as np
from capsjax.training import host_memory
print('host memory:', host_memory.retain_freed_memory())
import jax, jax.numpy as jnp
from experiments import launcher  # noqa: F401
from capsjax import routing, votes as votes_lib

B = int(os.environ.get('BATCH', 128))
I, DIN, O, DOUT, ITERS = 1152, 8, 10, 16, 3


def bench(f, *args, n=7):
  jax.block_until_ready(f(*args)); ts = []
  for _ in range(n):
    t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
  return np.median(ts) * 1e3


def sum8_votes(x, w):
  return sum(x[..., d, None, None] * w[:, :, d, :] for d in range(x.shape[-1]))


@jax.custom_vjp
def sum8_dot_votes(x, w):
  return sum8_votes(x, w)
def _fwd(x, w):
  return sum8_votes(x, w), (x, w)
def _bwd(res, g):
  x, w = res
  return (jnp.einsum('bioe,iode->bid', g, w), jnp.einsum('bid,bioe->iode', x, g))
sum8_dot_votes.defvjp(_fwd, _bwd)

VOTES = {'shipped': votes_lib.vector_votes, 'sum8': sum8_votes,
         'sum8_dot': sum8_dot_votes}


def model(name):
  def f(x, w, bias):
    v, _ = routing.dynamic_routing(VOTES[name](x, w), ITERS, bias=bias)
    return v
  return f


r = np.random.default_rng(0)
x = jnp.asarray(r.standard_normal((B, I, DIN), np.float32) * 0.3)
w = jnp.asarray(r.standard_normal((I, O, DIN, DOUT), np.float32) * 0.1)
bias = jnp.full((O, DOUT), 0.1, jnp.float32)
target = jnp.asarray(r.standard_normal((B, O, DOUT), np.float32))


def step(f):
  return jax.jit(jax.grad(lambda x, w: jnp.vdot(f(x, w, bias), target), argnums=(0, 1)))


names = sys.argv[1:] or list(VOTES)
ref = step(model('shipped'))(x, w)
for rnd in range(2):
  for name in names:
    f = model(name)
    got = step(f)(x, w)
    err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, ref))
    fwd = bench(jax.jit(lambda x, w: f(x, w, bias)), x, w)
    print(f'{name:10s} B={B}: train (grads of x, W) {bench(step(f), x, w):7.1f} ms, '
          f'forward {fwd:6.1f} ms, max rel err vs shipped {err:.1e}', flush=True)
