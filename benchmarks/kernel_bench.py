"""What the Pallas kernel benchmarks share: flags, timing, rows, ptxas builds.

``benchmarks.routing_kernels`` and ``benchmarks.em_kernels`` take the same
flags (``add_flags``): ``--output`` (JSON lines appended), ``--batch_sizes``,
``--impls``, ``--steps``, ``--warmup``, ``--tiny`` (a CPU smoke size, Pallas
interpreted, 1 step) and ``--ptxas=forward,backward --sm=80|90``, which
times nothing: it exports the kernels for CUDA, takes the Triton IR of the
Pallas call out of the exported module and builds it with the Triton
compiler that PyTorch installs (3.8 here: not the Triton inside XLA, no GPU
needed), then reads ptxas' registers a thread and spilled bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import jax
import jaxlib

from benchmarks import timing
from capsjax.training import metrics

# (row fields, function, its argument shapes, Triton kernel name to build)
Build = tuple[dict[str, Any], Callable[..., Any],
              Sequence[jax.ShapeDtypeStruct], str]


def add_flags(parser: argparse.ArgumentParser, batch_sizes: str,
              impls: str) -> None:
  """The flags both benchmarks take, with their default batch sizes and
  impls (comma lists)."""
  parser.add_argument('--output', default='',
                      help='append one JSON line per row to this path')
  parser.add_argument('--batch_sizes', default=batch_sizes,
                      help='comma-separated batch sizes')
  parser.add_argument('--impls', default=impls, help='comma-separated')
  parser.add_argument('--steps', type=int, default=20,
                      help='timed calls of each impl, in turn (the median '
                      'is reported)')
  parser.add_argument('--warmup', type=int, default=3,
                      help='untimed calls after compilation')
  parser.add_argument('--tiny', action='store_true',
                      help='a CPU smoke run: batch 1, a tiny shape, 1 step, '
                      'no warmup (Pallas interpreted off a GPU)')
  parser.add_argument('--ptxas', default='',
                      help="'forward,backward': time nothing, build these "
                      'kernels for --sm with Triton + ptxas (no GPU needed)')
  parser.add_argument('--sm', type=int, default=80, choices=(80, 90),
                      help='80: A100, 90: H100 (built as sm_90a)')


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None
          ) -> argparse.Namespace:
  """parse_args, then ``--tiny``'s steps; ``batch_sizes`` and ``impls``
  become lists."""
  args = parser.parse_args(argv)
  if args.tiny:
    args.batch_sizes, args.steps, args.warmup = '1', 1, 0
  args.batch_sizes = [int(b) for b in args.batch_sizes.split(',')]
  args.impls = [i for i in args.impls.split(',') if i]
  return args


def compiled_call(fn: Callable[..., Any], *args: Any
                  ) -> tuple[Callable[[], Any], float]:
  """(a call of jit(fn)(*args) that blocks until done, seconds to compile)."""
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - start
  return (lambda: jax.block_until_ready(compiled(*args))), compile_s


def median_seconds(calls: dict[str, Callable[[], Any]],
                   args: argparse.Namespace) -> dict[str, float]:
  """{name: blocking call} -> {name: median s per call}: ``args.warmup``
  calls each, then ``args.steps`` rounds of one call each, in turn."""
  return timing.time_calls_alternately(calls, rounds=args.steps, reps=1,
                                       warmup=args.warmup)


def environment() -> dict[str, Any]:
  """Where a row was measured: the training summaries' environment (versions,
  git commit), the backend, and the device by its kind."""
  return metrics.environment() | {
      'jaxlib_version': jaxlib.__version__, 'backend': jax.default_backend(),
      'device': jax.devices()[0].device_kind,
      'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
  }


def write_row(path: str, row: dict[str, Any]) -> None:
  """Appends ``row`` to ``path`` as one JSON line (nothing if path is '')."""
  if path:
    with open(path, 'a') as f:
      f.write(json.dumps(row) + '\n')


# ----------------------------------------------------------------------------
# Triton + ptxas builds.


def triton_ir(exported: jax.export.Exported, kernel_name: str
              ) -> tuple[str, dict[str, int]]:
  """(Triton IR text, {num_warps, num_stages}) of the exported module's
  Triton call named ``kernel_name`` (the call holds the IR as bytecode of
  JAX's Triton dialect, its launch options beside it)."""
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib import triton as jax_triton
  from jaxlib.mlir import ir
  with jax_mlir.make_ir_context() as context:
    configs = {}

    def visit(op):
      if (op.name == 'stablehlo.custom_call' and 'xla.gpu.triton'
          in str(op.attributes['call_target_name'])):
        config = ir.DictAttr(op.attributes['mhlo.backend_config'])
        configs[ir.StringAttr(config['name']).value] = config
      return ir.WalkResult.ADVANCE

    ir.Module.parse(exported.mlir_module()).operation.walk(visit)
    if kernel_name not in configs:
      raise ValueError(f'no Triton call {kernel_name!r}: {sorted(configs)}')
    config = configs[kernel_name]
    options = {key: ir.IntegerAttr(config[key]).value
               for key in ('num_warps', 'num_stages')}
    jax_triton.dialect.register_dialect(context)
    context.load_all_available_dialects()
    bytecode = ir.StringAttr(config['ir']).value_bytes
    return ir.Module.parse(bytecode).operation.get_asm(), options


def _ptxas_stat(pattern: str, report: str) -> str:
  match = re.search(pattern, report)
  if match is None:
    raise ValueError(f'ptxas said nothing like {pattern!r}:\n{report}')
  return match[1]


@contextlib.contextmanager
def _environ(name: str, value: str):
  old = os.environ.get(name)
  os.environ[name] = value
  try:
    yield
  finally:
    if old is None:
      del os.environ[name]
    else:
      os.environ[name] = old


def ptxas_report(fn: Callable[..., Any],
                 shapes: Sequence[jax.ShapeDtypeStruct], kernel_name: str,
                 sm: int, workdir: str) -> dict[str, Any]:
  """Builds the Triton call ``kernel_name`` of jit(fn) on ``shapes``, as
  exported for CUDA, for sm_``sm`` with the Triton compiler and its ptxas
  (no GPU needed); returns ptxas' registers a thread and spilled bytes."""
  import triton
  from triton.backends.compiler import GPUTarget
  exported = jax.export.export(
      jax.jit(fn), platforms=['cuda'],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
          '__gpu$xla.gpu.triton')])(*shapes)
  text, options = triton_ir(exported, kernel_name)
  source = os.path.join(workdir, f'{kernel_name}.ttir')
  with open(source, 'w') as f:
    f.write(text)
  with _environ('TRITON_CACHE_DIR', os.path.join(workdir, 'cache')):
    kernel = triton.compile(source, target=GPUTarget('cuda', sm, 32),
                            options=options)
  ptx = os.path.join(workdir, f'{kernel_name}.ptx')
  with open(ptx, 'w') as f:
    f.write(kernel.asm['ptx'])
  ptxas = os.path.join(os.path.dirname(triton.backends.nvidia.__file__),
                       'bin', 'ptxas')
  # The PTX names its target: sm_90a, not sm_90, for a Hopper build.
  target = _ptxas_stat(r'(?m)^\.target (\w+)', kernel.asm['ptx'])
  report = subprocess.run(
      [ptxas, '-v', '--gpu-name', target, ptx, '-o', ptx + '.cubin'],
      capture_output=True, text=True, check=True).stderr
  return {
      'kernel': _ptxas_stat(r"entry function '(\w+)'", report),
      'target': target,
      'registers': int(_ptxas_stat(r'Used (\d+) registers', report)),
      'spill_store_bytes': int(_ptxas_stat(r'(\d+) bytes spill stores',
                                           report)),
      'spill_load_bytes': int(_ptxas_stat(r'(\d+) bytes spill loads',
                                          report)),
      **options, 'triton': triton.__version__, 'jax': jax.__version__}


def write_ptxas_rows(args: argparse.Namespace, builds: Iterable[Build]
                     ) -> list[dict[str, Any]]:
  """``ptxas_report`` of each build for ``args.sm``, written and printed."""
  rows = []
  with tempfile.TemporaryDirectory() as workdir:
    for fields, fn, shapes, kernel_name in builds:
      row = fields | ptxas_report(fn, shapes, kernel_name, args.sm, workdir)
      write_row(args.output, row)
      print(json.dumps(row), flush=True)
      rows.append(row)
  return rows
