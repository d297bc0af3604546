"""What the two training loops share.

Optimiser and schedule, the train state, data-parallel sharding, the
deterministic data order, atomic checkpoints with exact resume, metrics
(TensorBoard + JSON lines), the progress bar, evaluation and the summary.
``train_dynamic`` and ``train_em`` supply the model family's loss and steps
and call ``fit``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from capsjax import data as data_lib
from capsjax import models


class TrainingDiverged(RuntimeError):
  """The loss or a gradient became NaN or inf; the last good state is kept."""


class TrainState(NamedTuple):
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any  # nnx.State of nnx.Param
  model_state: Any  # nnx.State of everything else (dropout RNG counters)
  opt_state: Any
  # First step whose loss or gradient was non-finite (-1: none). Such a step
  # is not applied, so params stay the last good ones.
  nonfinite_step: jax.Array


# ----------------------------------------------------------------------------
# Optimiser.


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """lr * decay_rate^(step / decay_steps), as tf.train.exponential_decay."""
  return optax.exponential_decay(
      init_value=config.learning_rate,
      transition_steps=config.lr_decay_steps,
      decay_rate=config.lr_decay_rate,
      staircase=False)


def make_optimizer(config: ml_collections.ConfigDict
                   ) -> optax.GradientTransformation:
  return optax.adam(learning_rate_schedule(config))


# ----------------------------------------------------------------------------
# Model and state.


def model_options(config: ml_collections.ConfigDict) -> dict[str, Any]:
  options = config.model_options.to_dict()
  return {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}


def create_model(config: ml_collections.ConfigDict, seed: int | None = None
                 ) -> nnx.Module:
  seed = config.seed if seed is None else seed
  return models.create_model(
      config.model, rngs=nnx.Rngs(params=seed, dropout=seed + 1),
      **model_options(config))


def init_train_state(model: nnx.Module,
                     optimizer: optax.GradientTransformation
                     ) -> tuple[nnx.GraphDef, TrainState]:
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  state = TrainState(
      step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
      opt_state=optimizer.init(params),
      nonfinite_step=jnp.full((), -1, jnp.int32))
  return graphdef, state


def apply_gradients(state: TrainState, grads, model_state,
                    optimizer: optax.GradientTransformation,
                    loss: jax.Array) -> tuple[TrainState, jax.Array]:
  """One optimiser update, skipped (state kept) if loss or gradient is not finite.

  Returns the new state and the global gradient norm.
  """
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree.map(  # noqa: E731
      lambda n, o: jnp.where(finite, n, o), new, old)
  nonfinite_step = jnp.where(
      (state.nonfinite_step < 0) & ~finite, state.step,
      state.nonfinite_step)
  new_state = TrainState(
      step=state.step + 1,
      params=keep(params, state.params),
      model_state=keep(model_state, state.model_state),
      opt_state=keep(opt_state, state.opt_state),
      nonfinite_step=nonfinite_step)
  return new_state, grad_norm


COMPUTE_DTYPES = {'float32': None, 'bfloat16': jnp.bfloat16}


def compute_dtype(config: ml_collections.ConfigDict):
  """``config.compute_dtype`` as a dtype (None: float32, nothing cast)."""
  name = config.get('compute_dtype', 'float32')
  if name not in COMPUTE_DTYPES:
    raise ValueError(f'config.compute_dtype must be one of '
                     f'{sorted(COMPUTE_DTYPES)}, got {name!r}.')
  return COMPUTE_DTYPES[name]


def cast_floating(tree, dtype):
  """``tree`` with its floating leaves cast to ``dtype`` (None: unchanged)."""
  if dtype is None:
    return tree
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
      else x, tree)


def forward(model: nnx.Module, images: jax.Array, dtype, *args, **kwargs
            ) -> dict[str, jax.Array]:
  """``model(images, ...)`` in the compute ``dtype``; outputs as float32."""
  outputs = model(cast_floating(images, dtype), *args, **kwargs)
  return outputs if dtype is None else cast_floating(outputs, jnp.float32)


def gradient_step(graphdef: nnx.GraphDef, state: TrainState,
                  optimizer: optax.GradientTransformation,
                  loss_fn: Callable[[nnx.Module], tuple[jax.Array, dict]],
                  dtype=None) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimiser step on ``loss_fn(model) -> (scalar loss, metrics)``.

  Mixed precision: with ``dtype`` (e.g. bfloat16) the model runs on a copy of
  the float32 master parameters cast to it; the gradients and the update stay
  float32. The model's non-parameter state (dropout RNG counters) advances.
  """

  def loss_of_params(params):
    # copy=True: fresh Variables of this trace, or dropout could not advance
    # its RNG counter here (flax TraceContextError).
    model = nnx.merge(graphdef, cast_floating(params, dtype),
                      state.model_state, copy=True)
    loss, metrics = loss_fn(model)
    _, _, model_state = nnx.split(model, nnx.Param, ...)
    return loss.astype(jnp.float32), (metrics, model_state)

  (loss, (metrics, model_state)), grads = jax.value_and_grad(
      loss_of_params, has_aux=True)(state.params)
  state, grad_norm = apply_gradients(state, grads, model_state, optimizer,
                                     loss)
  return state, metrics | {'loss': loss, 'grad_norm': grad_norm}


