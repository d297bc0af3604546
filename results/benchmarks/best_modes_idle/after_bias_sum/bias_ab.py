"""One train step compiled twice, alternating: the bias gradients summed by
autodiff in the compute dtype against capsjax.layers.add_bias's float32 sum.

    python bias_ab.py MODEL BATCH DTYPE ROUNDS STEPS
    (from a capsjax checkout: python .../bias_ab.py two_digit_capsnet 128 bfloat16 5 3)
"""

import sys
import time

import jax
import numpy as np

from capsjax import layers
from experiments import benchmark


def compiled(config, dtype, add_bias):
  """(the train step traced with ``add_bias`` in the layers, its args)."""
  float32_sum = layers.add_bias
  layers.add_bias = add_bias
  try:
    step, args = benchmark.train_step_and_inputs(config, dtype=dtype)
    fn = jax.jit(step, donate_argnums=0).lower(*args).compile()
  finally:
    layers.add_bias = float32_sum
  return fn, list(args)


def main(argv):
  spec, batch, dtype = argv[1], int(argv[2]), argv[3]
  rounds, steps = int(argv[4]), int(argv[5])
  config = benchmark.configure(spec, batch_size=batch)

  def autodiff_sum(y, b):
    return y + b.astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))

  calls = {'autodiff bias sum': compiled(config, dtype, autodiff_sum),
           'float32 bias sum': compiled(config, dtype, layers.add_bias)}

  def run(name):
    fn, args = calls[name]
    args[0], metrics = fn(*args)
    jax.block_until_ready(metrics)

  for name in calls:
    run(name)
    run(name)
  times = {name: [] for name in calls}
  for _ in range(rounds):
    for name in calls:
      start = time.perf_counter()
      for _ in range(steps):
        run(name)
      times[name].append((time.perf_counter() - start) / steps)
  for name, ts in times.items():
    median = np.median(ts)
    print(f'{spec} b{batch} {dtype} {name}: median {median * 1000:.1f} ms/step '
          f'({batch / median:.1f} img/s), rounds',
          [round(t * 1000, 1) for t in ts])
  print('ratio old/new', np.median(times['autodiff bias sum'])
        / np.median(times['float32 bias sum']))


if __name__ == '__main__':
  main(sys.argv)
