"""The benchmark harness behind ``python -m experiments.benchmark`` (whose
docstring says what the rows hold): configs from registry names or config
files, the families' train and eval steps on random images, their timings,
compiled memory and cost, the routing roofline rows, the PyTorch comparison
and the markdown tables. ``tools/step_fingerprint.py`` and
``benchmarks/em_memory.py`` build their steps here too.
"""

from __future__ import annotations

import ast
import datetime
import functools
import importlib
import math
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from benchmarks import bf16_audit
from capsjax import _jax_private
from capsjax import flops as flops_lib
from capsjax import models
from capsjax import routing
from capsjax import training
from capsjax.kernels import conv
from capsjax.kernels import em_cpu
from capsjax.routing import attention as attention_routing
from capsjax.training import metrics as metrics_lib
from capsjax.training import sharding
from capsjax.training import state as state_lib
from experiments.configs import common
from experiments.configs import matrix_capsnet_mnist

# PyTorch's modes (benchmarks/torch_models.py TORCH_MODES), named here
# so that the harness and the command's flags need no torch.
TORCH_MODES = ('eager_float32', 'compile_float32', 'eager_bfloat16',
               'compile_bfloat16')

# The physical layout XLA's GPU compiler gives cuDNN's convolutions
# (``--conv_layout``): its own choice, or forced by its debug options (an
# XLA_FLAGS setting, read once when the backend starts). Its choice on
# Hopper GPUs is NHWC for every dtype but float64, on older CUDA GPUs NHWC
# for float16 and bfloat16 and NCHW for float32 (docs/gpu_plan.md).
CONV_LAYOUTS = {'xla': '', 'nhwc': '--xla_gpu_force_conv_nhwc=true',
                'nchw': '--xla_gpu_force_conv_nchw=true'}

# Routing shapes of the paper models. (kind, votes shape given B)
ROUTING_CASES: dict[str, tuple[str, Callable[[int], tuple[int, ...]]]] = {
    # CapsNet DigitCaps on 28x28 MNIST: 6x6x32 primary capsules -> 10 x 16-D.
    'dynamic_digitcaps': ('dynamic', lambda b: (b, 1152, 10, 16)),
    # ConvCaps1 of the smallNORB model (A=B=C=D=32): a 6x6 grid of 3x3x32 =
    # 288 children per window, 32 parent types, 4x4 poses.
    'em_convcaps1': ('em', lambda b: (b, 6, 6, 288, 32, 16)),
    # The same ConvCaps1 routed by the fused CPU kernel from its pose
    # patches (capsjax.kernels.em_cpu: the votes are made inside it).
    'em_convcaps1_kernel': ('em_kernel', lambda b: (b, 6, 6, 288, 32, 16)),
    # Class capsules of that model: 4x4 grid x 32 types = 512 -> 5 classes.
    'em_class': ('em', lambda b: (b, 512, 5, 16)),
    # The other routings on the DigitCaps votes, to compare like with like:
    # Su's non-accumulating dynamic routing, Efficient-CapsNet's
    # self-attention routing (non-iterative) and the inverted dot-product
    # attention routing (its LayerNorm, --num_iterations passes).
    'su_digitcaps': ('su', lambda b: (b, 1152, 10, 16)),
    'em_digitcaps': ('em', lambda b: (b, 1152, 10, 16)),
    'self_attention_digitcaps': ('self_attention',
                                 lambda b: (b, 1152, 10, 16)),
    'inverted_digitcaps': ('inverted', lambda b: (b, 1152, 10, 16)),
    # Efficient-CapsNet's own FCCaps: 16 primary capsules -> 10 x 16-D.
    'self_attention_efficient': ('self_attention', lambda b: (b, 16, 10, 16)),
}
# Datasets stored larger than the model's input: smallNORB at 48x48
# (capsjax.data.smallnorb), CIFAR-10 at 32x32; the steps crop them.
_STORED_SIZES = {'smallnorb': 48, 'cifar10': 32}
_DEFAULT_IMAGE_SIZE = 28  # models without an input_shape (any size)
_ROUTING_BATCH_SIZE = 32


# ----------------------------------------------------------------------------
# Configs.


def resolve_config(spec: str) -> ml_collections.ConfigDict:
  """A training config from a registry name or ``FILE[:VARIANT]``."""
  if spec in models.list_models():
    config = common.base_config()
    if models.model_class(spec).FAMILY == 'em':
      config = matrix_capsnet_mnist.em_defaults(config)
    config.model = spec
    config.reconstruction_weight = 0.0005  # only read by models with a decoder
    return config
  name, _, variant = spec.partition(':')
  path = os.path.join(os.path.dirname(os.path.abspath(common.__file__)),
                      f'{name}.py')
  if not name.isidentifier() or not os.path.exists(path):
    raise ValueError(
        f'--model={spec!r} is neither a registry name '
        f'({", ".join(models.list_models())}) nor a config in '
        f'experiments/configs (e.g. capsnet_mnist:smoke).')
  return importlib.import_module(f'experiments.configs.{name}').get_config(
      variant)


def set_conv_layout(layout: str) -> str:
  """Adds ``CONV_LAYOUTS[layout]`` to XLA_FLAGS (before JAX starts its
  backend) and returns XLA_FLAGS; 'xla' changes nothing. ValueError for an
  unknown layout, or a forced one once the backend has started (too late
  for XLA to read it)."""
  if layout not in CONV_LAYOUTS:
    raise ValueError(f'--conv_layout must be one of '
                     f'{", ".join(CONV_LAYOUTS)}, got {layout!r}.')
  flags = os.environ.get('XLA_FLAGS', '')
  flag = CONV_LAYOUTS[layout]
  if flag and flag not in flags.split():
    if _jax_private.backends_started():
      raise ValueError(f'--conv_layout={layout}: the JAX backend has started, '
                       'so XLA would not read the flag; set it first.')
    flags = f'{flags} {flag}'.strip()
    os.environ['XLA_FLAGS'] = flags
  return flags


