"""Session 14: the kernel gradient's input transpose of Su's second layer,
[128, 26, 26, 64] -> [64, 26, 26, 128], alone (host memory retained):
XLA's one transpose against two- and three-pass versions (each pass behind
layers._unfused so XLA does not merge them). PYTHONPATH=. python this"""
import time
import numpy as np
from capsjax.training import host_memory
print('host memory:', host_memory.retain_freed_memory())
import jax, jax.numpy as jnp
from capsjax import layers

x = jnp.asarray(np.random.default_rng(0).random((128, 26, 26, 64), np.float32))
key = jnp.ones((1,))


def one_pass(x):
  return jnp.transpose(x, (3, 1, 2, 0))


def two_pass(x):  # a 2-D transpose [B, P*C] -> [P*C, B], then [P, C, B] -> [C, P, B]
  t = layers._unfused(x.reshape(128, 676 * 64).T, key)
  return t.reshape(676, 64, 128).transpose(1, 0, 2).reshape(64, 26, 26, 128)


def three_pass(x):  # [B, P, C] -> [P, B, C] -> [P, C, B] -> [C, P, B]
  t = layers._unfused(x.reshape(128, 676, 64).transpose(1, 0, 2), key)
  t = layers._unfused(t.transpose(0, 2, 1), key)
  return t.transpose(1, 0, 2).reshape(64, 26, 26, 128)


variants = {f.__name__: jax.jit(f) for f in (one_pass, two_pass, three_pass)}
reference = variants['one_pass'](x)
for f in variants.values():
  np.testing.assert_array_equal(f(x), reference)
for r in range(3):
  for name, f in variants.items():
    jax.block_until_ready(f(x)); t = time.perf_counter()
    for _ in range(20): y = f(x)
    jax.block_until_ready(y)
    print(f'round {r} {name}: {(time.perf_counter() - t) / 20 * 1e3:.2f} ms')
