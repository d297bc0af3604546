"""A/B of the two bfloat16 changes of 6a37f63, in one process, alternating:
'before' (the shared votes as XLA's einsum, the bias gradients as XLA's
float32 sum), 'votes' (only the votes by oneDNN's matmul) and 'both' (the
commit). Usage: python ab.py MODEL BATCH ROUNDS STEPS (bfloat16 train step,
median ms per step over the rounds)."""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from capsjax import layers
from capsjax import votes as votes_lib
from experiments import benchmark

print(timing.retain_host_memory())
spec, batch, rounds, steps = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                              int(sys.argv[4]))
config = benchmark.configure(spec, batch_size=batch)
new_votes, new_bwd = votes_lib.shared_vector_votes, layers._add_bias_bwd


def einsum_votes(inputs, weights, dot_general=None):
  return jnp.einsum('...id,ode->...ioe', inputs, weights)


def xla_sum_bwd(bias, dy):
  dbias = jnp.sum(dy.astype(jnp.float32), axis=tuple(range(dy.ndim - 1)))
  return dy, dbias.astype(bias.dtype)


def compiled(votes, bwd):
  votes_lib.shared_vector_votes = votes
  layers._add_bias_f32_sum.defvjp(layers._add_bias_fwd, bwd)
  step, args = benchmark.train_step_and_inputs(config, dtype='bfloat16')
  f = jax.jit(step, donate_argnums=0).lower(*args).compile()
  votes_lib.shared_vector_votes = new_votes
  layers._add_bias_f32_sum.defvjp(layers._add_bias_fwd, new_bwd)
  return f, list(args)


calls = {'before': compiled(einsum_votes, xla_sum_bwd),
         'votes': compiled(new_votes, xla_sum_bwd),
         'both': compiled(new_votes, new_bwd)}


def run(name):
  f, a = calls[name]
  a[0], m = f(*a)
  jax.block_until_ready(m)
  return m


for n in calls:
  print(n, 'first step', {k: float(v) for k, v in run(n).items()})
  run(n)
t = {n: [] for n in calls}
for _ in range(rounds):
  for n in calls:
    s = time.perf_counter()
    for _ in range(steps):
      run(n)
    t[n].append((time.perf_counter() - s) / steps)
for n in calls:
  med = np.median(t[n])
  print(f'{spec} b{batch} bfloat16 {n}: median {med * 1e3:.1f} ms/step '
        f'({batch / med:.1f} img/s), rounds',
        [round(x * 1e3, 1) for x in t[n]])
for n in ('votes', 'both'):
  print(f'speed-up {n} / before: {np.median(t["before"]) / np.median(t[n]):.3f}')
