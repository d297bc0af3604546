"""Times EM routing of conv capsule windows, forward + backward, per impl.

    python -m benchmarks.em_kernels --out=/tmp/em_kernels.jsonl
    python -m benchmarks.em_kernels --out=/tmp/em_kernels.jsonl --tiny

One jitted call of ``capsule_routing.conv_capsule_routing`` and its
gradient with respect to the poses, activations, transforms and betas, at
the paper EM model's two conv capsule layers (smallNORB: ConvCaps1, a
14 x 14 grid of 32 capsule types routed in 3 x 3 windows at stride 2 to 32
types; ConvCaps2, its 6 x 6 output at stride 1 to 32 types; 4 x 4 poses,
3 iterations) for each ``--impls`` ('xla', 'pallas', and 'kernel', the
fused CPU kernel, where it is available). The impls are timed in turn in
one process (``benchmarks.timing``); each row, one JSON line appended to
``--out``, holds the layer, batch, impl and median ms per call.

``--tiny`` routes a 5 x 5 grid of 2 types to 3 at batch 1 instead: a check
that the command runs on a CPU, where 'pallas' runs in interpret mode (no
timing of it there means anything).

    python -m benchmarks.em_kernels --out=/tmp/ptxas.jsonl --ptxas=forward,backward

``--ptxas`` times nothing: it builds the Pallas kernels of ConvCaps1 (64
windows) with the Triton compiler (installed with PyTorch) for
``--sm`` (80: an A100) without a GPU, and writes ptxas' registers a thread
and spilled bytes, one row per kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from capsjax import capsule_routing
from capsjax import em_kernel
from capsjax import pallas_em

# name: (grid side, in types, out types, kernel size, stride)
LAYERS = {'convcaps1': (14, 32, 32, 3, 2), 'convcaps2': (6, 32, 32, 3, 1)}
TINY_LAYERS = {'convcaps1': (5, 2, 3, 3, 2), 'convcaps2': (5, 2, 3, 3, 1)}


def routing_step(impl: str, layer: tuple[int, ...], batch: int):
  """(a call that runs one jitted forward + backward pass and blocks,
  windows routed per call)."""
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
    out_poses, out_acts, _ = capsule_routing.conv_capsule_routing(
        *x, stride=stride, impl=impl)
    return jnp.sum(out_poses) + jnp.sum(out_acts)

  step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5))))
  out_side = (side - kernel_size) // stride + 1
  return (lambda: jax.block_until_ready(step(*args))), (
      batch * out_side * out_side)


def _triton_ir_text(exported) -> str:
  """The Triton IR of the exported module's one Triton call, as text (the
  call holds it as bytecode of JAX's Triton dialect)."""
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib import triton as jax_triton
  from jaxlib.mlir import ir
  with jax_mlir.make_ir_context() as context:
    configs = []

    def visit(op):
      if (op.name == 'stablehlo.custom_call' and 'xla.gpu.triton'
          in str(op.attributes['call_target_name'])):
        configs.append(ir.DictAttr(op.attributes['mhlo.backend_config']))
      return ir.WalkResult.ADVANCE

    ir.Module.parse(exported.mlir_module()).operation.walk(visit)
    bytecode = ir.StringAttr(configs[0]['ir']).value_bytes
    jax_triton.dialect.register_dialect(context)
    context.load_all_available_dialects()
    return ir.Module.parse(bytecode).operation.get_asm()


