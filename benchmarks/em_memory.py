"""Compiled memory and cost of the EM models' train step and routing layers.

XLA's compiled memory analysis (exact for the compiled program, no run) and
cost analysis of the real train step (as ``benchmarks.harness`` builds
it) at several batches, of each EM routing layer's forward and forward +
backward passes, and optionally a short timing of the train step.

  python -m benchmarks.em_memory steps --batches=8,16,64
  python -m benchmarks.em_memory steps --model=matrix_capsnet_mnist:paper
  python -m benchmarks.em_memory layers --batches=8,64
  python -m benchmarks.em_memory time --batches=8,16 --rounds=3
  python -m benchmarks.em_memory hlo --batches=8 --hlo_dir=/tmp/em_hlo

``--impls``: how the conv capsule layers route their windows
(``capsjax.kernels.conv_capsule_routing``'s ``implementation`` and
``window_chunk``): 'kernel' (``implementation='native'``, the fused CPU
kernel, the default where it applies), and through
XLA 'auto' (chunks of ``matrix_capsules.WINDOW_CHUNK_BYTES`` of votes),
'whole' (all at once, the layer-wide votes), 'chunkN' (N windows). XLA's
memory analysis does not see the kernel's own buffers (per worker thread
about 3 x one window's votes, ``csrc/em_routing.cc``). ``time`` alternates
the train steps of every impl in one process, so their ratio is measured
under the same load.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from capsjax import kernels
from capsjax.routing import matrix_capsules
from capsjax.training import state as state_lib

_MIB = 2.0**20


def _train_step(spec: str, batch: int, options: dict, impl: str = 'kernel'):
  """(jitted train step, its example arguments) of a config at ``batch``,
  its conv capsule layers routing as ``impl`` says."""
  config = harness.configure(
      spec, batch_size=batch,
      options=options | _routing_options(impl))
  step, example = harness.train_step_and_inputs(config)
  return jax.jit(step, donate_argnums=0), example


def _analysis(compiled) -> dict:
  memory = harness.memory_analysis(compiled)
  cost = harness.xla_cost(compiled)
  return {'temp_mib': memory['temp'] / _MIB,
          'total_mib': memory['total'] / _MIB,
          'xla_gflop': (cost['flops'] or 0.0) / 1e9,
          'xla_gb_accessed': (cost['bytes'] or 0.0) / 1e9}


def _routing_options(impl: str) -> dict:
  """The conv capsule layers' implementation and window_chunk of ``impl``:
  'kernel' (the native one), or XLA's 'auto' (default chunks), 'whole' (0)
  or 'chunkN'."""
  if impl == 'kernel':
    return {'implementation': 'native', 'window_chunk': None}
  if impl == 'auto':
    return {'implementation': 'xla', 'window_chunk': None}
  if impl == 'whole':
    return {'implementation': 'xla', 'window_chunk': 0}
  if impl.startswith('chunk'):
    return {'implementation': 'xla', 'window_chunk': int(impl[len('chunk'):])}
  raise ValueError(f"impl must be kernel, auto, whole or chunkN, got "
                   f"{impl!r}.")


def steps_table(args) -> None:
  for impl in args.impls:
    for batch in args.batches:
      train, example = _train_step(args.model, batch, args.options, impl)
      start = time.perf_counter()
      compiled = train.lower(*example).compile()
      row = _analysis(compiled)
      print(f'train step {args.model} impl={impl} batch={batch}: '
            f'temp {row["temp_mib"]:.1f} MiB, total {row["total_mib"]:.1f} '
            f'MiB, XLA {row["xla_gflop"]:.2f} GFLOP, '
            f'{row["xla_gb_accessed"]:.2f} GB accessed, compile '
            f'{time.perf_counter() - start:.1f} s', flush=True)


def _layer_inputs(model, batch: int, key):
  """Random (poses, activations) entering caps1, caps2 and class caps."""
  rows, cols = model.grid_sizes
  sizes = {'caps1': (rows[0], cols[0], model.caps1.weights.shape[2]),
           'caps2': (rows[1], cols[1], model.caps2.weights.shape[2]),
           'class': (rows[2], cols[2], model.class_caps.weights.shape[0])}
  inputs = {}
  for name, (h, w, c) in sizes.items():
    k1, k2, key = jax.random.split(key, 3)
    inputs[name] = (jax.random.normal(k1, (batch, h, w, c, 4, 4)),
                    jax.random.uniform(k2, (batch, h, w, c)))
  return inputs


def _layer_fns(model, impl: str):
  """Pure (params, poses, activations) -> scalar of each EM layer."""
  routing = _routing_options(impl)

  def conv(layer):
    def f(params, poses, acts):
      out_poses, out_acts, _ = kernels.conv_capsule_routing(
          poses, acts, *params, stride=layer.stride,
          em_routing=layer.em_routing, window_chunk=routing['window_chunk'],
          implementation=routing['implementation'])
      return jnp.sum(out_poses) + jnp.sum(out_acts)
    return f, (layer.weights[...], layer.beta_u[...], layer.beta_a[...])

  cls = model.class_caps

  def class_fn(params, poses, acts):
    out_poses, out_acts, _ = matrix_capsules.class_capsule_routing(
        poses, acts, *params, coordinate_addition=cls.coordinate_addition,
        coordinate_offsets=cls.coordinate_offsets,
        coordinate_order=cls.coordinate_order, em_routing=cls.em_routing)
    return jnp.sum(out_poses) + jnp.sum(out_acts)

  return {'caps1': conv(model.caps1), 'caps2': conv(model.caps2),
          'class': (class_fn, (cls.weights[...], cls.beta_u[...],
                               cls.beta_a[...]))}


def layers_table(args, hlo_dir: str = '') -> None:
  model = state_lib.create_model(
      harness.configure(args.model, options=args.options), seed=0)
  for batch in args.batches:
    inputs = _layer_inputs(model, batch, jax.random.PRNGKey(0))
    for name in ('caps1', 'caps2', 'class'):
      poses, acts = inputs[name]
      for impl in args.impls:
        f, params = _layer_fns(model, impl)[name]
        for pass_name, g in (('forward', f),
                             ('fwd+bwd', jax.grad(f, argnums=(0, 1, 2)))):
          compiled = jax.jit(g).lower(params, poses, acts).compile()
          row = _analysis(compiled)
          print(f'{name} impl={impl} batch={batch} {pass_name}: temp '
                f'{row["temp_mib"]:.1f} MiB, XLA {row["xla_gflop"]:.3f} '
                f'GFLOP, {row["xla_gb_accessed"]:.3f} GB accessed',
                flush=True)
          if hlo_dir and pass_name == 'fwd+bwd':
            text = compiled.as_text()
            path = os.path.join(hlo_dir, f'{name}_{impl}_b{batch}.hlo')
            with open(path, 'w') as out:
              out.write(text)
            print(f'  wrote {path}; '
                  f'{_big_buffers(text, poses.shape, model, name)}')


def _big_buffers(text: str, poses_shape, model, name: str) -> str:
  """Counts, by name, the entry computation's instructions (the buffers XLA
  materialises between its kernels) whose f32 output has at least as many
  elements as the layer's votes (the [B, H', W', I, O, 16] tensors)."""
  fns = {'caps1': model.caps1, 'caps2': model.caps2}
  batch = poses_shape[0]
  if name in fns:
    layer = fns[name]
    k, _, cin, cout = layer.weights.shape[:4]
    out_h = (poses_shape[1] - k) // layer.stride + 1
    out_w = (poses_shape[2] - k) // layer.stride + 1
    size = batch * out_h * out_w * k * k * cin * cout * 16
  else:
    size = (batch * poses_shape[1] * poses_shape[2] * poses_shape[3]
            * model.class_caps.weights.shape[1] * 16)
  counts = collections.Counter()
  entry = text[text.index('\nENTRY'):]
  for match in re.finditer(
      r'^\s*(?:ROOT )?%([\w\-]+)[.\d]* = f32\[([\d,]+)\]', entry,
      re.MULTILINE):
    elems = int(np.prod([int(d) for d in match.group(2).split(',')]))
    if elems >= size:
      counts[match.group(1)] += 1
  return f'votes-sized ({size} elements) outputs by name: {dict(counts)}'


