"""Session 11: Su's capsule model with its stride-1 direct convolutions
differentiated by a custom VJP whose kernel gradient transposes x and dy
after an optimisation barrier (so XLA transposes the stored activations
instead of recomputing them in a transposing loop fusion), alternated in
one process with the shipped conv2d. argv: BATCH."""
import sys, time, functools
import numpy as np, jax, jax.numpy as jnp
import capsjax
from capsjax import layers
from experiments import benchmark
from capsjax.training import state as state_lib


@jax.custom_vjp
def conv_vjp(x, kernel):
  return layers._lax_conv(x, kernel)


def _fwd(x, kernel):
  return layers._lax_conv(x, kernel), (x, kernel)


def _bwd(res, dy):
  x, kernel = res
  kh, kw = kernel.shape[:2]
  flipped = jnp.flip(kernel, (0, 1)).swapaxes(2, 3)
  dx = layers._lax_conv(jnp.pad(dy, ((0, 0), (kh - 1, kh - 1), (kw - 1, kw - 1), (0, 0))), flipped)
  xt, dyt = jax.lax.optimization_barrier((x, dy))
  lhs = xt.transpose(3, 1, 2, 0)
  rhs = dyt.transpose(1, 2, 0, 3)
  dk = layers._lax_conv(lhs, rhs).transpose(1, 2, 0, 3)
  return dx, dk


conv_vjp.defvjp(_fwd, _bwd)
_conv2d = layers.conv2d


def patched(x, kernel, stride=1, padding='VALID', impl=None):
  if stride == 1 and padding == 'VALID' and x.shape[-1] >= 16:
    return conv_vjp(x, kernel)
  return _conv2d(x, kernel, stride, padding, impl)


B = int(sys.argv[1])
steps = {}
for name in ('shipped', 'barrier_vjp'):
  layers.conv2d = _conv2d if name == 'shipped' else patched
  config = benchmark.configure('two_digit_capsnet', batch_size=B)
  model = state_lib.create_model(config, seed=0)
  opt = state_lib.make_optimizer(config)
  graphdef, state = state_lib.init_train_state(model, opt)
  s = benchmark.make_steps(config, opt, 'float32')
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.integers(0, 256, (B,) + benchmark.image_shape(config), np.uint8))
  labels = jnp.asarray(rng.integers(0, 10, B, np.int32))
  train = jax.jit(functools.partial(s.train_step, graphdef))
  key = jax.random.PRNGKey(0)
  jax.block_until_ready(train(state, images, labels, key))
  steps[name] = (train, state, images, labels, key)
times = {n: [] for n in steps}
for _ in range(5):
  for n, (train, state, images, labels, key) in steps.items():
    t = time.perf_counter()
    for _ in range(3):
      out = train(state, images, labels, key)
    jax.block_until_ready(out); times[n].append((time.perf_counter() - t) / 3)
print({n: round(B / np.median(v), 1) for n, v in times.items()}, 'img/s')