def digit_inputs(images: jax.Array, key: jax.Array | None, max_shift: int,
                 center_crop: int = 0) -> jax.Array:
  """uint8 [B, H, W, C] -> float32 in [0, 1], on device.

  With a key (training) each image is shifted by up to ``max_shift`` pixels
  with zero padding, the only augmentation of Sabour et al. ``center_crop``
  > 0 then keeps the central window of that size, in training and
  evaluation alike (MNIST digits are scaled to fit 20x20 and centred on
  the 28x28 frame).
  """
  images = data_lib.to_float(images)
  if key is not None and max_shift:
    images = data_lib.random_shift(key, images, max_shift)
  if center_crop:
    images = data_lib.center_crop(images, center_crop)
  return images


def count_params(params) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


# ----------------------------------------------------------------------------
# Data parallelism: one mesh axis 'data' over the local devices, or over the
# devices of every process of a multi-process (--distributed) run.


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> None:
  """Join a multi-process run: ``jax.distributed.initialize`` with these
  arguments (None: detected from SLURM, Open MPI, Kubernetes or a TPU pod).
  Call it first, before anything touches a device. Every process then runs
  the same program; the mesh of ``fit`` spans the devices of all of them."""
  # CPU processes reduce across each other with gloo; GPUs ignore the option.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes,
                             process_id=process_id)


def is_chief() -> bool:
  """Whether this process writes the run's files (process 0)."""
  return jax.process_index() == 0


