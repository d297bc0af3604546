"""The training loop both families share: ``fit``.

Train with checkpoints and exact resume, select on validation, test once,
run the config's evaluators on the selected model, and write the summary.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from capsjax import data as data_lib
from capsjax import evaluators
from capsjax import models
from capsjax.kernels import conv
from capsjax.kernels import implementations
from capsjax.training import metrics as metrics_lib
from capsjax.training.checkpoints import CheckpointDamaged
from capsjax.training.checkpoints import Checkpointer
from capsjax.training.checkpoints import hold_workdir
from capsjax.training.checkpoints import stop_signals
from capsjax.training.defaults import fill_defaults
from capsjax.training.defaults import with_defaults
from capsjax.training.evaluation import evaluate
from capsjax.training.sharding import BatchOrder
from capsjax.training.sharding import all_agree
from capsjax.training.sharding import check_batch_size
from capsjax.training.sharding import is_chief
from capsjax.training.sharding import make_mesh
from capsjax.training.sharding import on_mesh
from capsjax.training.sharding import replicated
from capsjax.training.sharding import take_batch
from capsjax.training.state import ADAM_FORMS
from capsjax.training.state import EARLIER_IMPLEMENTATION_KEYS
from capsjax.training.state import FamilySteps
from capsjax.training.state import check_model
from capsjax.training.state import count_params
from capsjax.training.state import create_model
from capsjax.training.state import init_train_state
from capsjax.training.state import learning_rate_schedule
from capsjax.training.state import make_optimizer


class TrainingDiverged(RuntimeError):
  """The loss or a gradient became NaN or inf; the last good state is kept."""


class TrainingStopped(KeyboardInterrupt):
  """SIGINT or SIGTERM stopped training; the state of ``step`` was saved."""

  def __init__(self, signum: int, step: int, workdir: str):
    super().__init__(f'stopped at step {step}, checkpoint saved in {workdir}; '
                     f'rerun the same command to resume')
    self.signum, self.step = signum, step

  @property
  def exit_code(self) -> int:
    return 128 + self.signum  # the shell's code for death by that signal


class _StopSignals:
  """SIGINT, SIGTERM (a scheduler's warning before preemption) and SIGHUP
  (``checkpoints.stop_signals``) become a request that the loop sees between
  steps; a second one stops at once. Only the main thread can install
  handlers; elsewhere this does nothing."""

  def __init__(self):
    self.signum: int | None = None
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    del frame
    if self.signum is not None:
      raise KeyboardInterrupt
    self.signum = signum

  def __enter__(self) -> _StopSignals:
    if threading.current_thread() is threading.main_thread():
      for signum in stop_signals():
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)


def _make_writable_dir(workdir: str) -> None:
  """Creates ``workdir``; OSError naming it and the fix when it cannot be
  created or written to."""
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f'.write_test.{os.getpid()}')
    with open(probe, 'w'):
      pass
    os.remove(probe)
  except OSError as e:
    raise OSError(f'cannot write to the workdir {workdir} ({e.strerror or e}); '
                  f'choose a --workdir you can write to.') from e


def _hours(seconds: float) -> str:
  if seconds >= 5400:
    return f'{seconds / 3600:.0f} h'
  return f'{max(seconds / 60, 1):.0f} min'


_POSITIVE_INT_KEYS = ('batch_size', 'eval_batch_size', 'num_train_steps',
                      'log_every_steps', 'eval_every_steps',
                      'checkpoint_every_steps', 'lr_decay_steps')


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first key of ``config`` that ``fit``
  cannot use (model options are checked by ``models.create_model``,
  ``config.evals`` by ``evaluators.check``). First adds the keys it lacks
  (``defaults.fill_defaults``) and sets ``config.model`` to the name a
  workdir records (``models.portable_name``: a model registered from
  outside capsjax becomes its 'module:Class' path): the way into ``fit``."""
  fill_defaults(config)
  config.model = models.portable_name(config.model)

  def fail(key, requirement):
    raise ValueError(f'config.{key} must be {requirement}, got '
                     f'{config[key]!r}.')

  def is_int(value):
    return isinstance(value, int | np.integer) and not isinstance(value, bool)

  for key in _POSITIVE_INT_KEYS:
    if not is_int(config[key]) or config[key] < 1:
      fail(key, 'a positive int')
  for key in ('learning_rate', 'lr_decay_rate', 'adam_epsilon'):
    if key not in config:
      continue
    if isinstance(config[key], bool) or not (
        isinstance(config[key], int | float) and
        np.isfinite(config[key]) and config[key] > 0):
      fail(key, 'a finite number > 0')
  if config.adam_form not in ADAM_FORMS:
    fail('adam_form', f'one of {ADAM_FORMS}')
  for key in ('seed', 'max_shift'):
    if key in config and (not is_int(config[key]) or config[key] < 0):
      fail(key, 'an int >= 0')
  for key in ('max_train_seconds', 'checkpoint_every_seconds'):
    if config[key] and not config[key] > 0:
      fail(key, '> 0 (or 0: no limit)')
  if config.center_crop:
    crop = config.center_crop
    shape = tuple(config.model_options.get('input_shape') or ())
    if not is_int(crop) or crop < 0 or shape[:2] != (crop, crop):
      fail('center_crop', f'0 (no crop) or an int equal to the height and '
           f'width of config.model_options.input_shape ({shape})')
  if 'canvas_size' in config and (not is_int(config.canvas_size) or
                                  config.canvas_size < 0):
    fail('canvas_size', 'an int >= 0 (0: no canvas)')
  num_devices = config.num_devices or 0
  if num_devices and jax.process_count() > 1:
    fail('num_devices', '0 in a multi-process run (the mesh spans every '
         'device of every process)')
  if not is_int(num_devices) or not 0 <= num_devices <= jax.local_device_count():
    fail('num_devices', f'an int from 0 (all devices) to '
         f'{jax.local_device_count()} (the local device count)')


class _TrainClock:
  """Seconds of training steps only: ``stop`` before compilation,
  evaluation and checkpoints, ``start`` after them."""

  def __init__(self):
    self.seconds, self.steps = 0.0, 0  # totals over closed windows
    self._window_seconds, self._window_steps, self._since = 0.0, 0, None

  def start(self) -> None:
    self._since = time.perf_counter()

  def stop(self) -> None:
    if self._since is not None:
      self._window_seconds += time.perf_counter() - self._since
      self._since = None

  def count_step(self) -> None:
    self._window_steps += 1

  def elapsed(self) -> float:
    running = 0.0 if self._since is None else time.perf_counter() - self._since
    return self.seconds + self._window_seconds + running

  def close_window(self) -> tuple[int, float]:
    """Steps and seconds since the last call, added to the totals."""
    self.stop()
    window = self._window_steps, self._window_seconds
    if self._window_steps:
      self.seconds += self._window_seconds
      self.steps += self._window_steps
    self._window_seconds, self._window_steps = 0.0, 0
    return window


# Keys whose change leaves a workdir's checkpoint usable and its run the same
# (how long, how often, what is evaluated after); a change of the model, its
# options or the dataset makes the checkpoint unusable; any other change
# (batch size, learning rate, ...) is allowed with a warning. Workdirs of
# older capsjax store 'target_accuracy' and 'debug_poison_step', options
# that left the config: their absence now changes nothing.
_SAFE_CHANGES = ('num_train_steps', 'log_every_steps', 'eval_every_steps',
                 'checkpoint_every_steps', 'checkpoint_every_seconds',
                 'max_train_seconds', 'target_accuracy', 'eval_batch_size',
                 'data_dir', 'num_devices', 'evals', 'shorter_run',
                 'select_on_validation', 'debug_poison_step', 'models', 'runs',
                 'figure_pairs')
_UNUSABLE_CHANGES = ('model', 'model_options', 'dataset')
# Model options that choose how the same parameters are computed, not
# what they are: a run may resume with another (e.g. the Pallas routing
# kernels on a GPU after a CPU start).
_IMPLEMENTATION_OPTIONS = tuple(f'model_options.{name}' for name in (
    'implementation', 'remat', 'remat_iterations', 'window_chunk',
    *EARLIER_IMPLEMENTATION_KEYS))


def config_changes(config: ml_collections.ConfigDict, workdir: str
                   ) -> tuple[str, str]:
  """How ``config`` differs from the one stored in ``workdir`` with a
  checkpoint: (accepted changes, changes to warn about), each '' or
  'key old -> new; ...'. Raises ValueError, before anything is written,
  when the checkpoint could not be loaded with ``config``."""
  path = os.path.join(workdir, 'config.json')
  if not (os.path.exists(path) and Checkpointer.exists(
      os.path.join(workdir, 'checkpoints'))):
    return '', ''
  with open(path) as f:
    # Both with their defaults: a key an old run left out is not a change.
    stored = metrics_lib.flat_config(with_defaults(json.load(f)))
  new = metrics_lib.flat_config(
      with_defaults(json.loads(config.to_json_best_effort())))
  changed = sorted(k for k in stored.keys() | new.keys()
                   if stored.get(k) != new.get(k))
  top = lambda key: key.split('.')[0]  # noqa: E731
  describe = lambda keys: '; '.join(  # noqa: E731
      f'{k} {stored.get(k, "(absent)")!r} -> {new.get(k, "(absent)")!r}'
      for k in keys)
  unusable = [k for k in changed if top(k) in _UNUSABLE_CHANGES
              and k not in _IMPLEMENTATION_OPTIONS]
  if unusable:
    raise ValueError(
        f'{workdir} holds a checkpoint of another model: '
        f'{describe(unusable)} (its config.json against this command). '
        f'Nothing was written. Use another --workdir for this model, or '
        f'rerun with the stored values to resume.')
  safe = [k for k in changed
          if top(k) in _SAFE_CHANGES or k in _IMPLEMENTATION_OPTIONS]
  return describe(safe), describe([k for k in changed if k not in safe])


class _Estimate:
  """The one line, early in training, that says how long the rest takes
  (when that is long) and what shorter run the config offers instead."""

  # Say nothing when the remaining steps take less than this.
  LONG_S = 1800.0
  # Steps after compilation left out: the first ones run slower (the paper
  # CapsNet's first ~10 steps page-fault in XLA's buffers; measured from
  # them, its estimate said 46 img/s where the run went on at 60).
  WARMUP_STEPS = 10
  # Then measure at least this long before estimating.
  MEASURE_S = 30.0

  def __init__(self, config: ml_collections.ConfigDict):
    self._config = config
    self._start_step, self._start_time, self._said = 0, None, False

  def start(self, step: int) -> None:
    """Compilation is done at ``step``; measure from WARMUP_STEPS later."""
    self._start_step, self._start_time = step + self.WARMUP_STEPS, None

  def line(self, step: int) -> str | None:
    """The estimate once, from the steps finished since the warm-up."""
    if self._said:
      return None
    if self._start_time is None:
      if step >= self._start_step:
        self._start_step, self._start_time = step, time.perf_counter()
      return None
    seconds = time.perf_counter() - self._start_time
    done = step - self._start_step
    if seconds < self.MEASURE_S or done < 2:
      return None
    self._said = True
    remaining = (self._config.num_train_steps - step) * seconds / done
    if remaining < self.LONG_S:
      return None
    images_per_s = done * self._config.batch_size / seconds
    device = jax.devices()[0]
    where = ('this CPU' if device.platform == 'cpu' else
             f'this {getattr(device, "device_kind", device.platform)}')
    every_s = self._config.checkpoint_every_seconds or 0
    saves = (f'a checkpoint every {_hours(every_s)} and at Ctrl-C'
             if every_s else 'a checkpoint at Ctrl-C')
    alternative = self._config.shorter_run or ''
    return (f'The remaining {self._config.num_train_steps - step} steps take '
            f'about {_hours(remaining)} at {images_per_s:.0f} img/s on '
            f'{where}; {saves}, and a rerun resumes.'
            + (f' Shorter: {alternative}' if alternative else ''))


StopWhen = Callable[[dict[str, Any]], str | None]
# (workdir, which, data_dir) -> a trained workdir's evaluators.Context
# (training.load_context: it imports the trainers, which import this module).
LoadWorkdir = Callable[[str, str, str | None], evaluators.Context]


class _Run:
  """One training run's state and the work ``fit`` does at each step."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               steps: FamilySteps, dataset: data_lib.Dataset,
               stop_when: StopWhen | None = None,
               load_workdir: LoadWorkdir | None = None):
    self.config, self.workdir, self.dataset = config, workdir, dataset
    self.stop_when, self.load_workdir = stop_when, load_workdir
    self.train_batch = steps.train_batch
    self.eval_inputs = steps.eval_inputs
    # In a multi-process run every process runs this; process 0 alone writes
    # the run's files (orbax coordinates the checkpoints itself).
    self.chief = is_chief()
    # The progress bar while training: messages go above it.
    self.progress: metrics_lib.Progress | None = None
    accepted, warned = config_changes(config, workdir)
    if accepted:
      self.say(f'Changed from the stored config: {accepted}.')
    if warned:
      self.say(f'Warning: resuming with values that differ from the stored '
               f'config (the run is then no longer one protocol): {warned}.')
    self.mesh = make_mesh(config.num_devices or None)
    check_batch_size(config.batch_size, self.mesh)
    self.graphdef, state = init_train_state(create_model(config),
                                            make_optimizer(config))
    self.num_params = count_params(state.params)
    self.state = jax.device_put(state, replicated(self.mesh))
    self.checkpoints = Checkpointer(os.path.join(workdir, 'checkpoints'))
    self.best = Checkpointer(os.path.join(workdir, 'best'), max_to_keep=1)
    # The newest checkpoint that reads back as saved; damaged newer ones
    # are said and set aside, so that this run saves those steps afresh.
    self.resumed = self.checkpoints.restore_newest_good(self.state, self.say)
    if self.resumed is not None:
      self.state = self.resumed.state
      self.say(f'Resuming from the checkpoint of step {self.resumed.step} '
               f'in {workdir}.')
    else:
      self.say(f'Starting fresh in {workdir}.')
    # Only now: a resume that failed leaves the config its checkpoints were
    # trained with, which its error tells the user to use.
    if self.chief:
      metrics_lib.save_config(config, workdir)
    self.step = int(self.state.step)
    self.selecting = config.select_on_validation
    self.best_record_path = os.path.join(workdir, 'best_validation.json')
    self.best_record = (json.load(open(self.best_record_path))
                        if os.path.exists(self.best_record_path) else None)
    # True when the best checkpoint was lost: the best is selected again.
    self.reselect = self._drop_damaged_best()
    self.order = BatchOrder(len(dataset.train.labels), config.batch_size,
                            config.seed)
    self.data_key = jax.random.PRNGKey(config.seed + 2)
    self.train_images = on_mesh(dataset.train.images, replicated(self.mesh))
    self.train_labels = on_mesh(dataset.train.labels, replicated(self.mesh))
    # Placed once: the validation split is evaluated many times.
    self.validation_images = on_mesh(dataset.validation.images,
                                     replicated(self.mesh))
    # The graphdef is closed over rather than passed as a static argument:
    # it need not be hashable.
    self._train_step = jax.jit(
        functools.partial(steps.train_step, self.graphdef), donate_argnums=0)
    self._eval_step = jax.jit(functools.partial(steps.eval_step, self.graphdef))
    self._implementations: dict[str, str] | None = None

  def say(self, message: str) -> None:
    if not self.chief:
      return
    if self.progress is not None:  # above the bar, not into its line
      self.progress.write(message)
    else:
      print(message, flush=True)

  def _drop_damaged_best(self) -> bool:
    """Checks the best checkpoint on resume. A damaged or missing one is
    said, set aside and forgotten with its record, so that the best is
    selected again (from the validations still to come, or the final
    weights); never tested in its damaged state."""
    if not (self.selecting and self.best_record is not None):
      return False
    problem = self.best.problem(self.state)
    if not problem:
      return False
    steps = self.best.steps()
    moved = self.best.set_aside(steps[:1])
    aside = f'; moved to {moved[steps[0]]}' if moved else ''
    self.say(f'Warning: the best checkpoint (step {self.best_record["step"]}'
             f') in {self.best.directory} is damaged or missing ({problem})'
             f'{aside}; the best is selected again from the validations '
             f'still to come (the final weights if none is).')
    if self.chief:
      os.remove(self.best_record_path)
    self.best_record = None
    return True

  def header(self) -> str:
    d, c = self.dataset, self.config
    return (f'{c.model}: {self.num_params:,} parameters; {d.name}: '
            f'{len(d.train.labels)} train / {len(d.validation.labels)} '
            f'validation / {len(d.test.labels)} test; {c.num_train_steps} '
            f'steps of batch {c.batch_size} on {self.mesh.size} '
            f'{jax.devices()[0].platform} device(s); '
            f'{_convolution_words()}implementations: '
            f'{_implementation_words(self.implementations())}.')

  def implementations(self) -> dict[str, str]:
    """What the model's operations run with and why not faster ones
    (``kernels.implementations.describe``): the choices made while tracing
    an evaluation step, which the train step's forward pass shares."""
    if self._implementations is not None:
      return self._implementations
    # A split the evaluation step reads (training may pad its images).
    split = self.dataset.validation
    if not len(split.labels):
      split = self.dataset.test
    batch = self.config.batch_size
    shapes = (jax.ShapeDtypeStruct((batch,) + split.images.shape[1:],
                                   split.images.dtype),
              jax.ShapeDtypeStruct((batch,) + split.labels.shape[1:],
                                   split.labels.dtype),
              jax.ShapeDtypeStruct((batch,), jnp.bool_))
    with implementations.recording() as choices:
      jax.eval_shape(self._eval_step, self.state.params,
                     self.state.model_state, *shapes)
    self._implementations = implementations.describe(choices)
    return self._implementations

  def stop_reason(self) -> str | None:
    """Why ``stop_when`` stops training at the best validation record (None:
    train on)."""
    if self.stop_when is None or self.best_record is None:
      return None
    return self.stop_when(self.best_record)

  def train_step(self) -> dict[str, jax.Array]:
    idx = self.order.indices(self.step)
    if self.train_batch is None:
      images = take_batch(self.train_images, idx, self.mesh)
      labels = take_batch(self.train_labels, idx, self.mesh)
    else:
      images, labels = self.train_batch(self.train_images, self.train_labels,
                                        idx, self.mesh)
    key = on_mesh(jax.random.fold_in(self.data_key, self.step),
                  replicated(self.mesh))
    self.state, metrics = self._train_step(self.state, images, labels, key)
    self.step += 1
    return metrics

  def raise_if_diverged(self) -> None:
    bad_step = int(self.state.nonfinite_step)
    if bad_step < 0:
      return
    resumed = self.resumed
    if (resumed is not None and not resumed.verified and
        self.checkpoints.latest_step() == resumed.step):
      # Nothing saved since a resume from a checkpoint no digest could
      # check: a damaged file there diverges the first steps.
      path = os.path.join(self.checkpoints.directory, str(resumed.step))
      raise TrainingDiverged(
          f'the loss or a gradient became non-finite at step {bad_step}, '
          f'before any checkpoint since this run resumed from the one of '
          f'step {resumed.step}, which has no digest to check it (saved by '
          f'an older capsjax): that checkpoint is the likely cause (a '
          f'damaged file), not the learning rate. Move {path} away and rerun '
          f'to resume from an earlier one (or from the start).')
    raise TrainingDiverged(
        f'the loss or a gradient became non-finite at step {bad_step}; that '
        f'update was not applied and the last good checkpoint (step '
        f'{self.checkpoints.latest_step()}) is kept in '
        f'{self.checkpoints.directory}. Lower the learning rate or check the '
        f'input data.')

  def log(self, metrics, clock: _TrainClock, writer, progress) -> None:
    steps, seconds = clock.close_window()
    scalars = {f'train/{k}': float(v)
               for k, v in jax.device_get(metrics).items()}
    scalars['train/learning_rate'] = float(
        learning_rate_schedule(self.config)(self.step))
    if steps and seconds > 0:
      scalars['train/images_per_s'] = steps * self.config.batch_size / seconds
    writer.write(self.step, scalars)
    progress.update(self.step, {'loss': scalars['train/loss'],
                                'acc': scalars['train/accuracy']})

  def evaluate(self, split: data_lib.Split, images=None) -> dict[str, float]:
    return evaluate(self._eval_step, self.state, split,
                    self.config.eval_batch_size, self.mesh, images)

  def validate(self, writer) -> dict[str, float]:
    """Validation metrics; a new best is saved as the selected model (with
    ``config.select_on_validation`` False the record follows the latest
    state, which is the one tested)."""
    val = self.evaluate(self.dataset.validation, self.validation_images)
    if val:
      writer.write(self.step, {f'validation/{k}': v for k, v in val.items()})
      if not self.selecting or self.best_record is None or (
          val['accuracy'] > self.best_record['accuracy']):
        self.best_record = {'step': self.step, **val}
        if self.selecting:
          self.best.save(self.state)
        if self.chief:
          metrics_lib.write_json_atomic(self.best_record_path,
                                        self.best_record)
    return val

  def select_best(self) -> None:
    """Model selection on validation only (the latest state without it, or
    with ``config.select_on_validation`` False: the last weights). The best
    checkpoint is verified first: a damaged one stops the run before the
    test set is read."""
    if not self.selecting or self.best_record is None:
      return
    try:
      steps = self.best.steps()
      if not steps:
        raise CheckpointDamaged(f'the best checkpoint (step '
                                f'{self.best_record["step"]}) is missing from '
                                f'{self.best.directory}')
      restored = self.best.restore_checked(self.state, steps[0])
    except CheckpointDamaged as e:
      raise CheckpointDamaged(
          f'{e}: the model selected on validation is not tested. Rerun the '
          f'same command: it sets that checkpoint aside and selects the best '
          f'again (the final weights when no validation is left).',
          e.reason) from e
    if not restored.verified:
      self.say(f'Warning: the best checkpoint (step {restored.step}) has no '
               f'digest (saved by an older capsjax); it is tested '
               f'unverified.')
    self.state = restored.state

  def eval_context(self) -> evaluators.Context:
    """The selected model for the config's evaluators."""
    params, model_state = jax.device_get((self.state.params,
                                          self.state.model_state))
    return evaluators.Context(
        model=nnx.merge(self.graphdef, params, model_state),
        config=self.config, workdir=self.workdir,
        evaluate_split=self.evaluate, eval_inputs=self.eval_inputs,
        load_dataset=lambda: self.dataset, write_files=self.chief,
        load_workdir=self.load_workdir)

  def close(self) -> None:
    self.checkpoints.close()
    self.best.close()


def fit(config: ml_collections.ConfigDict, workdir: str,
        steps: FamilySteps, dataset: data_lib.Dataset, *,
        stop_when: StopWhen | None = None,
        load_workdir: LoadWorkdir | None = None) -> dict[str, Any]:
  """Train, checkpoint, resume, select on validation, test once, summarise.

  ``stop_when(best validation record) -> reason or None``, asked after each
  validation, stops training at the first record it gives a reason for (a
  rerun of a run it stopped does not train further); the summary then says
  ``stopped_early``. ``config.evals`` (see
  ``capsjax.evaluators``) run on the selected model after the test set,
  into ``summary['evals']``; ``load_workdir`` is how they open other
  trained workdirs (``training.load_context``; ``training.train`` passes
  it).

  Returns the summary also written to ``workdir/summary.json``.
  """
  check_config(config)
  evaluators.check(config)  # before any training: a bad option fails now
  # The model's outputs, from shapes alone: a model that lacks what its
  # family's losses read fails now, in one line, with nothing written.
  check_model(config, model_input_shape(steps, dataset), dataset.num_classes)
  workdir = os.path.abspath(workdir)
  _make_writable_dir(workdir)
  # One writer per workdir (each process of a multi-process job its own
  # lock file); held until the summary is written.
  with hold_workdir(workdir, 'training', process_index=jax.process_index()):
    return _fit(config, workdir, steps, dataset, stop_when, load_workdir)


def model_input_shape(steps: FamilySteps, dataset: data_lib.Dataset
                      ) -> tuple[int, ...]:
  """[H, W, C] the model reads: the evaluation inputs of one test image,
  as a shape (no test image is read)."""
  image = jax.ShapeDtypeStruct((1, *dataset.test.images.shape[1:]),
                               dataset.test.images.dtype)
  return tuple(jax.eval_shape(steps.eval_inputs, image).shape[1:])


def _fit(config: ml_collections.ConfigDict, workdir: str,
         steps: FamilySteps, dataset: data_lib.Dataset,
         stop_when: StopWhen | None,
         load_workdir: LoadWorkdir | None) -> dict[str, Any]:
  """``fit`` in a workdir this process holds."""
  run = _Run(config, workdir, steps, dataset, stop_when, load_workdir)
  run.say(run.header())
  if run.step >= config.num_train_steps or run.stop_reason():
    run.say(f'{workdir} has finished training (step {run.step}): nothing is '
            f'trained; the selected model is tested again.')
  # The code that trains: taken now, as the tree may change during a run.
  environment = metrics_lib.environment()
  clock, compile_s = _train(run, workdir)
  return _test_and_summarise(run, dataset, clock, compile_s, environment,
                             workdir)


def _train(run: _Run, workdir: str) -> tuple[_TrainClock, float | None]:
  """Train ``run`` to its last step (or its time limit or stop reason),
  logging, validating and checkpointing on the config's schedule: (the
  train clock, the first step's compile seconds, None if none ran).
  Raises ``TrainingStopped`` on a stop signal, after a checkpoint."""
  config = run.config
  time_limit = config.max_train_seconds or None
  save_every_s = config.checkpoint_every_seconds or None
  clock, compile_s = _TrainClock(), None
  due = lambda every: run.step % every == 0  # noqa: E731
  # A stop signal and the wall-time checkpoint are checked at every step by
  # a single process; processes must agree on the step, so a multi-process
  # run checks at log steps.
  single = jax.process_count() == 1
  last_save = time.monotonic()
  estimate = _Estimate(config)
  with metrics_lib.MetricWriter(workdir) as writer, metrics_lib.Progress(
      config.num_train_steps, run.step, config.batch_size) as progress, \
      _StopSignals() as stop:
    run.progress = progress
    previous = None
    while run.step < config.num_train_steps and not run.stop_reason():
      metrics, compile_s = _timed_step(run, clock, estimate, progress,
                                       previous, compile_s)
      previous = metrics
      last = run.step == config.num_train_steps or (
          time_limit is not None and all_agree(clock.elapsed() > time_limit))
      agree_now = single or due(config.log_every_steps)
      stopping = agree_now and all_agree(stop.signum is not None)
      if last or stopping or due(config.log_every_steps):
        jax.block_until_ready(metrics)  # the logged window's steps are done
      clock.stop()
      save_now = save_every_s is not None and agree_now and all_agree(
          time.monotonic() - last_save > save_every_s)
      if last or stopping or save_now or due(config.log_every_steps) or due(
          config.eval_every_steps) or due(config.checkpoint_every_steps):
        # Before anything is logged, evaluated or saved, so that no
        # checkpoint holds a state that went past a non-finite step.
        run.raise_if_diverged()
      if last or due(config.log_every_steps):
        run.log(metrics, clock, writer, progress)
      if last or due(config.eval_every_steps):
        run.validate(writer)
        if reason := run.stop_reason():
          last = True
          run.say(f'{reason} at step {run.step}; stopping.')
      if last or stopping or save_now or due(config.checkpoint_every_steps):
        run.checkpoints.save(run.state)
        last_save = time.monotonic()
      if stopping:
        progress.close()
        run.close()
        stopped = TrainingStopped(stop.signum or signal.SIGINT, run.step,
                                  workdir)
        run.say(str(stopped))
        raise stopped
      if last:
        break
    if run.reselect and run.best_record is None:
      # The best was lost and no validation since picked another: the
      # final weights, validated now, are the selected model.
      run.validate(writer)
  clock.close_window()
  return clock, compile_s


def _timed_step(run: _Run, clock: _TrainClock, estimate: _Estimate,
                progress: metrics_lib.Progress, previous: Any,
                compile_s: float | None) -> tuple[Any, float | None]:
  """One train step on the clock: (its metrics, compile seconds).

  The first step (``compile_s`` None) compiles: it is waited for, and its
  seconds are the compile time, not train time. Later steps wait only for
  the step before (``previous``'s metrics), so one stays in flight, and
  then advance the progress bar and the time estimate."""
  clock.start()
  t0 = time.perf_counter()
  metrics = run.train_step()
  clock.count_step()
  if compile_s is None:  # the first step compiles; it is not timed
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    clock.close_window()
    clock.start()
    estimate.start(run.step)
  elif previous is not None:
    # One step stays in flight: the bar counts finished steps only.
    jax.block_until_ready(previous)
    progress.advance(run.step - 1)
    if line := estimate.line(run.step - 1):
      run.say(line)
  return metrics, compile_s


def _test_and_summarise(run: _Run, dataset: data_lib.Dataset,
                        clock: _TrainClock, compile_s: float | None,
                        environment: dict[str, Any], workdir: str
                        ) -> dict[str, Any]:
  """Select the model, test it once, run the config's evaluators, write
  ``workdir/summary.json`` (the chief) and say the final line: the
  summary."""
  run.select_best()
  test = run.evaluate(dataset.test)  # the test set is read once, here
  evals = evaluators.run(run.config, run.eval_context())
  run.close()
  summary = _summary(run, test, evals, clock, compile_s, environment)
  if run.chief:
    metrics_lib.write_json_atomic(os.path.join(workdir, 'summary.json'),
                                  summary)
  run.say(_final_line(summary, workdir))
  return summary


def _percent(value: float | None) -> str:
  return '-' if value is None else f'{100 * value:.2f}%'


def _final_line(summary: dict[str, Any], workdir: str) -> str:
  """What a run ends with: the numbers a user looks for, and where the rest
  is."""
  speed = summary.get('train_images_per_s')
  line = (f'Test accuracy {_percent(summary["test"].get("accuracy"))} '
          f'(validation {_percent((summary.get("validation") or {}).get("accuracy"))}'
          f', step {summary["selected_step"]} selected) after '
          f'{summary["steps"]} steps'
          + (f' at {speed:.0f} img/s' if speed else '') + '.')
  if summary.get('stopped_by_time_limit'):
    line += (f' Stopped early by max_train_seconds='
             f'{summary["max_train_seconds"]:g} before num_train_steps; '
             f'raise it (0: no limit) and rerun to train on.')
  return line + f' Summary: {os.path.join(workdir, "summary.json")}'


def _convolution_words() -> str:
  """'convolutions: oneDNN (... kernels); ' where oneDNN computes them (its
  instruction set), else '': the implementations then say why not."""
  if not conv.onednn.available():
    return ''
  return f'convolutions: {conv.backend()}; '


def _implementation_words(choices: dict[str, str]) -> str:
  """'conv2d: native (2 calls); ...', or 'XLA only' for a model none of
  whose operations has a choice."""
  return '; '.join(f'{op}: {words}' for op, words in choices.items()
                   ) or 'XLA only'


def _summary(run: _Run, test: dict, evals: dict, clock: _TrainClock,
             compile_s: float | None, environment: dict[str, Any]
             ) -> dict[str, Any]:
  config = run.config
  stopped_early = run.stop_reason() is not None
  return {
      'model': config.model,
      'dataset': run.dataset.name,
      'num_params': run.num_params,
      'steps': run.step,
      'epochs': run.step / run.order.steps_per_epoch,
      'selected_step': int(run.state.step),
      'validation': run.best_record,
      'test': test,
      **({'evals': evals} if evals else {}),
      **({'stopped_early': stopped_early} if run.stop_when else {}),
      'train_images_per_s': (clock.steps * config.batch_size / clock.seconds
                             if clock.seconds > 0 else None),
      'compile_s': compile_s,
      'train_wall_s_this_run': clock.seconds,
      'stopped_by_time_limit': (run.step < config.num_train_steps and
                                not stopped_early),
      'max_train_seconds': config.max_train_seconds or 0,
      'conv_backend': conv.backend(),
      # What each operation ran with, and why not a faster one.
      'implementations': run.implementations(),
      'batch_size': config.batch_size,
      **environment,
      'num_devices': run.mesh.size,  # those trained on, not all there are
  }
