"""Dynamic routing's forward + backward pass: XLA against the Pallas kernels.

  python -m benchmarks.routing_kernels --batch_sizes=64,128 --output=F.jsonl
  python -m benchmarks.routing_kernels --block_inputs=8,16,32,64
  python -m benchmarks.routing_kernels --tiny --output=F.jsonl
  python -m benchmarks.routing_kernels --ptxas=forward,backward --sm=80

Times ``jax.grad`` of the sum of ``capsjax.kernels.dynamic_routing``'s outputs
(votes [B, I, O, D] and a bias [O, D], as DigitCaps routes them; the paper's
B = 64 and 128, I = 1152, O = 10, D = 16, 3 iterations by default) for each
implementation (``--impls``: 'xla', 'pallas'), timed in turn in one process, and
prints the median milliseconds per call and the fraction of the
memory-bandwidth floor: the votes read once and their gradient written
once, over the device's bandwidth (``capsjax.flops.DEVICE_PEAKS``, or
``--bandwidth_gbs``; none on a CPU without the flag). Both passes re-read
the votes once per iteration, so neither can reach that floor; it says how
far each is from it. On a CPU the Pallas kernels run in Pallas' interpreter
(a correctness run, not a speed figure). One JSON line per (impl, block
size, batch) goes to ``--output``. ``--tiny``: B = 1, I = 20, blocks of 8,
one step. ``--ptxas`` builds the forward or backward kernel at these shapes
(B = 64) for a GPU without one (``benchmarks.kernel_bench``).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import kernel_bench
from capsjax import flops as flops_lib
from capsjax import kernels
from capsjax.kernels import implementations
from capsjax.kernels import pallas_dynamic

IMPLS = ('xla', 'pallas')
KERNELS = {'forward': '_forward_kernel', 'backward': '_backward_kernel'}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  kernel_bench.add_flags(parser, batch_sizes='64,128', impls=','.join(IMPLS))
  parser.add_argument('--num_in', type=int, default=1152, help='I')
  parser.add_argument('--num_out', type=int, default=10, help='O')
  parser.add_argument('--dim', type=int, default=16, help='D')
  parser.add_argument('--num_iterations', type=int, default=3)
  parser.add_argument('--dtype', default='float32',
                      choices=('float32', 'bfloat16'), help='of the votes')
  parser.add_argument('--block_inputs',
                      default=str(pallas_dynamic.DEFAULT_BLOCK_INPUTS),
                      help="comma-separated input capsules per block of "
                      "implementation='pallas' (powers of two): one row each")
  parser.add_argument('--bandwidth_gbs', type=float, default=0.0,
                      help='memory bandwidth in GB/s (0: the datasheet '
                      'value of a known GPU, else no floor)')
  args = kernel_bench.parse(parser, argv)
  if args.tiny:
    args.num_in, args.block_inputs = 20, '8'
  args.block_inputs = [int(b) for b in args.block_inputs.split(',')]
  for impl in args.impls:
    implementations.check(impl, 'dynamic_routing', '--impls')
  return args


def bandwidth(flag_gbs: float) -> tuple[float | None, str]:
  """(bytes/s or None, where it comes from)."""
  if flag_gbs:
    return flag_gbs * 1e9, 'flag'
  peak = flops_lib.device_peak(jax.devices()[0].device_kind)
  if peak is None:
    return None, 'none (unknown device; pass --bandwidth_gbs)'
  return peak.bandwidth, 'datasheet (capsjax.flops.DEVICE_PEAKS)'


def loss_fn(impl: str, num_iterations: int, block_inputs: int | None,
            interpret: bool | None = None):
  """(votes [B, I, O, D], bias [O, D]) -> sum of dynamic routing's outputs
  (``interpret``: the Pallas kernels', None: off a GPU)."""
  if impl == 'pallas':
    route = functools.partial(pallas_dynamic.dynamic_routing,
                              block_inputs=block_inputs, interpret=interpret)
  else:
    route = functools.partial(kernels.dynamic_routing, implementation=impl)

  def loss(votes, bias):
    outputs, _ = route(votes, num_iterations, bias=bias)
    return jnp.sum(outputs.astype(jnp.float32))
  return loss


def ptxas_builds(args: argparse.Namespace) -> list[kernel_bench.Build]:
  """The Pallas kernels at the flags' shapes (B = 64), one per pass and
  block size."""
  shapes = [jax.ShapeDtypeStruct((64, args.num_in, args.num_out, args.dim),
                                 args.dtype),
            jax.ShapeDtypeStruct((args.num_out, args.dim), jnp.float32)]
  builds = []
  for kernel_pass in args.ptxas.split(','):
    for block in args.block_inputs:
      loss = loss_fn('pallas', args.num_iterations, block, interpret=False)
      fn = loss if kernel_pass == 'forward' else jax.grad(loss)
      fields = {'benchmark': 'routing_kernels', 'pass': kernel_pass,
                'votes_shape': list(shapes[0].shape), 'dtype': args.dtype,
                'num_iterations': args.num_iterations, 'block_inputs': block}
      builds.append((fields, fn, shapes, KERNELS[kernel_pass]))
  return builds


def time_rows(args: argparse.Namespace, batch_size: int,
              peak_bandwidth: tuple[float | None, str]
              ) -> list[dict[str, Any]]:
  """One measured row per impl (and block size) at batch_size, timed in
  turn."""
  shape = (batch_size, args.num_in, args.num_out, args.dim)
  key_votes, key_bias = jax.random.split(jax.random.key(0))
  votes = jax.random.normal(key_votes, shape, jnp.float32).astype(args.dtype)
  bias = 0.1 * jax.random.normal(key_bias, shape[-2:], jnp.float32)
  runs = {(impl if block is None else f'{impl}/{block}'): (impl, block)
          for impl in args.impls
          for block in (args.block_inputs if impl == 'pallas' else [None])}
  calls, compile_s = {}, {}
  for name, (impl, block) in runs.items():
    calls[name], compile_s[name] = kernel_bench.compiled_call(
        jax.grad(loss_fn(impl, args.num_iterations, block)), votes, bias)
  seconds = kernel_bench.median_seconds(calls, args)
  compulsory = 2 * votes.size * votes.dtype.itemsize
  rate, source = peak_bandwidth
  return [{
      'benchmark': 'routing_kernels', 'impl': impl,
      'batch_size': batch_size, 'votes_shape': list(shape),
      'num_iterations': args.num_iterations, 'dtype': args.dtype,
      'block_inputs': block,
      'ms_per_call': 1e3 * seconds[name], 'compile_s': compile_s[name],
      'compulsory_bytes': compulsory, 'bandwidth': rate,
      'bandwidth_source': source,
      'fraction_of_bandwidth_floor': (None if rate is None else
                                      compulsory / rate / seconds[name]),
      'pallas_interpreted': impl == 'pallas' and jax.default_backend() != 'gpu',
      'steps': args.steps, 'warmup': args.warmup, 'tiny': args.tiny,
  } | kernel_bench.environment() for name, (impl, block) in runs.items()]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  args = parse_args(argv)
  if args.ptxas:
    return kernel_bench.write_ptxas_rows(args, ptxas_builds(args))
  peak_bandwidth = bandwidth(args.bandwidth_gbs)
  rows = []
  for batch_size in args.batch_sizes:
    for row in time_rows(args, batch_size, peak_bandwidth):
      fraction = row['fraction_of_bandwidth_floor']
      block = row['block_inputs']
      name = row['impl'] if block is None else f"{row['impl']}/{block}"
      print(f"{name:>10} B={batch_size:<4} {row['ms_per_call']:9.3f} ms/call  "
            f"floor fraction "
            f"{'-' if fraction is None else f'{fraction:.3f}'}"
            f"{'  (interpreted)' if row['pallas_interpreted'] else ''}",
            flush=True)
      kernel_bench.write_row(args.output, row)
      rows.append(row)
  return rows


if __name__ == '__main__':
  main()