def _all_agree(flag: bool) -> bool:
  """Process 0's ``flag`` on every process (clocks differ; loops must not)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils
  return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def make_mesh(num_devices: int | None = None) -> Mesh:
  """One 'data' axis over the first ``num_devices`` local devices (all when
  None), or over every device of every process in a multi-process run."""
  devices = (jax.devices() if jax.process_count() > 1 else
             jax.local_devices()[:num_devices])
  return Mesh(np.asarray(devices), ('data',))


def on_mesh(array, sharding: NamedSharding) -> jax.Array:
  """A host array (the same on every process) placed with ``sharding``."""
  return jax.device_put(np.asarray(array), sharding)


@functools.partial(jax.jit, static_argnums=2)
def _take(array: jax.Array, indices: jax.Array, sharding: NamedSharding
          ) -> jax.Array:
  return jax.lax.with_sharding_constraint(array[indices], sharding)


def take_batch(array: jax.Array, indices: np.ndarray, mesh: Mesh
               ) -> jax.Array:
  """``array[indices]`` split over the mesh's data axis.

  Args:
    array: [N, ...] replicated on the mesh.
    indices: [B] host ints, the same on every process.
  Returns:
    [B, ...] sharded along B.
  """
  return _take(array, on_mesh(indices, replicated(mesh)), batch_sharded(mesh))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec('data'))


def check_batch_size(batch_size: int, mesh: Mesh) -> None:
  if batch_size % mesh.size:
    raise ValueError(
        f'batch_size {batch_size} is not divisible by the {mesh.size} devices '
        f'of the data-parallel mesh; use a multiple of {mesh.size}.')


# ----------------------------------------------------------------------------
# Deterministic data order: the batch of a step depends only on (seed, step),
# so a resumed run sees exactly the batches an uninterrupted run would.


def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


class BatchOrder:
  """Indices of the training batch of each step (drops the epoch remainder)."""

  def __init__(self, num_examples: int, batch_size: int, seed: int):
    if num_examples < batch_size:
      raise ValueError(
          f'the training split has {num_examples} examples, fewer than '
          f'batch_size {batch_size}.')
    self.batch_size = batch_size
    self.seed = seed
    self.num_examples = num_examples
    self.steps_per_epoch = num_examples // batch_size
    self._epoch, self._perm = -1, None

  def indices(self, step: int) -> np.ndarray:
    epoch, offset = divmod(step, self.steps_per_epoch)
    if epoch != self._epoch:
      self._epoch = epoch
      self._perm = epoch_permutation(self.seed, epoch, self.num_examples)
    start = offset * self.batch_size
    return self._perm[start:start + self.batch_size]


# ----------------------------------------------------------------------------
# Checkpoints. Orbax writes each step into a temporary directory and renames
# it when complete, so a kill mid-save leaves the previous step restorable.


def _saveable(tree):
  """Typed PRNG keys -> raw key data (what orbax can write)."""
  return jax.tree.map(
      lambda x: jax.random.key_data(x)
      if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree)


def _from_saveable(tree, template):
  return jax.tree.map(
      lambda x, t: jax.random.wrap_key_data(x, impl=jax.random.key_impl(t))
      if jnp.issubdtype(t.dtype, jax.dtypes.prng_key) else x, tree, template)


# Tensorstore, which writes the arrays, reports a full or read-only disk as a
# ValueError ("RESOURCE_EXHAUSTED: ... No space left on device
# [os_error_code='28']"), not an OSError.
_STORAGE_ERROR_MARKERS = ('os_error_code', 'RESOURCE_EXHAUSTED',
                          'PERMISSION_DENIED', 'No space left',
                          'Read-only file system', 'Permission denied')


def _is_storage_error(error: BaseException) -> bool:
  return isinstance(error, OSError) or any(
      marker in str(error) for marker in _STORAGE_ERROR_MARKERS)


class _SaveNoiseFilter(logging.Filter):
  """Drops the tracebacks of a failed save's aborted writes: orbax's worker
  thread logs one, and asyncio one per write task it never awaited."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR:
      return True
    if f'{os.sep}orbax{os.sep}' in record.pathname:
      return False
    message = record.getMessage()
    return not ('exception was never retrieved' in message and
                'orbax' in message)


def _drop_closed_loop_errors(unraisablehook):
  """``unraisablehook`` less the 'Event loop is closed' tracebacks that the
  tensorstore callbacks of a failed save print, during or after it."""

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError) and
            'Event loop is closed' in str(unraisable.exc_value)):
      unraisablehook(unraisable)

  return hook


@contextlib.contextmanager
def _quiet_failed_save():
  """A failed save is reported once, by ``Checkpointer.save``'s own error
  (which chains orbax's), not also as a screenful of stack traces. Those
  arrive during the save and after it (when the aborted tasks are collected),
  so after a failure the filters stay; after a success they are removed."""
  loggers = [logging.getLogger('absl'), logging.getLogger('asyncio')]
  noise, previous_hook = _SaveNoiseFilter(), sys.unraisablehook
  for logger in loggers:
    logger.addFilter(noise)
  sys.unraisablehook = _drop_closed_loop_errors(previous_hook)
  try:
    yield
  except BaseException:
    # The aborted write coroutines are collected later, as late as
    # interpreter shutdown, each warning that it was never awaited.
    warnings.filterwarnings('ignore', message=r"coroutine '.*' was never "
                            r'awaited', category=RuntimeWarning)
    raise  # leaving the filters in place
  for logger in loggers:
    logger.removeFilter(noise)
  sys.unraisablehook = previous_hook


