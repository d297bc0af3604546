"""Where a model's train step spends its time: the jitted train step (built
as ``benchmarks.harness`` builds it for ``experiments.benchmark``) traced
with ``jax.profiler.trace`` and the trace read back with
``jax.profiler.ProfileData``, printing the top operations by total time.

  python -m benchmarks.profile_step --model=capsnet_mnist --batch_size=128 \\
      --steps=5 [--dtype=bfloat16] [--top=25] [--conv_layout=nchw] \\
      [--model_option=implementation=pallas]

On a GPU the operations are the kernels and copies on the device plane
('/device:GPU:0'), named by the HLO op that launched them where the trace
says so; without a device plane (on a CPU) they are the XLA ops on the
host's thread-pool lines. Each op's time is its self time (nested events
subtracted), so wrappers and their contents are not counted twice; the
share of the step is its time per step over the traced step time (the span
from the first to the last op, divided by the steps). Where CPU threads or
GPU streams overlap, the ops' summed time exceeds that span; the shares are
then of the summed time, so that they still sum to 100% at most.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import jax

from benchmarks import bf16_audit
from benchmarks import harness

# Events on the host lines that wrap ops rather than being one: counting
# them would count the ops' time again (their self time is scheduling).
_HOST_WRAPPERS = ('ThunkExecutor::', 'PjitFunction', 'ExecuteHelper',
                  'PjRtCpuClient', 'TfrtCpu', '$')
# Device lines that summarise the stream lines rather than add to them.
_DEVICE_SUMMARIES = ('XLA Modules', 'Steps', 'XLA TraceMe', 'Source',
                     'Launch Stats', 'TensorFlow Ops', 'TensorFlow Name Scope')


def _self_times(events: list[Any]) -> list[tuple[Any, int]]:
  """(event, self time in ns) of one line's events: each event's duration
  less its direct children's (events on the line nested inside it)."""
  events = sorted(events, key=lambda e: (e.start_ns, -e.duration_ns))
  result: list[list[Any]] = []
  stack: list[list[Any]] = []  # [event, end_ns, index into result]
  for event in events:
    end = event.start_ns + event.duration_ns
    while stack and event.start_ns >= stack[-1][1]:
      stack.pop()
    if stack:
      result[stack[-1][2]][1] -= event.duration_ns
    result.append([event, event.duration_ns])
    stack.append([event, end, len(result) - 1])
  return [(e, max(t, 0)) for e, t in result]


def _stat(event: Any, name: str) -> Any:
  try:
    for key, value in event.stats:
      if key == name:
        return value
  except Exception:  # stats can be absent or unreadable on some events
    pass
  return None


def _lines(data: Any) -> tuple[str, list[tuple[str, Any]]]:
  """(the plane read, its (line name, line) pairs holding the ops): the
  first GPU's device plane, else the host plane's XLA thread-pool lines."""
  planes = {plane.name: plane for plane in data.planes}
  devices = sorted(n for n in planes if n.startswith('/device:GPU:'))
  if devices:
    name = '/device:GPU:0' if '/device:GPU:0' in planes else devices[0]
    lines = [(line.name, line) for line in planes[name].lines]
    ops = [(n, line) for n, line in lines if n == 'XLA Ops']
    if ops:  # the derived op line already holds each stream's kernels
      return name, ops
    streams = [(n, line) for n, line in lines if n.startswith('Stream')]
    return name, streams or [(n, line) for n, line in lines
                             if n not in _DEVICE_SUMMARIES]
  host = planes.get('/host:CPU')
  if host is None:
    raise RuntimeError(f'no device or host plane in the trace: {sorted(planes)}')
  lines = [(line.name, line) for line in host.lines]
  xla = [(n, line) for n, line in lines if n.startswith('tf_XLA')]
  return '/host:CPU', xla or [(n, line) for n, line in lines if n != 'python']


def read_trace(path: str, steps: int) -> dict[str, Any]:
  """The ops of an xplane.pb trace of ``steps`` train steps: {'plane',
  'lines', 'span_ns', 'ops': [{'name', 'ns', 'count'}] by time, longest
  first}."""
  data = jax.profiler.ProfileData.from_file(path)
  plane, lines = _lines(data)
  totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
  first, last = None, None
  for _, line in lines:
    for event, self_ns in _self_times(list(line.events)):
      name = event.name
      if plane == '/host:CPU' and name.startswith(_HOST_WRAPPERS):
        continue
      op = _stat(event, 'hlo_op') if plane != '/host:CPU' else None
      key = f'{op} [{name}]' if op and op != name else name
      totals[key][0] += self_ns
      totals[key][1] += 1
      end = event.start_ns + event.duration_ns
      first = event.start_ns if first is None else min(first, event.start_ns)
      last = end if last is None else max(last, end)
  ops = sorted(({'name': k, 'ns': v[0], 'count': v[1]}
                for k, v in totals.items()), key=lambda o: -o['ns'])
  return {'plane': plane, 'lines': [n for n, _ in lines],
          'span_ns': (last - first) if ops else 0, 'ops': ops,
          'steps': steps}


