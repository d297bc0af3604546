"""Dynamic routing's forward + backward pass: XLA against the Pallas kernels.

  python -m benchmarks.routing_kernels --output=/tmp/routing_kernels.jsonl
  python -m benchmarks.routing_kernels --block_inputs=8,16,32,64
  python -m benchmarks.routing_kernels --batch_sizes=1 --num_in=40 --steps=1

Times ``jax.grad`` of the sum of ``routing.dynamic_routing``'s outputs
(votes [B, I, O, D] and a bias [O, D], as DigitCaps routes them; the paper's
B = 64 and 128, I = 1152, O = 10, D = 16, 3 iterations by default) for each
``impl`` ('xla', 'pallas'), and prints the median milliseconds per call and
the fraction of the memory-bandwidth floor: the votes read once and their
gradient written once, over the device's bandwidth
(``capsjax.flops.DEVICE_PEAKS``, or ``--bandwidth_gbs``; none on a CPU
without the flag). Both passes re-read the votes once per iteration, so
neither can reach that floor; it says how far each is from it. On a CPU the
Pallas kernels run in Pallas' interpreter (a correctness run, not a speed
figure). One JSON line per (impl, block size, batch) goes to ``--output``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib

from capsjax import flops as flops_lib
from capsjax import pallas_routing
from capsjax import routing

IMPLS = ('xla', 'pallas')


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--batch_sizes', default='64,128',
                      help='comma-separated batch sizes B')
  parser.add_argument('--num_in', type=int, default=1152, help='I')
  parser.add_argument('--num_out', type=int, default=10, help='O')
  parser.add_argument('--dim', type=int, default=16, help='D')
  parser.add_argument('--num_iterations', type=int, default=3)
  parser.add_argument('--impls', default=','.join(IMPLS),
                      help=f'comma-separated, of {IMPLS}')
  parser.add_argument('--dtype', default='float32',
                      choices=('float32', 'bfloat16'), help='of the votes')
  parser.add_argument('--steps', type=int, default=20,
                      help='timed calls (the median is reported)')
  parser.add_argument('--warmup', type=int, default=3,
                      help='untimed calls after compilation')
  parser.add_argument('--block_inputs',
                      default=str(pallas_routing.DEFAULT_BLOCK_INPUTS),
                      help="comma-separated input capsules per block of "
                      "impl='pallas' (powers of two): one row each")
  parser.add_argument('--bandwidth_gbs', type=float, default=0.0,
                      help='memory bandwidth in GB/s (0: the datasheet '
                      'value of a known GPU, else no floor)')
  parser.add_argument('--output', default='',
                      help='append one JSON line per row to this path')
  args = parser.parse_args(argv)
  for impl in args.impls.split(','):
    routing.check_dynamic_impl('--impls', impl)
  return args


def median_seconds(call: Callable[[], Any], warmup: int, steps: int
                   ) -> float:
  """Median wall time of ``call()`` (synchronised) over ``steps`` calls,
  as ``benchmarks.harness`` times (not imported: it loads every model)."""
  for _ in range(warmup):
    jax.block_until_ready(call())
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def environment() -> dict[str, Any]:
  return {
      'jax_version': jax.__version__, 'jaxlib_version': jaxlib.__version__,
      'backend': jax.default_backend(),
      'device': jax.devices()[0].device_kind,
      'python': platform.python_version(), 'machine': platform.machine(),
      'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
  }


def bandwidth(flag_gbs: float) -> tuple[float | None, str]:
  """(bytes/s or None, where it comes from)."""
  if flag_gbs:
    return flag_gbs * 1e9, 'flag'
  peak = flops_lib.device_peak(jax.devices()[0].device_kind)
  if peak is None:
    return None, 'none (unknown device; pass --bandwidth_gbs)'
  return peak.bandwidth, 'datasheet (capsjax.flops.DEVICE_PEAKS)'


def forward_backward(impl: str, num_iterations: int, block_inputs: int):
  """jit(d/d votes of sum(outputs)) of dynamic routing with a bias."""
  if impl == 'pallas':
    route = functools.partial(pallas_routing.dynamic_routing,
                              block_inputs=block_inputs)
  else:
    route = functools.partial(routing.dynamic_routing, impl=impl)

  def loss(votes, bias):
    outputs, _ = route(votes, num_iterations, bias=bias)
    return jnp.sum(outputs.astype(jnp.float32))
  return jax.jit(jax.grad(loss))


def time_row(args: argparse.Namespace, impl: str, batch_size: int,
             block_inputs: int | None,
             peak_bandwidth: tuple[float | None, str]) -> dict[str, Any]:
  """One measured row: impl at batch_size (and block_inputs)."""
  shape = (batch_size, args.num_in, args.num_out, args.dim)
  key_votes, key_bias = jax.random.split(jax.random.key(0))
  votes = jax.random.normal(key_votes, shape, jnp.float32).astype(args.dtype)
  bias = 0.1 * jax.random.normal(key_bias, shape[-2:], jnp.float32)
  start = time.perf_counter()
  compiled = forward_backward(impl, args.num_iterations,
                              block_inputs).lower(votes, bias).compile()
  compile_s = time.perf_counter() - start
  seconds = median_seconds(functools.partial(compiled, votes, bias),
                           args.warmup, args.steps)
  compulsory = 2 * votes.size * votes.dtype.itemsize
  rate, source = peak_bandwidth
  return {
      'benchmark': 'routing_kernels', 'impl': impl,
      'batch_size': batch_size, 'votes_shape': list(shape),
      'num_iterations': args.num_iterations, 'dtype': args.dtype,
      'block_inputs': block_inputs,
      'ms_per_call': 1e3 * seconds, 'compile_s': compile_s,
      'compulsory_bytes': compulsory, 'bandwidth': rate,
      'bandwidth_source': source,
      'fraction_of_bandwidth_floor': (None if rate is None
                                      else compulsory / rate / seconds),
      'pallas_interpreted': impl == 'pallas' and jax.default_backend() != 'gpu',
      'steps': args.steps, 'warmup': args.warmup,
  } | environment()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  args = parse_args(argv)
  peak_bandwidth = bandwidth(args.bandwidth_gbs)
  rows = []
  blocks = [int(b) for b in args.block_inputs.split(',')]
  runs = [(impl, block) for impl in args.impls.split(',')
          for block in (blocks if impl == 'pallas' else [None])]
  for batch_size in (int(b) for b in args.batch_sizes.split(',')):
    for impl, block in runs:
      row = time_row(args, impl, batch_size, block, peak_bandwidth)
      fraction = row['fraction_of_bandwidth_floor']
      name = impl if block is None else f'{impl}/{block}'
      print(f"{name:>10} B={batch_size:<4} {row['ms_per_call']:9.3f} ms/call  "
            f"floor fraction "
            f"{'-' if fraction is None else f'{fraction:.3f}'}"
            f"{'  (interpreted)' if row['pallas_interpreted'] else ''}",
            flush=True)
      rows.append(row)
      if args.output:
        with open(args.output, 'a') as f:
          f.write(json.dumps(row) + '\n')
  return rows


if __name__ == '__main__':
  main()
