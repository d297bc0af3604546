"""Session 16: the fixed cost of capsjax.onednn's FFI calls: a tiny
convolution (1x4x4x16, 3x3x16x16), forward and both gradients, 2000 times,
against XLA's direct convolution. Run in a checkout of 90cdcfc (primitive
descriptors built on every call) and of this commit (built once per shape).
PYTHONPATH=. python this"""
import time, jax, jax.numpy as jnp, numpy as np
from capsjax import onednn, layers
x = jnp.ones((1, 4, 4, 16)); k = jnp.ones((3, 3, 16, 16)) * 0.1
f = jax.jit(lambda x, k: jax.grad(lambda x, k: jnp.sum(onednn.conv(x, k)), argnums=(0, 1))(x, k))
g = jax.jit(lambda x, k: jax.grad(lambda x, k: jnp.sum(layers.conv2d(x, k, impl='direct')), argnums=(0, 1))(x, k))
for fn in (f, g):
  jax.block_until_ready(fn(x, k))
for r in range(3):
  for name, fn in (('onednn', f), ('xla', g)):
    t = time.perf_counter()
    for _ in range(2000):
      out = fn(x, k)
    jax.block_until_ready(out)
    print(name, f'{(time.perf_counter() - t) / 2000 * 1e6:.1f} us per fwd+2 grads')
