"""The EM models' train step with the votes as one dot batched over the
children (capsjax.votes.matrix_votes) against the einsum it replaced (and,
with --variants, that dot in the compute dtype instead of float32), all
compiled in one process and timed in alternating rounds (wall and CPU time
per step), after checking that they compute the same loss.

  python results/em_votes_product/ab_votes_product.py \\
      matrix_capsnet_mnist:8,16,64 matrix_capsnet_mnist:smoke:32 \\
      matrix_capsnet_smallnorb:16 --rounds=5
  python results/em_votes_product/ab_votes_product.py \\
      matrix_capsnet_mnist:8,16 --dtype=bfloat16 \\
      --variants=einsum,dot,dot_in_dtype --rounds=5
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from capsjax import votes as votes_lib
from experiments import benchmark

dot_votes = votes_lib.matrix_votes


def einsum_votes(poses, weights):
  """The replaced formulation: [..., I, P, Q] x [I, O, Q, R] -> [..., I, O, P*R]."""
  votes = jnp.einsum('...ipq,ioqr->...iopr', poses, weights)
  return votes.reshape(votes.shape[:-2] + (-1,))


def dot_in_dtype_votes(poses, weights):
  """matrix_votes's batched dot in the inputs' dtype (bfloat16 stays
  bfloat16), not float32."""
  *lead, num_in, p, q = poses.shape
  num_out, r = weights.shape[1], weights.shape[3]
  x = jnp.moveaxis(poses.reshape((-1, num_in, p, q)), 1, 0)
  votes = jax.lax.dot_general(
      x.reshape(num_in, -1, q),
      jnp.swapaxes(weights, 1, 2).reshape(num_in, q, num_out * r),
      (((2,), (1,)), ((0,), (0,))))
  votes = jnp.transpose(votes.reshape(num_in, -1, p, num_out, r),
                        (1, 0, 3, 2, 4))
  return votes.reshape(tuple(lead) + (num_in, num_out, p * r))


VARIANTS = {'einsum': einsum_votes, 'dot': dot_votes,
            'dot_in_dtype': dot_in_dtype_votes}


def compiled_step(spec, batch, dtype, votes_fn):
  votes_lib.matrix_votes = votes_fn  # the layers look it up at trace time
  try:
    config = benchmark.configure(spec, batch_size=batch)
    step, args = benchmark.train_step_and_inputs(config, dtype=dtype)
    return jax.jit(step).lower(*args).compile(), args
  finally:
    votes_lib.matrix_votes = dot_votes


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('models', nargs='+', help='config:batch[,batch...]')
  parser.add_argument('--dtype', default='float32')
  parser.add_argument('--variants', default='einsum,dot')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--steps', type=int, default=2)
  args = parser.parse_args()
  names = args.variants.split(',')
  print(f'jax {jax.__version__}, {jax.devices()[0].device_kind}, '
        f'{jax.device_count()} device(s), compute dtype {args.dtype}')
  for item in args.models:
    spec, batches = item.rsplit(':', 1)
    for batch in map(int, batches.split(',')):
      steps = {name: compiled_step(spec, batch, args.dtype, VARIANTS[name])
               for name in names}
      metrics = {name: step(*inputs)[1]
                 for name, (step, inputs) in steps.items()}
      base = metrics[names[0]]
      wall = {name: [] for name in steps}
      cpu = {name: [] for name in steps}
      for _ in range(args.rounds):
        for name, (step, inputs) in steps.items():
          t, u = time.perf_counter(), time.process_time()
          for _ in range(args.steps):
            jax.block_until_ready(step(*inputs))
          wall[name].append((time.perf_counter() - t) / args.steps)
          cpu[name].append((time.process_time() - u) / args.steps)
      wall_s = {k: statistics.median(v) for k, v in wall.items()}
      cpu_s = {k: statistics.median(v) for k, v in cpu.items()}
      parts = []
      for name in names:
        m = metrics[name]
        parts.append(
            f'{name} {wall_s[name]:.4f} s/step (cpu {cpu_s[name]:.4f}; '
            f'{wall_s[names[0]] / wall_s[name]:.2f}x wall, '
            f'{cpu_s[names[0]] / cpu_s[name]:.2f}x cpu of {names[0]}; loss '
            f'{float(m["loss"]):.6f}, gradient norm '
            f'{float(m["grad_norm"]):.6f}, relative to {names[0]}: '
            f'{abs(float(m["loss"]) / float(base["loss"]) - 1):.1e} / '
            f'{abs(float(m["grad_norm"]) / float(base["grad_norm"]) - 1):.1e})')
      print(f'{spec} batch {batch} {args.dtype}: ' + '; '.join(parts),
            flush=True)


if __name__ == '__main__':
  main()