def conv_layout() -> str:
  """The ``CONV_LAYOUTS`` name XLA_FLAGS asks for ('xla': none)."""
  flags = os.environ.get('XLA_FLAGS', '').split()
  for name, flag in CONV_LAYOUTS.items():
    if flag and flag in flags:
      return name
  return 'xla'


def parse_value(text: str) -> Any:
  """'3' -> 3, 'True' -> True, '(28, 28, 1)' -> tuple, 'bfloat16' -> str."""
  lowered = {'true': True, 'false': False, 'none': None}
  if text.lower() in lowered:
    return lowered[text.lower()]
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def configure(spec: str, *, batch_size: int = 0, image_size: int = 0,
              options: dict[str, Any] | None = None
              ) -> ml_collections.ConfigDict:
  """``resolve_config`` with the batch size, image size and options set."""
  config = resolve_config(spec)
  if batch_size:
    config.batch_size = batch_size
  for key, value in (options or {}).items():
    config.model_options[key] = value
  if image_size:
    defaults = models.model_options(config.model)
    if config.dataset == 'smallnorb':
      raise ValueError('image_size cannot change smallNORB inputs (48x48 '
                       'stored, 32x32 crops).')
    if 'input_shape' in defaults:
      channels = tuple(config.model_options.get(
          'input_shape', defaults['input_shape']))[2]
      config.model_options.input_shape = (image_size, image_size, channels)
    else:
      config.image_size = image_size
  return config


def image_shape(config: ml_collections.ConfigDict) -> tuple[int, int, int]:
  """Shape [H, W, C] of the uint8 images the train step receives."""
  options = models.model_options(config.model) | state_lib.model_options(config)
  if 'input_shape' in options:
    height, width, channels = options['input_shape']
  else:
    size = config.get('image_size') or _DEFAULT_IMAGE_SIZE
    height, width, channels = size, size, options['input_channels']
  if config.dataset in _STORED_SIZES:
    height = width = _STORED_SIZES[config.dataset]
  return height, width, channels


def num_classes(config: ml_collections.ConfigDict) -> int:
  options = models.model_options(config.model) | state_lib.model_options(config)
  return options['num_classes']


# ----------------------------------------------------------------------------
# Steps.


def make_steps(config: ml_collections.ConfigDict, optimizer, dtype: str
               ) -> state_lib.FamilySteps:
  """The family's own train and eval steps, computing in ``dtype``."""
  config = config.copy_and_resolve_references()
  config.compute_dtype = dtype
  return training.family(config).make_steps(config, optimizer)


def train_step_and_inputs(config: ml_collections.ConfigDict, *, seed: int = 0,
                          dtype: str = 'float32'
                          ) -> tuple[Callable, tuple[Any, ...]]:
  """(the train step of ``config`` in ``dtype``, not jitted: (state, images,
  labels, key) -> (state, metrics); its arguments: a fresh train state and
  random uint8 images and labels of the config's batch size), for measuring
  the compiled program (memory and cost analysis, HLO) outside
  ``benchmark_model``."""
  model = state_lib.create_model(config, seed=seed)
  optimizer = state_lib.make_optimizer(config)
  graphdef, state = state_lib.init_train_state(model, optimizer)
  steps = make_steps(config, optimizer, dtype)
  rng = np.random.default_rng(seed)
  batch = config.batch_size
  images = jnp.asarray(rng.integers(0, 256, (batch,) + image_shape(config),
                                    np.uint8))
  labels = jnp.asarray(rng.integers(0, num_classes(config), batch, np.int32))
  return (functools.partial(steps.train_step, graphdef),
          (state, images, labels, jax.random.PRNGKey(seed + 2)))


# ----------------------------------------------------------------------------
# Measurements.


def _median_seconds(call: Callable[[], Any], warmup: int, steps: int
                    ) -> float:
  """Median wall time of ``call()`` (synchronised) over ``steps`` calls."""
  for _ in range(warmup):
    jax.block_until_ready(call())
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _compile(jitted, *args) -> tuple[Any, float]:
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  return compiled, time.perf_counter() - start


def memory_analysis(compiled) -> dict[str, int]:
  """XLA's buffer sizes of a compiled step; total = args + outputs + temp - aliases."""
  stats = compiled.memory_analysis()
  if stats is None:
    return {}
  total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
           + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  return {'total': int(total), 'temp': int(stats.temp_size_in_bytes),
          'argument': int(stats.argument_size_in_bytes),
          'output': int(stats.output_size_in_bytes),
          'alias': int(stats.alias_size_in_bytes)}


def xla_cost(compiled) -> dict[str, float | None]:
  """XLA's 'flops', 'transcendentals', 'bytes accessed' (None if missing)."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # some backends do not implement it
    cost = None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  cost = cost or {}
  get = lambda key: float(cost[key]) if key in cost else None
  return {'flops': get('flops'), 'transcendentals': get('transcendentals'),
          'bytes': get('bytes accessed')}


def device_peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats()
  if not stats or 'peak_bytes_in_use' not in stats:
    return None
  return int(stats['peak_bytes_in_use'])


def peak_rss_bytes() -> int:
  # ru_maxrss is KiB on Linux, bytes on macOS.
  scale = 1 if sys.platform == 'darwin' else 1024
  return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
  """The training summaries' environment, plus the CPU, flax and the date."""
  return metrics_lib.environment() | {
      'cpu': cpu_model(),
      'flax_version': flax.__version__,
      'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
  }


def torch_train_step(config: ml_collections.ConfigDict, seed: int,
                     mode: str = 'eager_float32') -> Callable[[], Any]:
  """One train step of the model's PyTorch reference in ``mode``
  (``TORCH_MODES``) on the kind of device JAX computes on: the CUDA GPU
  when JAX's backend is a GPU, else the CPU threads this process may use
  (benchmarks/torch_models.py)."""
  try:
    from benchmarks import torch_models
  except ImportError as e:
    raise ValueError(f'--compare=torch needs PyTorch and the repository '
                     f"root on the path: pip install -e '.[bench]' and run "
                     f'from the repository ({e}).') from e
  return torch_models.train_step_fn(
      config.model, state_lib.model_options(config), config.batch_size,
      image_shape(config), num_classes(config), config.learning_rate,
      config.get('reconstruction_weight', 0.0),
      num_threads=len(os.sched_getaffinity(0)), seed=seed,
      weight_decay=config.get('weight_decay', 0.0), mode=mode,
      device='cuda' if jax.default_backend() == 'gpu' else 'cpu')