class Checkpointer:
  """Orbax checkpoints of a TrainState under ``directory``."""

  def __init__(self, directory: str, max_to_keep: int = 2):
    self.directory = os.path.abspath(directory)
    try:
      os.makedirs(self.directory, exist_ok=True)
      probe = os.path.join(self.directory,
                           f'.write_test.{jax.process_index()}')
      with open(probe, 'w') as f:
        f.write('ok')
      os.remove(probe)
    except OSError as e:
      raise OSError(
          f'cannot write checkpoints to {self.directory}: {e}. Choose a '
          f'writable --workdir with free space.') from e
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True,
            enable_async_checkpointing=False))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, state: TrainState) -> None:
    step = int(state.step)
    if step in self._manager.all_steps():
      return
    leaves = _saveable(jax.tree.leaves(state))
    try:
      with _quiet_failed_save():
        self._manager.save(step, args=ocp.args.StandardSave(leaves))
        self._manager.wait_until_finished()
    except (OSError, ValueError) as e:
      if not _is_storage_error(e):
        raise
      raise OSError(
          f'saving the checkpoint of step {step} to {self.directory} failed '
          f'({e}); the previous checkpoint is intact. Free disk space or '
          f'choose another --workdir, then rerun to resume.') from e

  def restore(self, template: TrainState, step: int | None = None
              ) -> TrainState:
    step = self.latest_step() if step is None else step
    leaves, treedef = jax.tree.flatten(template)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                for x in _saveable(leaves)]
    restored = self._manager.restore(step,
                                     args=ocp.args.StandardRestore(abstract))
    return jax.tree.unflatten(treedef, _from_saveable(list(restored), leaves))

  def close(self) -> None:
    self._manager.close()


# ----------------------------------------------------------------------------
# Metrics and progress.


class MetricWriter:
  """Scalars to TensorBoard (``workdir/tensorboard``) and ``metrics.jsonl``;
  nothing on the other processes of a multi-process run."""

  def __init__(self, workdir: str):
    self._enabled = is_chief()
    if not self._enabled:
      return
    from tensorboardX import SummaryWriter  # a heavy import: only when training
    self._tb = SummaryWriter(os.path.join(workdir, 'tensorboard'))
    self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a')
    self._workdir = workdir

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    if not self._enabled:
      return
    for name, value in scalars.items():
      self._tb.add_scalar(name, value, step)
    try:
      self._jsonl.write(json.dumps({'step': step, **scalars}) + '\n')
      self._jsonl.flush()
    except OSError as e:
      raise OSError(
          f'writing the metrics of step {step} to {self._workdir} failed '
          f'({e}). Free disk space or choose another --workdir, then rerun to '
          f'resume from the last checkpoint.') from e
    self._tb.flush()

  def close(self) -> None:
    if self._enabled:
      self._tb.close()
      self._jsonl.close()


class Progress:
  """A tqdm bar with loss, accuracy and images/s (quiet when not a terminal)."""

  def __init__(self, total: int, initial: int, batch_size: int):
    from tqdm import tqdm
    interactive = sys.stderr.isatty()
    self._bar = tqdm(total=total, initial=initial, unit='step',
                     dynamic_ncols=True, mininterval=0.5 if interactive else 30,
                     disable=(os.environ.get('CAPSJAX_NO_PROGRESS') == '1' or
                              not is_chief()))
    self._batch_size = batch_size
    self._last_time, self._last_step = time.perf_counter(), initial

  def update(self, step: int, scalars: Mapping[str, float]) -> float:
    now = time.perf_counter()
    images_per_s = ((step - self._last_step) * self._batch_size /
                    max(now - self._last_time, 1e-9))
    self._last_time, self._last_step = now, step
    self._bar.set_postfix({k: f'{v:.4g}' for k, v in scalars.items()}
                          | {'img/s': f'{images_per_s:.0f}'}, refresh=False)
    self._bar.update(step - self._bar.n)
    return images_per_s

  def close(self) -> None:
    self._bar.close()