def ptxas_report(kernel_pass: str, sm: int, workdir: str) -> dict:
  """Builds ConvCaps1's forward or backward Pallas kernel for sm_``sm``
  with the Triton compiler (no GPU needed) and reads ptxas' report."""
  import triton
  from triton.backends.compiler import GPUTarget

  def route(*x):
    out = pallas_em.route_windows(*x, 3, interpret=False)
    return sum(jnp.sum(o) for o in out)

  shapes = [(64, 288, 4, 4), (64, 288), (288, 32, 4, 4), (32,), (32,)]
  exported = jax.export.export(
      jax.jit(route if kernel_pass == 'forward'
              else jax.grad(route, argnums=(0, 1, 2, 3, 4))),
      platforms=['cuda'],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
          '__gpu$xla.gpu.triton')])(
              *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))
  source = os.path.join(workdir, f'{kernel_pass}.ttir')
  with open(source, 'w') as f:
    f.write(_triton_ir_text(exported))
  os.environ.setdefault('TRITON_CACHE_DIR', os.path.join(workdir, 'cache'))
  kernel = triton.compile(source, target=GPUTarget('cuda', sm, 32),
                          options=dict(num_warps=pallas_em.NUM_WARPS))
  ptx = os.path.join(workdir, f'{kernel_pass}.ptx')
  with open(ptx, 'w') as f:
    f.write(kernel.asm['ptx'])
  ptxas = os.path.join(os.path.dirname(triton.backends.nvidia.__file__),
                       'bin', 'ptxas')
  # The PTX names its target: sm_90a, not sm_90, for a Hopper build.
  target = re.search(r'^\.target (\w+)', kernel.asm['ptx'], re.M)[1]
  report = subprocess.run(
      [ptxas, '-v', '--gpu-name', target, ptx, '-o', ptx + '.cubin'],
      capture_output=True, text=True, check=True).stderr
  return {'kernel': re.search(r"entry function '(\w+)'", report)[1],
          'target': target, 'registers': int(re.search(r'Used (\d+) registers',
                                               report)[1]),
          'spill_store_bytes': int(re.search(r'(\d+) bytes spill stores',
                                             report)[1]),
          'triton': triton.__version__, 'jax': jax.__version__}


def default_impls() -> list[str]:
  """'xla' and 'pallas', and 'kernel' where the fused CPU kernel runs."""
  cpu_kernel = jax.default_backend() == 'cpu' and em_kernel.available()
  return ['xla', 'pallas'] + (['kernel'] if cpu_kernel else [])


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', required=True, help='JSON lines appended here')
  parser.add_argument('--batches', default='16,64')
  parser.add_argument('--impls', default='', help="e.g. 'xla,pallas'")
  parser.add_argument('--layers', default='convcaps1,convcaps2')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--reps', type=int, default=3)
  parser.add_argument('--tiny', action='store_true',
                      help='batch 1 of a 5 x 5 grid of 2 types: a smoke run')
  parser.add_argument('--ptxas', default='',
                      help="'forward,backward': build the kernels instead")
  parser.add_argument('--sm', type=int, default=80)
  args = parser.parse_args(argv)
  if args.ptxas:
    with tempfile.TemporaryDirectory() as workdir:
      for kernel_pass in args.ptxas.split(','):
        row = ptxas_report(kernel_pass, args.sm, workdir)
        with open(args.out, 'a') as f:
          f.write(json.dumps(row) + '\n')
        print(row)
    return
  impls = args.impls.split(',') if args.impls else default_impls()
  batches = [1] if args.tiny else [int(b) for b in args.batches.split(',')]
  shapes = TINY_LAYERS if args.tiny else LAYERS
  device = jax.devices()[0]
  for name in args.layers.split(','):
    for batch in batches:
      steps = {impl: routing_step(impl, shapes[name], batch) for impl in impls}
      seconds = timing.time_calls_alternately(
          {impl: call for impl, (call, _) in steps.items()},
          rounds=args.rounds, reps=args.reps)
      for impl, (_, windows) in steps.items():
        grid, in_types, out_types, kernel_size, stride = shapes[name]
        row = {'layer': name, 'batch': batch, 'impl': impl,
               'ms_per_call': 1e3 * seconds[impl], 'windows': windows,
               'grid': grid, 'in_types': in_types, 'out_types': out_types,
               'kernel_size': kernel_size, 'stride': stride,
               'pass': 'forward+backward', 'tiny': args.tiny,
               'backend': jax.default_backend(),
               'device': device.device_kind, 'jax': jax.__version__}
        with open(args.out, 'a') as f:
          f.write(json.dumps(row) + '\n')
        print(f"{name} batch {batch} {impl}: {row['ms_per_call']:.2f} ms")


if __name__ == '__main__':
  main(sys.argv[1:])
