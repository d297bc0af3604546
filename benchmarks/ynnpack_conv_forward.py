"""One 3x3 convolution's forward pass as XLA:CPU compiles it, in a few contexts.

    python -m benchmarks.ynnpack_conv_forward                # Eigen's (default)
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=individual_convolution \\
        python -m benchmarks.ynnpack_conv_forward           # YNNPACK's

Su's second layer, [128, 26, 26, 64] x [3, 3, 64, 64]: alone, with its
input padded inside the jit, with a flipped kernel, followed by a sine or a
sum, and the input gradient's padded convolution over a [128, 24, 24, 64]
cotangent; median ms of 9 calls, printed twice.
``capsjax.prefer_eigen_convolutions()``, which ``import benchmarks`` calls,
turns XLA:CPU's YNNPACK convolution fusion off
(``--xla_cpu_experimental_ynn_fusion_type=-individual_convolution``);
naming the fusion types in XLA_FLAGS yourself (the second command) keeps it,
as jaxlib 0.10 has it by default.
Record: results/benchmarks/ynnpack_convolutions/.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from capsjax.kernels.conv import lowerings


def median_ms(f, *args, n: int = 9) -> float:
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(n):
    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - start)
  return round(float(np.median(times)) * 1e3, 1)


def main() -> None:
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((128, 26, 26, 64), np.float32))
  k = jnp.asarray(rng.standard_normal((3, 3, 64, 64), np.float32) * .1)
  dy = jnp.asarray(rng.standard_normal((128, 24, 24, 64), np.float32))
  pad1 = ((0, 0), (1, 1), (1, 1), (0, 0))
  pad2 = ((0, 0), (2, 2), (2, 2), (0, 0))

  def flipped(k):
    return jnp.flip(k, (0, 1)).swapaxes(2, 3)

  def conv(x, k):  # XLA's own convolution, lax.conv_general_dilated
    return lowerings.conv2d(x, k, lowering='direct')

  forwards = {
      'fwd': jax.jit(conv),
      'fwd_padded_in_jit': jax.jit(
          lambda x, k: conv(jnp.pad(x, pad1), k)),
      'fwd_flipk': jax.jit(lambda x, k: conv(x, flipped(k))),
      'fwd_sin': jax.jit(lambda x, k: jnp.sin(conv(x, k))),
      'fwd_sum': jax.jit(lambda x, k: jnp.sum(conv(x, k))),
  }
  input_grad = jax.jit(
      lambda d, k: conv(jnp.pad(d, pad2), flipped(k)))
  for rep in range(2):
    for name, f in forwards.items():
      print(rep, name, median_ms(f, x, k), flush=True)
    print(rep, 'dx_conv', median_ms(input_grad, dy, k), flush=True)


if __name__ == '__main__':
  main()