# ----------------------------------------------------------------------------
# Evaluation.


def evaluate(eval_step: Callable, state: TrainState,
             split: data_lib.Split, images_on_device: jax.Array,
             batch_size: int, mesh: Mesh) -> dict[str, float]:
  """Accuracy and mean loss over a whole split, padding the last batch.

  ``eval_step(params, model_state, images, labels, mask)`` returns
  sums {'correct', 'loss', 'count'} over the masked examples.
  ``images_on_device``: the split's images, replicated on ``mesh``.
  """
  num = len(split.labels)
  if num == 0:
    return {}
  # No bigger than the split needs (rounded up to the device count).
  batch_size = min(batch_size, -(-num // mesh.size) * mesh.size)
  batch_size = max(mesh.size, batch_size - batch_size % mesh.size)
  totals: dict[str, float] = {}
  for start in range(0, num, batch_size):
    idx = np.arange(start, start + batch_size)
    mask = idx < num
    idx = np.minimum(idx, num - 1)
    sums = eval_step(state.params, state.model_state,
                     take_batch(images_on_device, idx, mesh),
                     on_mesh(split.labels[idx], batch_sharded(mesh)),
                     on_mesh(mask, batch_sharded(mesh)))
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + float(v)
  count = totals.pop('count')
  return {'accuracy': totals['correct'] / count,
          'error': 1.0 - totals['correct'] / count,
          'loss': totals['loss'] / count}


# ----------------------------------------------------------------------------
# The loop.


def environment() -> dict[str, Any]:
  try:
    commit = subprocess.run(
        ['git', 'rev-parse', 'HEAD'], capture_output=True, text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10,
        check=False).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    commit = None
  device = jax.devices()[0]
  return {
      'device': f'{device.platform}:{getattr(device, "device_kind", "")}',
      'num_devices': jax.device_count(),
      'jax_version': jax.__version__,
      'python': platform.python_version(),
      'machine': platform.machine(),
      'cpu_count': os.cpu_count(),
      'git_commit': commit,
  }


class FamilySteps(NamedTuple):
  """What a model family gives ``fit``.

  train_step(graphdef, state, images_uint8, labels, key) -> (state, metrics)
    with metrics a dict of scalars incl. 'loss' and 'accuracy'; fit jits it
    with the graphdef bound and the state donated.
  eval_step(graphdef, params, model_state, images_uint8, labels, mask)
    -> {'correct', 'loss', 'count'} sums.
  draws_batches: when True, train_step receives the WHOLE training split
    (images, labels) and draws its batch from the key itself (MultiMNIST
    pairs generated on device); the batch still depends only on (seed, step).
  """
  train_step: Callable
  eval_step: Callable
  draws_batches: bool = False


def _save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  path = os.path.join(workdir, 'config.json')
  text = config.to_json_best_effort(indent=2, sort_keys=True)
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.write(text)
  os.replace(tmp, path)


def write_json_atomic(path: str, payload: Mapping[str, Any]) -> None:
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(payload, f, indent=2, sort_keys=True, default=str)
  os.replace(tmp, path)


_POSITIVE_INT_KEYS = ('batch_size', 'eval_batch_size', 'num_train_steps',
                      'log_every_steps', 'eval_every_steps',
                      'checkpoint_every_steps', 'lr_decay_steps')


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first key of ``config`` that ``fit``
  cannot use (model options are checked by ``models.create_model``)."""

  def fail(key, requirement):
    raise ValueError(f'config.{key} must be {requirement}, got '
                     f'{config[key]!r}.')

  def is_int(value):
    return isinstance(value, int | np.integer) and not isinstance(value, bool)

  for key in _POSITIVE_INT_KEYS:
    if not is_int(config[key]) or config[key] < 1:
      fail(key, 'a positive int')
  for key in ('learning_rate', 'lr_decay_rate'):
    if isinstance(config[key], bool) or not (
        isinstance(config[key], int | float) and
        np.isfinite(config[key]) and config[key] > 0):
      fail(key, 'a finite number > 0')
  for key in ('seed', 'max_shift'):
    if key in config and (not is_int(config[key]) or config[key] < 0):
      fail(key, 'an int >= 0')
  if config.get('max_train_seconds') and not config.max_train_seconds > 0:
    fail('max_train_seconds', '> 0 (or 0: no limit)')
  if config.get('target_accuracy') and not 0 < config.target_accuracy <= 1:
    fail('target_accuracy', 'in (0, 1] (or 0: train all steps)')
  if config.get('center_crop'):
    crop = config.center_crop
    shape = tuple(config.model_options.get('input_shape') or ())
    if not is_int(crop) or crop < 0 or shape[:2] != (crop, crop):
      fail('center_crop', f'0 (no crop) or an int equal to the height and '
           f'width of config.model_options.input_shape ({shape})')
  if 'canvas_size' in config and (not is_int(config.canvas_size) or
                                  config.canvas_size < 0):
    fail('canvas_size', 'an int >= 0 (0: no canvas)')
  num_devices = config.get('num_devices') or 0
  if num_devices and jax.process_count() > 1:
    fail('num_devices', '0 in a multi-process run (the mesh spans every '
         'device of every process)')
  if not is_int(num_devices) or not 0 <= num_devices <= jax.local_device_count():
    fail('num_devices', f'an int from 0 (all devices) to '
         f'{jax.local_device_count()} (the local device count)')
  if 'debug_poison_step' in config and not is_int(config.debug_poison_step):
    fail('debug_poison_step', 'an int (-1: off)')


def _raise_if_diverged(state: TrainState, checkpoints: Checkpointer) -> None:
  bad_step = int(state.nonfinite_step)
  if bad_step >= 0:
    raise TrainingDiverged(
        f'the loss or a gradient became non-finite at step {bad_step}; that '
        f'update was not applied and the last good checkpoint (step '
        f'{checkpoints.latest_step()}) is kept in {checkpoints.directory}. '
        f'Lower the learning rate or check the input data.')


def fit(config: ml_collections.ConfigDict, workdir: str,
        steps: FamilySteps, dataset: data_lib.Dataset,
        extra_tests: Mapping[str, data_lib.Split] | None = None
        ) -> dict[str, Any]:
  """Train, checkpoint, resume, select on validation, test once, summarise.

  With ``config.target_accuracy`` > 0 training stops at the first
  evaluation whose validation accuracy reaches it (a rerun of a run that
  reached it does not train further). ``extra_tests`` (name -> Split) are
  evaluated with the test set, on the selected model, into
  ``summary['extra_tests']``.

  Returns the summary also written to ``workdir/summary.json``.
  """
  check_config(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  # In a multi-process run every process runs this; process 0 alone writes
  # the run's files (orbax coordinates the checkpoints itself).
  chief = is_chief()
  say = print if chief else lambda *args, **kwargs: None
  if chief:
    _save_config(config, workdir)
  mesh = make_mesh(config.get('num_devices') or None)
  check_batch_size(config.batch_size, mesh)
  model = create_model(config)
  optimizer = make_optimizer(config)
  graphdef, state = init_train_state(model, optimizer)
  num_params = count_params(state.params)
  state = jax.device_put(state, replicated(mesh))

  checkpoints = Checkpointer(os.path.join(workdir, 'checkpoints'))
  best = Checkpointer(os.path.join(workdir, 'best'), max_to_keep=1)
  start_step = 0
  if checkpoints.latest_step() is not None:
    state = checkpoints.restore(state)
    start_step = int(state.step)
    say(f'Resuming from the checkpoint of step {start_step} in {workdir}.',
        flush=True)
  best_record_path = os.path.join(workdir, 'best_validation.json')
  best_record = (json.load(open(best_record_path))
                 if os.path.exists(best_record_path) else None)
  target = config.get('target_accuracy') or 0.0
  reached = lambda record: bool(  # noqa: E731
      target and record and record['accuracy'] >= target)

  train_images = on_mesh(dataset.train.images, replicated(mesh))
  train_labels = on_mesh(dataset.train.labels, replicated(mesh))
  order = BatchOrder(len(dataset.train.labels), config.batch_size, config.seed)
  total_steps = config.num_train_steps
  data_key = jax.random.PRNGKey(config.seed + 2)
  poison_step = config.get('debug_poison_step', -1)

  # The graphdef is closed over rather than passed as a static argument: it
  # need not be hashable.
  train_step = jax.jit(functools.partial(steps.train_step, graphdef),
                       donate_argnums=0)
  eval_step = jax.jit(functools.partial(steps.eval_step, graphdef))
  run_eval = lambda split, images=None: evaluate(  # noqa: E731
      eval_step, state, split,
      on_mesh(split.images, replicated(mesh)) if images is None else images,
      config.eval_batch_size, mesh)
  # Placed once: the validation split is evaluated many times.
  validation_images = on_mesh(dataset.validation.images, replicated(mesh))

  say(f'{config.model}: {num_params:,} parameters; {dataset.name}: '
        f'{len(dataset.train.labels)} train / {len(dataset.validation.labels)} '
        f'validation / {len(dataset.test.labels)} test; {total_steps} steps '
        f'of batch {config.batch_size} on {mesh.size} '
        f'{jax.devices()[0].platform} device(s).', flush=True)
  writer = MetricWriter(workdir)
  progress = Progress(total_steps, start_step, config.batch_size)
  train_seconds, measured_steps, compile_s = 0.0, 0, None
  # Seconds of training steps only: compilation, evaluation and checkpoints
  # are not counted (the windows below exclude them).
  time_limit = config.get('max_train_seconds') or None
  step = start_step
  try:
    window_start = time.perf_counter()
    window_steps = 0
    while step < total_steps and not reached(best_record):
      if steps.draws_batches:
        images, labels = train_images, train_labels
      else:
        idx = order.indices(step)
        images = take_batch(train_images, idx, mesh)
        labels = take_batch(train_labels, idx, mesh)
      if step == poison_step:  # a test hook: a batch of NaN images
        images = on_mesh(np.full(images.shape, np.nan, np.float32),
                         images.sharding)
      key = on_mesh(jax.random.fold_in(data_key, step), replicated(mesh))
      t0 = time.perf_counter()
      state, metrics = train_step(state, images, labels, key)
      step += 1
      window_steps += 1
      if compile_s is None:
        jax.block_until_ready(metrics)
        compile_s = time.perf_counter() - t0
        window_start, window_steps = time.perf_counter(), 0
      last = step == total_steps or (time_limit is not None and _all_agree(
          train_seconds + time.perf_counter() - window_start > time_limit))
      if last or not (step % config.log_every_steps and
                      step % config.eval_every_steps and
                      step % config.checkpoint_every_steps):
        # Before anything is logged, evaluated or saved, so that no
        # checkpoint holds a state that went past a non-finite step.
        _raise_if_diverged(state, checkpoints)
      if step % config.log_every_steps == 0 or last:
        metrics = jax.device_get(metrics)
        elapsed = time.perf_counter() - window_start
        if window_steps:
          train_seconds += elapsed
          measured_steps += window_steps
        scalars = {f'train/{k}': float(v) for k, v in metrics.items()}
        scalars['train/learning_rate'] = float(
            learning_rate_schedule(config)(step))
        if window_steps and elapsed > 0:
          scalars['train/images_per_s'] = (window_steps * config.batch_size /
                                           elapsed)
        writer.write(step, scalars)
        progress.update(step, {'loss': scalars['train/loss'],
                               'acc': scalars['train/accuracy']})
        window_start, window_steps = time.perf_counter(), 0
      if step % config.eval_every_steps == 0 or last:
        val = run_eval(dataset.validation, validation_images)
        if val:
          writer.write(step, {f'validation/{k}': v for k, v in val.items()})
          if best_record is None or val['accuracy'] > best_record['accuracy']:
            best_record = {'step': step, **val}
            best.save(state)
            if chief:
              write_json_atomic(best_record_path, best_record)
          if reached(val):
            last = True
            say(f'Validation accuracy {val["accuracy"]:.4f} reached the '
                  f'target {target} at step {step}; stopping.', flush=True)
        window_start = time.perf_counter()
      if step % config.checkpoint_every_steps == 0 or last:
        checkpoints.save(state)
        window_start = time.perf_counter()
      if last:
        break
  finally:
    progress.close()
    writer.close()

  # Model selection on validation only; the test set is read once, here.
  if best_record is not None and best.latest_step() is not None:
    state = best.restore(state)
  test = run_eval(dataset.test)
  extra = {name: run_eval(split)
           for name, split in (extra_tests or {}).items()}
  checkpoints.close()
  best.close()
  images_per_s = (measured_steps * config.batch_size / train_seconds
                  if train_seconds > 0 else None)
  summary = {
      'model': config.model,
      'dataset': dataset.name,
      'num_params': num_params,
      'steps': step,
      'epochs': step / order.steps_per_epoch,
      'selected_step': int(state.step),
      'validation': best_record,
      'test': test,
      **({'extra_tests': extra} if extra_tests is not None else {}),
      **({'target_accuracy': target, 'reached_target': reached(best_record)}
         if target else {}),
      'train_images_per_s': images_per_s,
      'compile_s': compile_s,
      'train_wall_s_this_run': train_seconds,
      'batch_size': config.batch_size,
      **environment(),
      'num_devices': mesh.size,  # those trained on, not all there are
  }
  if chief:
    write_json_atomic(os.path.join(workdir, 'summary.json'), summary)
  say(json.dumps({'test_accuracy': test.get('accuracy'),
                    'validation_accuracy': (best_record or {}).get('accuracy'),
                    'steps': step, 'images_per_s': images_per_s}), flush=True)
  return summary


def read_workdir_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a training run saved in ``workdir/config.json``."""
  config_path = os.path.join(workdir, 'config.json')
  if not os.path.exists(config_path):
    raise FileNotFoundError(
        f'{config_path} not found: {workdir} is not a capsjax workdir.')
  with open(config_path) as f:
    return ml_collections.ConfigDict(json.load(f))


def load_trained_model(workdir: str, which: str = 'best') -> nnx.Module:
  """Rebuild a trained model from ``workdir`` (its config.json and checkpoint).

  ``which``: 'best' (selected on validation) or 'latest'.
  """
  config = read_workdir_config(workdir)
  try:
    model = create_model(config)
  except (AttributeError, KeyError) as e:
    key = str(e).strip('"\'')
    raise ValueError(f'{os.path.join(workdir, "config.json")} lacks the key '
                     f'{key!r}: not a complete capsjax config.') from e
  graphdef, state = init_train_state(model, make_optimizer(config))
  directory = os.path.join(workdir, 'best' if which == 'best' else
                           'checkpoints')
  checkpointer = Checkpointer(directory)
  if checkpointer.latest_step() is None:
    raise FileNotFoundError(f'no checkpoint in {directory}; train first.')
  state = checkpointer.restore(state)
  checkpointer.close()
  return nnx.merge(graphdef, state.params, state.model_state)