def check_modes(torch_modes, compare_dtypes) -> None:
  """Raises ValueError for a PyTorch mode or capsjax dtype not known."""
  for mode in torch_modes:
    if mode not in TORCH_MODES:
      raise ValueError(f'--torch_modes: {mode!r} is not one of '
                       f'{", ".join(TORCH_MODES)}.')
  for dtype in compare_dtypes:
    if dtype not in state_lib.COMPUTE_DTYPES:
      raise ValueError(f'--compare_dtypes: {dtype!r} is not one of '
                       f'{", ".join(state_lib.COMPUTE_DTYPES)}.')


def _train_caller(compiled, state, images, labels, data_key):
  """(a call doing one train step of ``compiled`` per call, carrying the
  donated state; a holder whose 'state' is the latest state)."""
  holder = {'state': state, 'count': 0}

  def call():
    key = jax.random.fold_in(data_key, holder['count'])
    holder['count'] += 1
    holder['state'], metrics = compiled(holder['state'], images, labels, key)
    return holder['state'], metrics

  return call, holder


def _failure(error: BaseException) -> str:
  """A failed mode's reason, in one line."""
  text = ' '.join(str(error).split())
  return f'failed: {type(error).__name__}: {text[:300]}'


def time_modes(calls: dict[str, Callable[[], Any]], *, rounds: int,
               steps: int, warmup: int, batch: int,
               guarded: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
  """Each mode's train step timed in ``rounds`` rounds that alternate over
  the modes (each sees the same machine), ``steps`` timed calls a round
  after ``warmup`` untimed ones (at least one: compilation).

  Args:
    calls: mode name -> a call doing one train step.
    rounds, steps, warmup: as the flags.
    batch: images per step.
    guarded: the modes whose failure (any exception: ``torch.compile``
      raises many kinds) is reported instead of raised.
  Returns:
    mode -> {'status': 'ok' or 'failed: ...', 'step_s_rounds', 'step_s'
    (the median round), 'images_per_s'}; a failed mode's times are None.
  """
  results = {name: {'status': 'ok', 'step_s_rounds': [], 'step_s': None,
                    'images_per_s': None} for name in calls}

  def attempt(name, how_many, warm):
    if results[name]['status'] != 'ok':
      return None
    try:
      return _median_seconds(calls[name], warm, how_many)
    except Exception as error:  # pylint: disable=broad-exception-caught
      if name not in guarded:
        raise
      results[name]['status'] = _failure(error)
      return None

  for name in calls:
    attempt(name, 1, max(warmup, 1) - 1)
  for _ in range(rounds):
    for name in calls:
      seconds = attempt(name, steps, 0)
      if seconds is not None:
        results[name]['step_s_rounds'].append(seconds)
  for result in results.values():
    if result['status'] == 'ok':
      result['step_s'] = statistics.median(result['step_s_rounds'])
      result['images_per_s'] = batch / result['step_s']
  return results


def mode_ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """capsjax's best mode against PyTorch's best, and each against each.

  Args:
    results: ``time_modes``'s, capsjax modes named 'capsjax_*' and
      PyTorch's 'torch_*'.
  Returns:
    {'best_capsjax_mode', 'best_torch_mode' (None where every PyTorch mode
    failed), 'best_ratio' (capsjax's best images/s over PyTorch's; None
    likewise), 'mode_ratios': {capsjax mode: {PyTorch mode: ratio}} over the
    modes that ran}.
  """
  ran = {name: r['images_per_s'] for name, r in results.items()
         if r['status'] == 'ok'}
  ours = {n: v for n, v in ran.items() if n.startswith('capsjax_')}
  theirs = {n: v for n, v in ran.items() if n.startswith('torch_')}
  best_ours = max(ours, key=ours.get) if ours else None
  best_theirs = max(theirs, key=theirs.get) if theirs else None
  return {
      'best_capsjax_mode': best_ours,
      'best_torch_mode': best_theirs,
      'best_ratio': (ours[best_ours] / theirs[best_theirs]
                     if best_ours and best_theirs else None),
      'mode_ratios': {o: {t: ours[o] / theirs[t] for t in theirs}
                      for o in ours},
  }


def _compile_jax_mode(config, optimizer, dtype: str, seed: int, mesh, images,
                      labels, data_key) -> tuple[Callable[[], Any], float]:
  """(a train-step call in compute ``dtype`` on its own copy of the state,
  its compile time in seconds)."""
  graphdef, state = state_lib.init_train_state(
      state_lib.create_model(config, seed=seed), optimizer)
  state = jax.device_put(state, sharding.replicated(mesh))
  train = jax.jit(functools.partial(
      make_steps(config, optimizer, dtype).train_step, graphdef),
                  donate_argnums=0)
  compiled, compile_s = _compile(train, state, images, labels, data_key)
  return _train_caller(compiled, state, images, labels, data_key)[0], compile_s


def benchmark_model(config: ml_collections.ConfigDict, *, name: str = '',
                    steps: int = 5, warmup: int = 1, dtype: str = 'float32',
                    compile_only: bool = False, seed: int = 0,
                    num_devices: int = 1, compare: str = '',
                    rounds: int = 3,
                    torch_modes: tuple[str, ...] = TORCH_MODES,
                    compare_dtypes: tuple[str, ...] = ('float32', 'bfloat16'),
                    train_only: bool = False) -> dict[str, Any]:
  """One row: train/eval throughput, compile time and memory of a config,
  the batch split over the first ``num_devices`` local devices
  (``train_only``: the eval step neither compiled nor timed, its fields
  None), and what the compiled train step runs (``compiled_ops``: its
  fusions, layout changes and cuDNN convolutions). With
  ``compare='torch'`` the train step is timed in ``rounds`` rounds
  alternating over capsjax in ``dtype`` and ``compare_dtypes`` and the
  PyTorch reference in ``torch_modes`` (``time_modes``), and the row gets
  each mode's images/s ('modes'), capsjax's best against PyTorch's best and
  each against each (``mode_ratios``); 'torch_train_images_per_s' and
  'train_ratio_vs_torch' stay PyTorch's eager float32 and capsjax in
  ``dtype`` against it, where that mode ran."""
  if not 1 <= num_devices <= jax.local_device_count():
    raise ValueError(
        f'num_devices must be 1 to {jax.local_device_count()} (the local '
        f'device count), got {num_devices}. On a CPU, more devices: '
        f'XLA_FLAGS=--xla_force_host_platform_device_count=N.')
  mesh = sharding.make_mesh(num_devices)
  sharding.check_batch_size(config.batch_size, mesh)
  model = state_lib.create_model(config, seed=seed)
  num_params = models.count_params(model)
  optimizer = state_lib.make_optimizer(config)
  graphdef, state = state_lib.init_train_state(model, optimizer)
  del model
  family_steps = make_steps(config, optimizer, dtype)
  batch = config.batch_size
  shape = image_shape(config)
  rng = np.random.default_rng(seed)
  split = sharding.batch_sharded(mesh)
  state = jax.device_put(state, sharding.replicated(mesh))
  images = sharding.on_mesh(
      rng.integers(0, 256, (batch,) + shape, np.uint8), split)
  labels = sharding.on_mesh(
      rng.integers(0, num_classes(config), batch, np.int32), split)
  mask = sharding.on_mesh(np.ones((batch,), np.float32), split)
  data_key = jax.random.PRNGKey(seed + 2)

  train = jax.jit(functools.partial(family_steps.train_step, graphdef),
                  donate_argnums=0)
  evaluate = jax.jit(functools.partial(family_steps.eval_step, graphdef))
  train_compiled, compile_s = _compile(train, state, images, labels, data_key)
  eval_compiled, eval_compile_s = (None, None) if train_only else _compile(
      evaluate, state.params, state.model_state, images, labels, mask)
  train_memory = memory_analysis(train_compiled)
  eval_memory = memory_analysis(eval_compiled) if eval_compiled else {}
  train_cost = xla_cost(train_compiled)

  row: dict[str, Any] = {
      'model': name or config.model,
      'model_name': config.model,
      'batch_size': batch,
      'image_shape': list(shape),
      'model_options': {k: str(v) for k, v in
                        state_lib.model_options(config).items()},
      'dtype': dtype,
      'conv_backend': conv.backend(),
      'conv_layout': conv_layout(),
      'xla_flags': os.environ.get('XLA_FLAGS', ''),
      'compiled_ops': bf16_audit.compiled_ops(train_compiled.as_text()),
      'num_devices': num_devices,
      'num_params': num_params,
      'compile_s': compile_s,
      'eval_compile_s': eval_compile_s,
      'compiled_train_bytes': train_memory.get('total'),
      'compiled_train_temp_bytes': train_memory.get('temp'),
      'compiled_eval_bytes': eval_memory.get('total'),
      'train_flops_xla': train_cost['flops'],
      'steps': 0 if compile_only else steps,
      'warmup': 0 if compile_only else warmup,
      'train_images_per_s': None,
      'eval_images_per_s': None,
  }
  if not compile_only:
    train_call, holder = _train_caller(train_compiled, state, images, labels,
                                       data_key)
    if compare == 'torch':
      check_modes(torch_modes, compare_dtypes)
      calls = {f'capsjax_{dtype}': train_call}
      compile_seconds = {f'capsjax_{dtype}': compile_s}
      for other in dict.fromkeys(compare_dtypes):
        if other != dtype:
          calls[f'capsjax_{other}'], compile_seconds[f'capsjax_{other}'] = (
              _compile_jax_mode(config, optimizer, other, seed, mesh, images,
                                labels, data_key))
      for mode in dict.fromkeys(torch_modes):
        calls[f'torch_{mode}'] = torch_train_step(config, seed, mode)
      results = time_modes(calls, rounds=rounds, steps=steps, warmup=warmup,
                           batch=batch,
                           guarded=tuple(n for n in calls
                                         if n.startswith('torch_')))
      for name, seconds in compile_seconds.items():
        results[name]['compile_s'] = seconds
      ratios = mode_ratios(results)
      train_s = results[f'capsjax_{dtype}']['step_s']
      row.update(compare='torch', rounds=rounds, **ratios, modes=results,
                 train_step_s_rounds=results[f'capsjax_{dtype}'][
                     'step_s_rounds'])
      eager = results.get('torch_eager_float32', {})
      if eager.get('status') == 'ok':
        row.update(torch_train_step_s_rounds=eager['step_s_rounds'],
                   torch_train_step_s=eager['step_s'],
                   torch_train_images_per_s=eager['images_per_s'],
                   train_ratio_vs_torch=eager['step_s'] / train_s)
    else:
      train_s = _median_seconds(train_call, warmup, steps)
    state = holder['state']
    row.update(train_step_s=train_s, train_images_per_s=batch / train_s)
    if eval_compiled is not None:
      eval_s = _median_seconds(
          lambda: eval_compiled(state.params, state.model_state, images,
                                labels, mask), warmup, steps)
      row.update(eval_step_s=eval_s, eval_images_per_s=batch / eval_s)
    if train_cost['flops']:
      row['train_gflops_per_s_xla'] = train_cost['flops'] / train_s / 1e9
  device_peak = device_peak_bytes()
  if device_peak is not None:
    row['peak_memory_bytes'] = device_peak
    row['peak_memory_source'] = 'device peak_bytes_in_use'
  else:
    row['peak_memory_bytes'] = (train_memory.get('total')
                                or eval_memory.get('total'))
    row['peak_memory_source'] = 'xla compiled memory_analysis (train step)'
  row['peak_rss_bytes'] = peak_rss_bytes()
  return environment() | row  # num_devices: those used


# ----------------------------------------------------------------------------
# Routing alone.


def measure_cpu_peaks(repeats: int = 5) -> tuple[float, float]:
  """(flop/s, bytes/s): best of a float32 2048^3 matmul, a 256 MB copy."""
  n = 2048
  a = jnp.ones((n, n), jnp.float32)
  matmul = jax.jit(lambda x, y: x @ y)
  jax.block_until_ready(matmul(a, a))
  best = min(_median_seconds(lambda: matmul(a, a), 0, 1)
             for _ in range(repeats))
  flop_rate = 2 * n**3 / best
  # In place (donated): a fresh 256 MB output per call would time page faults.
  copy = jax.jit(lambda v: v * 0.5 + 1.0, donate_argnums=0)
  x = [copy(jnp.ones((64 * 2**20,), jnp.float32))]
  nbytes = x[0].nbytes

  def step():
    x[0] = copy(x[0])
    return x[0]

  jax.block_until_ready(step())
  best = min(_median_seconds(step, 0, 1) for _ in range(repeats))
  return flop_rate, 2 * nbytes / best  # read and written once


def routing_peaks(peak_gflops: float = 0.0, bandwidth_gbs: float = 0.0
                  ) -> dict[str, Any]:
  """Peak float32 flop/s and bandwidth for the routing floors, and their source."""
  peak = flops_lib.device_peak(jax.devices()[0].device_kind)
  if peak is not None:
    return {'peak_flops': peak.float32_flops, 'bandwidth': peak.bandwidth,
            'peak_source': 'datasheet (capsjax.flops.DEVICE_PEAKS)'}
  measured_flops = measured_bandwidth = None
  if not peak_gflops or not bandwidth_gbs:
    measured_flops, measured_bandwidth = measure_cpu_peaks()
  flop_rate = peak_gflops * 1e9 if peak_gflops else measured_flops
  bandwidth = bandwidth_gbs * 1e9 if bandwidth_gbs else measured_bandwidth
  source = ('flags' if peak_gflops and bandwidth_gbs else
            'measured: float32 2048^3 matmul, 256 MB elementwise copy')
  return {'peak_flops': flop_rate, 'bandwidth': bandwidth,
          'peak_source': source}


def routing_functions(kind: str, shape: tuple[int, ...], num_iterations: int,
                      dtype) -> tuple[Callable, Callable, tuple, Any]:
  """(forward, forward+backward, args, analytic cost fn) of a routing case."""
  key_v, key_a, key_b = jax.random.split(jax.random.PRNGKey(0), 3)
  num_out, dim = shape[-2], shape[-1]
  activations = jax.random.uniform(key_a, shape[:-2], jnp.float32)
  betas = jnp.zeros((num_out,), jnp.float32)
  if kind == 'em_kernel':
    # Pose patches, not votes: the kernel makes the votes itself.
    num_in = shape[-3]
    poses = jax.random.normal(key_v, (math.prod(shape[:-3]), num_in, 4, 4),
                              jnp.float32).astype(dtype)
    weights = 0.5 * jax.random.normal(key_b, (num_in, num_out, 4, 4),
                                      jnp.float32)
    forward = lambda x, a: em_cpu.route_windows(  # noqa: E731
        x, a, weights, betas, betas, num_iterations)
    loss = lambda x, a: sum(jnp.sum(y) for y in forward(x, a)[:2])  # noqa: E731
    cost = functools.partial(flops_lib.em_conv_kernel_cost, shape,
                             num_iterations)
    return (forward, jax.grad(loss, argnums=(0, 1)),
            (poses, activations.reshape(poses.shape[:2])), cost)
  votes = jax.random.normal(key_v, shape, jnp.float32).astype(dtype)
  if kind in ('su', 'self_attention', 'inverted'):
    return _attention_or_su_functions(kind, shape, num_iterations, votes,
                                      jnp.dtype(dtype).itemsize)
  if kind == 'dynamic':
    bias = 0.1 * jax.random.normal(key_b, (num_out, dim), jnp.float32)
    forward = lambda v, b: routing.dynamic_routing(v, num_iterations, bias=b)
    loss = lambda v, b: jnp.sum(forward(v, b)[0].astype(jnp.float32))
    backward = jax.grad(loss)
    cost = functools.partial(flops_lib.dynamic_routing_cost, shape,
                             num_iterations, bias=True,
                             dtype_bytes=jnp.dtype(dtype).itemsize)
    return forward, backward, (votes, bias), cost
  forward = lambda v, a: routing.em_routing(v, a, betas, betas,
                                            num_iterations)
  loss = lambda v, a: sum(jnp.sum(x.astype(jnp.float32))
                          for x in forward(v, a)[:2])
  backward = jax.grad(loss, argnums=(0, 1))
  cost = functools.partial(flops_lib.em_routing_cost, shape, num_iterations,
                           dtype_bytes=jnp.dtype(dtype).itemsize)
  return forward, backward, (votes, activations), cost


def _attention_or_su_functions(kind: str, shape: tuple[int, ...],
                               num_iterations: int, votes: jax.Array,
                               dtype_bytes: int
                               ) -> tuple[Callable, Callable, tuple, Any]:
  """``routing_functions`` for Su's routing (non-accumulating, squash
  constant 0.5) and the two attention routings; the gradient is the votes'."""
  if kind == 'su':
    forward = lambda v: routing.dynamic_routing(  # noqa: E731
        v, num_iterations, accumulate=False, squash_constant=0.5)
    cost = functools.partial(flops_lib.dynamic_routing_cost, shape,
                             num_iterations, accumulate=False,
                             dtype_bytes=dtype_bytes)
  elif kind == 'self_attention':
    forward = attention_routing.self_attention_routing
    cost = functools.partial(flops_lib.self_attention_routing_cost, shape,
                             dtype_bytes=dtype_bytes)
  else:
    forward = lambda v: attention_routing.inverted_dot_product_routing(  # noqa: E731
        v, num_iterations)
    cost = functools.partial(flops_lib.inverted_dot_product_routing_cost,
                             shape, num_iterations, dtype_bytes=dtype_bytes)
  loss = lambda v: jnp.sum(forward(v)[0].astype(jnp.float32))  # noqa: E731
  return forward, jax.grad(loss), (votes,), cost


def benchmark_routing(case: str, *, batch_size: int, num_iterations: int = 3,
                      dtype: str = 'float32', steps: int = 5, warmup: int = 1,
                      peaks: dict[str, Any]) -> list[dict[str, Any]]:
  """Rows for the forward and the forward+backward pass of ``case``."""
  if case not in ROUTING_CASES:
    raise ValueError(f'unknown routing case {case!r}; known: '
                     f'{", ".join(ROUTING_CASES)}.')
  kind, shape_of = ROUTING_CASES[case]
  shape = shape_of(batch_size)
  forward, backward, args, cost_of = routing_functions(
      kind, shape, num_iterations, jnp.dtype(dtype))
  rows = []
  for pass_name, fn in (('forward', forward), ('forward_backward', backward)):
    compiled, compile_s = _compile(jax.jit(fn), *args)
    measured = _median_seconds(lambda c=compiled: c(*args), warmup, steps)
    cost = cost_of(backward=pass_name == 'forward_backward')
    floor = flops_lib.roofline_seconds(cost, peaks['peak_flops'],
                                       peaks['bandwidth'])
    xla = xla_cost(compiled)
    rows.append({
        'model': f'routing/{case}', 'routing': kind, 'pass': pass_name,
        'shape': list(shape), 'batch_size': batch_size,
        'num_iterations': num_iterations, 'dtype': dtype,
        'flops_analytic': cost.flops,
        'transcendentals_analytic': cost.transcendentals,
        'bytes_analytic': cost.bytes,
        'streaming_bytes_analytic': cost.streaming_bytes,
        'flops_xla': xla['flops'], 'transcendentals_xla': xla['transcendentals'],
        'bytes_xla': xla['bytes'],
        'peak_flops': peaks['peak_flops'], 'bandwidth': peaks['bandwidth'],
        'peak_source': peaks['peak_source'],
        'floor_s': floor, 'measured_s': measured,
        'fraction_of_floor': floor / measured,
        'bound': ('compute' if (cost.flops + cost.transcendentals)
                  / peaks['peak_flops'] >= cost.bytes / peaks['bandwidth']
                  else 'memory'),
        'achieved_gflops_per_s': cost.flops / measured / 1e9,
        'images_per_s': batch_size / measured,
        'compile_s': compile_s,
        'compiled_bytes': memory_analysis(compiled).get('total'),
        'steps': steps, 'warmup': warmup,
        'peak_rss_bytes': peak_rss_bytes(),
    } | environment())
  return rows


# ----------------------------------------------------------------------------
# Reports.


def _fmt(value, spec: str = '.3g') -> str:
  if value is None or (isinstance(value, float) and not math.isfinite(value)):
    return '-'
  return format(value, spec)


def _gib(value) -> str:
  return '-' if value is None else f'{value / 2**30:.2f}'


def _mode_name(mode: str) -> str:
  """'torch_compile_bfloat16' -> 'PyTorch compile bfloat16'."""
  return mode.replace('capsjax_', 'capsjax ').replace(
      'torch_', 'PyTorch ').replace('_', ' ')


def _mode_cell(result: dict[str, Any] | None) -> str:
  if result is None:
    return '-'
  if result['status'] != 'ok':
    return result['status'].split(':')[0] + ' (see JSON)'
  return f"{result['images_per_s']:.1f}"


def compare_table(rows: list[dict[str, Any]]) -> str:
  """Markdown of --compare=torch rows: capsjax's best mode against
  PyTorch's best first, every mode's train images/s, then each capsjax mode
  against each PyTorch mode."""
  capsjax_modes = list(dict.fromkeys(
      m for r in rows for m in r['modes'] if m.startswith('capsjax_')))
  torch_modes = list(dict.fromkeys(
      m for r in rows for m in r['modes'] if m.startswith('torch_')))
  modes = capsjax_modes + torch_modes
  lines = [
      '| model | batch | capsjax best / PyTorch best | capsjax best | '
      'PyTorch best | ' + ' | '.join(f'{_mode_name(m)} img/s' for m in modes)
      + ' |', '|---|---|---|---|---|' + '---|' * len(modes)]
  for r in rows:
    lines.append(
        f"| {r.get('label', r['model'])} | {r['batch_size']} | "
        f"{_fmt(r['best_ratio'], '.2f')} | "
        f"{_mode_name(r['best_capsjax_mode'] or '-')} | "
        f"{_mode_name(r['best_torch_mode'] or '-')} | "
        + ' | '.join(_mode_cell(r['modes'].get(m)) for m in modes) + ' |')
  lines += ['', '| model | batch | capsjax mode | ' + ' | '.join(
      f'/ {_mode_name(m)}' for m in torch_modes) + ' |',
            '|---|---|---|' + '---|' * len(torch_modes)]
  for r in rows:
    for ours, ratios in r['mode_ratios'].items():
      lines.append(
          f"| {r.get('label', r['model'])} | {r['batch_size']} | "
          f"{_mode_name(ours)} | "
          + ' | '.join(_fmt(ratios.get(m), '.2f') for m in torch_modes)
          + ' |')
  return '\n'.join(lines)


VARIANT_AXES = {'dtype': ('float32', 'bfloat16'),
                 'implementation': ('xla', 'pallas'),
                 'conv_layout': ('xla', 'nchw')}


def _variant(row: dict[str, Any]) -> dict[str, Any]:
  """A model row's place in the GPU session's grid."""
  return {'model': row['model'], 'batch_size': row['batch_size'],
          'dtype': row['dtype'], 'conv_layout': row.get('conv_layout', 'xla'),
          'implementation': row.get('model_options', {}).get(
              'implementation', 'None')}


def variant_table(rows: list[dict[str, Any]]) -> str:
  """Markdown of model rows that differ in one ``VARIANT_AXES`` axis: for
  each axis, the rows alike in everything else side by side, with the
  images/s ratio (other / base: above 1, the other is faster) and each
  side's compile time and fusions."""
  done = {}
  for row in rows:
    if row.get('train_images_per_s'):
      done[tuple(sorted(_variant(row).items()))] = row
  lines = []
  for axis, (base, other) in VARIANT_AXES.items():
    pairs = []
    for key, row in done.items():
      variant = dict(key)
      if variant[axis] != base:
        continue
      twin = done.get(tuple(sorted((variant | {axis: other}).items())))
      if twin is not None:
        pairs.append((variant, row, twin))
    if not pairs:
      continue
    rest = [a for a in ('dtype', 'implementation', 'conv_layout') if a != axis]
    lines += ['', f'{other} against {base} ({axis}):', '',
              '| model | batch | ' + ' | '.join(rest) + f' | {base} img/s | '
              f'{other} img/s | {other} / {base} | compile s | fusions |',
              '|---|---|' + '---|' * len(rest) + '---|---|---|---|---|']
    for variant, row, twin in sorted(
        pairs, key=lambda p: (p[0]['model'], p[0]['batch_size'],
                              [str(p[0][a]) for a in rest])):
      lines.append(
          f"| {variant['model']} | {variant['batch_size']} | "
          + ' | '.join(str(variant[a]) for a in rest) + ' | '
          f"{row['train_images_per_s']:.1f} | {twin['train_images_per_s']:.1f}"
          f" | {twin['train_images_per_s'] / row['train_images_per_s']:.2f} | "
          f"{row['compile_s']:.1f} / {twin['compile_s']:.1f} | "
          f"{row.get('compiled_ops', {}).get('fusions', '-')} / "
          f"{twin.get('compiled_ops', {}).get('fusions', '-')} |")
  return '\n'.join(lines[1:])


def markdown_tables(rows: list[dict[str, Any]]) -> str:
  """Markdown tables of model rows and routing rows."""
  lines = []
  model_rows = [r for r in rows if 'routing' not in r]
  routing_rows = [r for r in rows if 'routing' in r]
  if model_rows:
    lines += [
        '| model | batch | devices | dtype | image | params | train img/s '
        '| eval img/s | compile s (train / eval) | peak memory GiB (source) '
        '| peak RSS GiB |',
        '|---|---|---|---|---|---|---|---|---|---|---|']
    for r in model_rows:
      lines.append(
          f"| {r.get('label', r['model'])} | {r['batch_size']} | "
          f"{r.get('num_devices', 1)} | {r['dtype']} | "
          f"{'x'.join(map(str, r['image_shape']))} | {r['num_params']:,} | "
          f"{_fmt(r['train_images_per_s'], '.1f')} | "
          f"{_fmt(r['eval_images_per_s'], '.1f')} | "
          f"{r['compile_s']:.1f} / {_fmt(r['eval_compile_s'], '.1f')} | "
          f"{_gib(r['peak_memory_bytes'])} "
          f"({'device' if r['peak_memory_source'].startswith('device') else 'XLA'})"
          f" | {_gib(r['peak_rss_bytes'])} |")
  compared = [r for r in model_rows if r.get('compare') == 'torch']
  if compared:
    lines += ['', compare_table(compared)]
  if routing_rows:
    if lines:
      lines.append('')
    lines += [
        '| routing | pass | votes shape | dtype | GFLOP analytic / XLA '
        '| MB analytic / XLA | floor ms | measured ms | fraction of floor |',
        '|---|---|---|---|---|---|---|---|---|']
    for r in routing_rows:
      lines.append(
          f"| {r['model'].removeprefix('routing/')} (T={r['num_iterations']}) "
          f"| {r['pass']} | {'x'.join(map(str, r['shape']))} | {r['dtype']} | "
          f"{r['flops_analytic'] / 1e9:.3g} / "
          f"{_fmt(r['flops_xla'] and r['flops_xla'] / 1e9)} | "
          f"{r['bytes_analytic'] / 1e6:.3g} / "
          f"{_fmt(r['bytes_xla'] and r['bytes_xla'] / 1e6)} | "
          f"{r['floor_s'] * 1e3:.3g} ({r['bound']}) | "
          f"{r['measured_s'] * 1e3:.3g} | {r['fraction_of_floor']:.3f} |")
    r = routing_rows[0]
    lines += ['', f"Peaks: {r['peak_flops'] / 1e9:.1f} GFLOP/s float32, "
              f"{r['bandwidth'] / 1e9:.1f} GB/s ({r['peak_source']})."]
  return '\n'.join(lines) + '\n'


def parse_sweep(text: str) -> tuple[str, list[Any]]:
  """'batch_size:8,16' -> ('batch_size', [8, 16]); '' -> ('', [None])."""
  if not text:
    return '', [None]
  key, sep, values = text.partition(':')
  if not sep or not key or not values:
    raise ValueError(f'--sweep must be KEY:V1,V2,..., got {text!r}.')
  return key, [parse_value(v) for v in values.split(',')]


def parse_sweeps(text: str) -> list[dict[str, Any]]:
  """'dtype:float32,bfloat16;batch_size:8,16' -> one {key: value} per
  combination, the last key varying fastest; '' -> [{}]."""
  grid: list[dict[str, Any]] = [{}]
  for part in filter(None, (p.strip() for p in text.split(';'))):
    key, values = parse_sweep(part)
    if key in grid[0]:
      raise ValueError(f'--sweep names {key!r} twice: {text!r}.')
    grid = [point | {key: value} for point in grid for value in values]
  return grid


def parse_options(items: list[str]) -> dict[str, Any]:
  options = {}
  for item in items:
    key, sep, value = item.partition('=')
    if not sep or not key:
      raise ValueError(f'--model_option must be KEY=VALUE, got {item!r}.')
    options[key] = parse_value(value)
  return options


def run(*, model: str, batch_size: int = 0, steps: int = 5, warmup: int = 1,
        dtype: str = 'float32', routing_only: bool = False,
        routing_cases: list[str] | None = None, num_iterations: int = 3,
        sweep: str = '', options: dict[str, Any] | None = None,
        image_size: int = 0, compile_only: bool = False,
        peak_gflops: float = 0.0, bandwidth_gbs: float = 0.0, seed: int = 0,
        num_devices: int = 1, compare: str = '', rounds: int = 3,
        torch_modes: tuple[str, ...] = TORCH_MODES,
        compare_dtypes: tuple[str, ...] = ('float32', 'bfloat16'),
        train_only: bool = False,
        log: Callable[[str], None] = print,
        on_row: Callable[[list[dict[str, Any]]], None] | None = None
        ) -> list[dict[str, Any]]:
  """All rows of one invocation (the flags as keyword arguments; ``model``
  one or several, comma-separated; model rows sweep a grid, ``sweep``
  being ``parse_sweeps``'); ``on_row`` is called with the rows so far
  after each model row (to write them as they come)."""
  rows = []
  if routing_only:
    sweep_key, values = parse_sweep(sweep)
    if sweep_key not in ('', 'batch_size', 'num_iterations'):
      raise ValueError('--routing_only sweeps batch_size or num_iterations, '
                       f'not {sweep_key!r}.')
    peaks = routing_peaks(peak_gflops, bandwidth_gbs)
    log(f"peaks: {peaks['peak_flops'] / 1e9:.1f} GFLOP/s, "
        f"{peaks['bandwidth'] / 1e9:.1f} GB/s ({peaks['peak_source']})")
    for value in values:
      setting = {'batch_size': batch_size or _ROUTING_BATCH_SIZE,
                 'num_iterations': num_iterations}
      if sweep_key:
        setting[sweep_key] = value
      for case in routing_cases or list(ROUTING_CASES):
        new = benchmark_routing(case, dtype=dtype, steps=steps, warmup=warmup,
                                peaks=peaks, **setting)
        for r in new:
          log(f"{r['model']} {r['pass']} {r['shape']}: analytic "
              f"{r['flops_analytic'] / 1e9:.4g} GFLOP {r['bytes_analytic'] / 1e6:.4g}"
              f" MB; XLA {_fmt(r['flops_xla'] and r['flops_xla'] / 1e9, '.4g')} "
              f"GFLOP {_fmt(r['bytes_xla'] and r['bytes_xla'] / 1e6, '.4g')} MB; "
              f"floor {r['floor_s'] * 1e3:.3g} ms, measured "
              f"{r['measured_s'] * 1e3:.3g} ms ({r['fraction_of_floor']:.3f})")
        rows += new
    return rows
  if compare:
    check_modes(torch_modes, compare_dtypes)
  grid = parse_sweeps(sweep)
  for name in [m.strip() for m in model.split(',') if m.strip()]:
    for point in grid:
      rows.append(_model_row(
          name, point, batch_size=batch_size, steps=steps,
          warmup=warmup, dtype=dtype, options=options, image_size=image_size,
          compile_only=compile_only, seed=seed, num_devices=num_devices,
          compare=compare, rounds=rounds, torch_modes=torch_modes,
          compare_dtypes=compare_dtypes, train_only=train_only, log=log))
      if on_row is not None:
        on_row(rows)
  return rows


def _model_row(model: str, point: dict[str, Any], *, batch_size: int,
               steps: int, warmup: int, dtype: str,
               options: dict[str, Any] | None, image_size: int,
               compile_only: bool, seed: int, num_devices: int, compare: str,
               rounds: int, torch_modes: tuple[str, ...],
               compare_dtypes: tuple[str, ...], train_only: bool,
               log: Callable[[str], None]) -> dict[str, Any]:
  """One model row of ``run`` at ``point`` of the sweep's grid, logged:
  batch_size, image_size, num_devices and dtype set as their flags would,
  any other key as a model option."""
  setting = {'batch_size': batch_size, 'image_size': image_size,
             'options': dict(options or {})}
  devices = point.get('num_devices', num_devices)
  dtype = point.get('dtype', dtype)
  for key, value in point.items():
    if key in ('batch_size', 'image_size'):
      setting[key] = value
    elif key not in ('num_devices', 'dtype'):
      setting['options'][key] = value
  config = configure(model, **setting)
  row = benchmark_model(config, name=model, steps=steps, warmup=warmup,
                        dtype=dtype, compile_only=compile_only, seed=seed,
                        num_devices=devices, compare=compare, rounds=rounds,
                        torch_modes=torch_modes,
                        compare_dtypes=compare_dtypes, train_only=train_only)
  row['label'] = ' '.join(
      [model] + [f'{k}={v}' for k, v in (options or {}).items()]
      + [f'{k}={v}' for k, v in point.items()])
  log(f"{row['label']} batch {row['batch_size']} {dtype}: "
      f"train {_fmt(row['train_images_per_s'], '.1f')} img/s, eval "
      f"{_fmt(row['eval_images_per_s'], '.1f')} img/s, compile "
      f"{row['compile_s']:.1f}+{_fmt(row['eval_compile_s'], '.1f')} s, "
      f"{row['compiled_ops']['fusions']} fusions, peak memory "
      f"{_gib(row['peak_memory_bytes'])} GiB ({row['peak_memory_source']}), "
      f"peak RSS {_gib(row['peak_rss_bytes'])} GiB")
  if row.get('compare') == 'torch':
    log(f"  capsjax best ({_mode_name(row['best_capsjax_mode'])}) / PyTorch "
        f"best ({_mode_name(row['best_torch_mode'] or '-')}) = "
        f"{_fmt(row['best_ratio'], '.2f')}")
    for mode, result in row['modes'].items():
      log(f"  {_mode_name(mode)}: "
          + (f"{result['images_per_s']:.1f} img/s"
             if result['status'] == 'ok' else result['status']))
  return row


def write_outputs(rows: list[dict[str, Any]], output: str, markdown: str
                  ) -> str:
  table = markdown_tables(rows)
  if output:
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    metrics_lib.write_json_atomic(output, {
        'command': ' '.join(['python -m experiments.benchmark'] + sys.argv[1:]),
        'rows': rows})
  if markdown:
    with open(markdown, 'w') as f:
      f.write(table)
  return table