def profile(model: str, *, batch_size: int = 0, steps: int = 5,
            dtype: str = 'float32', warmup: int = 2,
            options: dict[str, Any] | None = None) -> dict[str, Any]:
  """Compile ``model``'s train step (``options``: model options), time
  ``steps`` steps untraced, then trace ``steps`` more; ``read_trace``'s
  dict with 'step_s' (the untraced median), 'traced_step_s', 'compile_s',
  'compiled_ops' (``bf16_audit.compiled_ops``) and the setting added."""
  config = harness.configure(model, batch_size=batch_size, options=options)
  step, (state, images, labels, key) = harness.train_step_and_inputs(
      config, dtype=dtype)
  # Donated as in the harness, so the program profiled is the one it times.
  start = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=0).lower(
      state, images, labels, key).compile()
  compile_s = time.perf_counter() - start
  compiled_ops = bf16_audit.compiled_ops(compiled.as_text())
  for _ in range(warmup):
    state, _ = compiled(state, images, labels, key)
  jax.block_until_ready(state)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, _ = compiled(state, images, labels, key)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - start)
  with tempfile.TemporaryDirectory() as directory:
    start = time.perf_counter()
    with jax.profiler.trace(directory):
      for _ in range(steps):
        state, _ = compiled(state, images, labels, key)
      jax.block_until_ready(state)
      traced_s = (time.perf_counter() - start) / steps
    paths = glob.glob(os.path.join(directory, '**', '*.xplane.pb'),
                      recursive=True)
    if not paths:
      raise RuntimeError(f'jax.profiler.trace wrote no xplane.pb in {directory}')
    result = read_trace(paths[0], steps)
  return result | {'model': model, 'model_name': config.model,
                   'batch_size': config.batch_size, 'dtype': dtype,
                   'device': str(jax.devices()[0]), 'compile_s': compile_s,
                   'options': dict(options or {}),
                   'conv_layout': harness.conv_layout(),
                   'compiled_ops': compiled_ops,
                   'step_s': statistics.median(times),
                   'traced_step_s': traced_s}


def table(result: dict[str, Any], top: int = 25) -> str:
  """The top ``top`` ops of ``profile``'s result as a text table."""
  steps = result['steps']
  span_ms = result['span_ns'] / 1e6 / steps
  total_ms = sum(o['ns'] for o in result['ops']) / 1e6 / steps
  whole_ms = max(span_ms, total_ms)
  ops = result['compiled_ops']
  options = ''.join(f' {k}={v}' for k, v in result['options'].items())
  lines = [
      f"{result['model']} ({result['model_name']}) batch "
      f"{result['batch_size']} {result['dtype']}{options} conv_layout="
      f"{result['conv_layout']} on {result['device']}: "
      f"compile {result['compile_s']:.1f} s",
      f"compiled: {ops['instructions']} instructions, {ops['fusions']} "
      f"fusions ({ops['layout_fusions']} transposes/copies), "
      f"{ops['copies'] + ops['transposes']} unfused transposes/copies, "
      f"{ops['while']} while loops, custom calls {ops['custom_calls']}",
      *(f'  {conv}' for conv in ops['convolutions']),
      f"step {result['step_s'] * 1e3:.3f} ms untraced (median of {steps}), "
      f"{result['traced_step_s'] * 1e3:.3f} ms traced; traced op span "
      f"{span_ms:.3f} ms/step, op time {total_ms:.3f} ms/step in "
      f"{len(result['ops'])} ops (% step: of {whole_ms:.3f} ms)",
      f"plane {result['plane']}, lines: {', '.join(result['lines'])}",
      f"{'#':>3} {'ms/step':>9} {'% step':>7} {'cum %':>6} {'calls/step':>10}"
      f"  op",
  ]
  cumulative = 0.0
  for rank, op in enumerate(result['ops'][:top], 1):
    ms = op['ns'] / 1e6 / steps
    share = 100 * ms / whole_ms if whole_ms else 0.0
    cumulative += share
    name = op['name'] if len(op['name']) <= 100 else op['name'][:97] + '...'
    lines.append(f"{rank:>3} {ms:>9.4f} {share:>6.1f}% {cumulative:>5.1f}% "
                 f"{op['count'] / steps:>10.1f}  {name}")
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--model', required=True,
                      help='registry name or FILE[:VARIANT] of '
                      'experiments/configs, as for experiments.benchmark')
  parser.add_argument('--batch_size', type=int, default=0,
                      help="0: the config's own")
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--warmup', type=int, default=2)
  parser.add_argument('--dtype', default='float32')
  parser.add_argument('--top', type=int, default=25)
  parser.add_argument('--conv_layout', default='xla',
                      choices=list(harness.CONV_LAYOUTS),
                      help='as experiments.benchmark --conv_layout')
  parser.add_argument('--model_option', action='append', default=[],
                      help='KEY=VALUE, as experiments.benchmark')
  args = parser.parse_args(argv)
  harness.set_conv_layout(args.conv_layout)
  result = profile(args.model, batch_size=args.batch_size, steps=args.steps,
                   dtype=args.dtype, warmup=args.warmup,
                   options=harness.parse_options(args.model_option))
  print(table(result, args.top), flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
