"""Times EM routing of conv capsule windows, forward + backward, per implementation.

    python -m benchmarks.em_kernels --batch_sizes=16,64 --output=F.jsonl
    python -m benchmarks.em_kernels --tiny --output=F.jsonl
    python -m benchmarks.em_kernels --ptxas=forward,backward --sm=80

One jitted call of ``capsjax.kernels.conv_capsule_routing`` and its
gradient with respect to the poses, activations, transforms and betas, at
the paper EM model's two conv capsule layers (smallNORB: ConvCaps1, a
14 x 14 grid of 32 capsule types routed in 3 x 3 windows at stride 2 to 32
types; ConvCaps2, its 6 x 6 output at stride 1 to 32 types; 4 x 4 poses,
3 iterations) for each ``--impls`` ('xla', 'pallas', and 'native', the
fused CPU kernel, where it is available). The implementations are timed in
turn in
one process; each row, one JSON line appended to ``--output``, holds the
layer, batch, implementation (``impl``) and median ms per call.

``--tiny`` routes a 5 x 5 grid of 2 types to 3 at batch 1, one step,
instead: a check that the command runs on a CPU, where 'pallas' runs in
interpret mode (no timing of it there means anything). ``--ptxas`` times
nothing: it builds the Pallas kernels of ConvCaps1 (64 windows) for a GPU
without one (``benchmarks.kernel_bench``).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernel_bench
from capsjax import kernels
from capsjax.kernels import em_cpu
from capsjax.kernels import pallas_em

# name: (grid side, in types, out types, kernel size, stride)
LAYERS = {'convcaps1': (14, 32, 32, 3, 2), 'convcaps2': (6, 32, 32, 3, 1)}
TINY_LAYERS = {'convcaps1': (5, 2, 3, 3, 2), 'convcaps2': (5, 2, 3, 3, 1)}
KERNELS = {'forward': 'em_conv_windows',
           'backward': 'em_conv_windows_backward'}


def routing_step(impl: str, layer: tuple[int, ...], batch: int):
  """(a call that runs one compiled forward + backward pass and blocks,
  seconds to compile it, windows routed per call)."""
  side, in_types, out_types, kernel_size, stride = layer
  rng = np.random.default_rng(0)
  poses = rng.normal(size=(batch, side, side, in_types, 4, 4))
  acts = rng.uniform(size=(batch, side, side, in_types))
  weights = rng.normal(size=(kernel_size, kernel_size, in_types, out_types,
                             4, 4)) * 0.3
  betas = rng.normal(size=(2, out_types)) * 0.1
  args = tuple(jnp.asarray(x, jnp.float32)
               for x in (poses, acts, weights, betas[0], betas[1]))

  def loss(*x):
    out_poses, out_acts, _ = kernels.conv_capsule_routing(
        *x, stride=stride, implementation=impl)
    return jnp.sum(out_poses) + jnp.sum(out_acts)

  call, compile_s = kernel_bench.compiled_call(
      jax.value_and_grad(loss, argnums=tuple(range(5))), *args)
  out_side = (side - kernel_size) // stride + 1
  return call, compile_s, batch * out_side * out_side


def ptxas_builds(passes: str) -> list[kernel_bench.Build]:
  """ConvCaps1's Pallas kernels, 64 windows of 288 children to 32 parents:
  poses [N, I, 4, 4], activations [N, I], transforms [I, O, 4, 4], betas."""
  def route(*x):
    out = pallas_em.route_windows(*x, 3, interpret=False)
    return sum(jnp.sum(o) for o in out)

  shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in
            [(64, 288, 4, 4), (64, 288), (288, 32, 4, 4), (32,), (32,)]]
  return [({'benchmark': 'em_kernels', 'pass': kernel_pass,
            'layer': 'convcaps1', 'windows': 64},
           route if kernel_pass == 'forward'
           else jax.grad(route, argnums=(0, 1, 2, 3, 4)),
           shapes, KERNELS[kernel_pass])
          for kernel_pass in passes.split(',')]


def default_impls() -> str:
  """'xla' and 'pallas', and 'native' where the fused CPU kernel runs."""
  cpu_kernel = jax.default_backend() == 'cpu' and em_cpu.available()
  return 'xla,pallas' + (',native' if cpu_kernel else '')


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  kernel_bench.add_flags(parser, batch_sizes='16,64', impls=default_impls())
  parser.add_argument('--layers', default='convcaps1,convcaps2')
  args = kernel_bench.parse(parser, argv)
  if args.ptxas:
    kernel_bench.write_ptxas_rows(args, ptxas_builds(args.ptxas))
    return
  shapes = TINY_LAYERS if args.tiny else LAYERS
  for name in args.layers.split(','):
    grid, in_types, out_types, kernel_size, stride = shapes[name]
    for batch in args.batch_sizes:
      steps = {impl: routing_step(impl, shapes[name], batch)
               for impl in args.impls}
      seconds = kernel_bench.median_seconds(
          {impl: call for impl, (call, _, _) in steps.items()}, args)
      for impl, (_, compile_s, windows) in steps.items():
        row = {'benchmark': 'em_kernels', 'layer': name, 'batch_size': batch,
               'impl': impl, 'ms_per_call': 1e3 * seconds[impl],
               'compile_s': compile_s, 'windows': windows, 'grid': grid,
               'in_types': in_types, 'out_types': out_types,
               'kernel_size': kernel_size, 'stride': stride,
               'pass': 'forward+backward', 'steps': args.steps,
               'warmup': args.warmup, 'tiny': args.tiny,
               } | kernel_bench.environment()
        kernel_bench.write_row(args.output, row)
        print(f"{name} batch {batch} {impl}: {row['ms_per_call']:.2f} ms",
              flush=True)


if __name__ == '__main__':
  main(sys.argv[1:])