def time_table(args) -> None:
  for batch in args.batches:
    compiled = {}
    for impl in args.impls:
      train, example = _train_step(args.model, batch, args.options, impl)
      compiled[impl] = train.lower(*example).compile()
    states = {impl: jax.tree.map(jnp.copy, example[0]) for impl in args.impls}
    times = {impl: [] for impl in args.impls}
    for impl in args.impls:  # warm-up
      states[impl], _ = compiled[impl](states[impl], *example[1:])
    jax.block_until_ready(states)
    for _ in range(args.rounds):
      for impl in args.impls:
        start = time.perf_counter()
        for _ in range(args.steps):
          states[impl], metrics = compiled[impl](states[impl], *example[1:])
        jax.block_until_ready((states[impl], metrics))
        times[impl].append((time.perf_counter() - start) / args.steps)
    medians = {impl: statistics.median(t) for impl, t in times.items()}
    base = medians[args.impls[0]]
    print(f'time batch={batch} (loaded machine, not a claim): ' + ', '.join(
        f'{impl} {m:.3f} s/step ({base / m:.2f}x of {args.impls[0]})'
        for impl, m in medians.items()), flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('mode', choices=('steps', 'layers', 'time', 'hlo'))
  parser.add_argument('--model', default='matrix_capsnet_mnist')
  parser.add_argument('--batches', default='8,16,64')
  parser.add_argument('--impls', default='kernel')
  parser.add_argument('--option', action='append', default=[],
                      help='KEY=VALUE model option (repeatable)')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=2)
  parser.add_argument('--hlo_dir', default='/tmp/em_hlo')
  args = parser.parse_args()
  args.batches = [int(b) for b in args.batches.split(',')]
  args.impls = args.impls.split(',')
  args.options = dict(
      (k, harness.parse_value(v)) for k, v in
      (o.split('=', 1) for o in args.option))
  if args.mode == 'steps':
    steps_table(args)
  elif args.mode == 'layers':
    layers_table(args)
  elif args.mode == 'hlo':
    os.makedirs(args.hlo_dir, exist_ok=True)
    layers_table(args, args.hlo_dir)
  else:
    time_table(args)


if __name__ == '__main__':
  main()
