"""Time one ConvCaps1 layer of the EM smoke model, forward and gradient.

Used to compare routing.py's weighted sums written as einsum (up to cb27ef8)
with multiply-and-reduce (after it): run it with PYTHONPATH pointing at each
checkout in turn (see em_sums_einsum_vs_multiply_reduce.md). The layer: a
12x12 grid of 8 child types, K=3, stride 2, 8 parent types, 2 iterations,
batch 8 (one of the CI test's 4 devices).
"""

import time

import jax
import jax.numpy as jnp

from capsjax import layers


def median_ms(fn, *args, repeats=7, calls=10):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls * 1e3)
  return sorted(times)[len(times) // 2]


def main():
  key_p, key_a, key_w = jax.random.split(jax.random.PRNGKey(0), 3)
  poses = jax.random.normal(key_p, (8, 12, 12, 8, 4, 4))
  acts = jax.nn.sigmoid(jax.random.normal(key_a, (8, 12, 12, 8)))
  weights = jax.random.normal(key_w, (3, 3, 8, 8, 4, 4))
  zeros = jnp.zeros(8)

  def loss(p, a, w):
    out, out_a, _ = layers.conv_capsule_routing(
        p, a, w, zeros, zeros, stride=2, num_iterations=2,
        inverse_temperature=1.0, normalize_cost=True)
    return jnp.sum(out**2) + jnp.sum(out_a)

  forward = jax.jit(loss)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  args = (poses, acts, weights)
  print(f'{layers.__file__}: forward {median_ms(forward, *args):.2f} ms, '
        f'forward+backward {median_ms(grad, *args):.2f} ms, '
        f'loss {float(forward(*args)):.6f}')


if __name__ == '__main__':
  main()
