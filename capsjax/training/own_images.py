"""Training on your own images, and predicting with the trained model.

    config = own_images config (experiments/configs/own_images.py)
    training.train(config, workdir)          # any family, by config.model
    context = training.load_context(workdir)
    for p in training.predict(context, ['photo.jpg', 'more_photos/']):
      print(p.path, p.class_name, p.score)

A run reads ``config.images`` through the cache (``data.read_cached``),
carves validation (without a validation folder) and test (without a test
split) by ``config.split_seed``, says where each split comes from and how
many images of each class it holds (warning about classes of fewer than
``FEW_IMAGES`` images), takes the input shape, the number of classes and
their names from the data, says the model's size and the memory of a
training batch, stops with one line when that will not fit, and trains
with its family's steps (``dynamic`` or ``em``) in ``loop.fit``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from capsjax import data as data_lib
from capsjax import evaluators
from capsjax import families
from capsjax import models
from capsjax.data import images as images_lib
from capsjax.evaluators import confusion
from capsjax.training import loop
from capsjax.training import memory
from capsjax.training import metrics as metrics_lib
from capsjax.training import state as state_lib
from capsjax.training.defaults import fill_defaults
from capsjax.training.sharding import make_mesh

# config.dataset of a run on your own images.
DATASET = 'own_images'
# The cache's folder inside the workdir (config.cache_dir '' picks it).
CACHE_SUBDIR = 'image_cache'
# Image sides tried, largest first, for the line that says what fits.
_SMALLER_SIZES = (128, 96, 64, 48, 32, 24)
# A class with fewer images than this (all splits together) is warned
# about: too few to learn it from, and its split shares round to nothing
# (20% of 4 images is 1 test image; of 2, none: it is never tested).
FEW_IMAGES = 5


class ModelTooLarge(ValueError):
  """The run would not fit in memory; the message says what to lower."""


def image_options(config: ml_collections.ConfigDict
                  ) -> images_lib.ImageOptions:
  return images_lib.ImageOptions(
      image_size=config.image_size, channels=config.channels,
      resize_mode=config.resize_mode,
      skip_bad_images=config.skip_bad_images)


def cache_dir(config: ml_collections.ConfigDict, workdir: str) -> str:
  """``config.cache_dir``, or the workdir's ``image_cache/``."""
  return config.cache_dir or os.path.join(workdir, CACHE_SUBDIR)


def dataset_name(source: str) -> str:
  """'own_images:<folder or file name>' (tfds:NAME as it is)."""
  if source.startswith(images_lib.TFDS_PREFIX):
    return f'{DATASET}:{source}'
  return f'{DATASET}:{Path(source.rstrip("/")).name}'


def load_own_images(config: ml_collections.ConfigDict, workdir: str,
                    say: Callable[[str], None] = print
                    ) -> tuple[data_lib.Dataset, images_lib.OwnImages]:
  """The run's images through the cache, split by ``config.split_seed``."""
  images_lib.check_options(image_options(config))
  own = images_lib.read_cached(
      config.images, image_options(config), cache_dir(config, workdir),
      data_dir=config.data_dir or None, say=say)
  dataset = images_lib.to_dataset(
      own, test_fraction=config.test_fraction,
      validation_fraction=config.validation_fraction,
      seed=config.split_seed, name=dataset_name(config.images))
  return dataset, own


def _fraction_note(key: str, value: float) -> str:
  return f'config.{key}={value:g}, by config.split_seed'


def splits_line(config: ml_collections.ConfigDict,
                dataset: data_lib.Dataset, own: images_lib.OwnImages) -> str:
  """Where each split comes from: a folder (or array) of the source, or
  carved from the training images, with how many."""
  sources = own.report.get('split_sources') or {}
  train, validation, test = (len(s.labels) for s in (
      dataset.train, dataset.validation, dataset.test))
  if own.validation is not None:
    validation_from = sources.get('validation', 'given')
  else:
    validation_from = (f'carved from the {train + validation} training '
                       f'images: ' + _fraction_note(
                           'validation_fraction', config.validation_fraction))
  if own.test is not None:
    test_from = sources.get('test', 'given')
  else:
    test_from = (f'held out of the {len(own.train.labels)} training images: '
                 + _fraction_note('test_fraction', config.test_fraction))
  return (f'Splits: {train} train, {validation} validation '
          f'({validation_from}), {test} test ({test_from}).')


def class_count_lines(dataset: data_lib.Dataset,
                      class_names: Sequence[str]) -> list[str]:
  """The images of each class in each split, and a warning for each class
  of fewer than ``FEW_IMAGES`` images."""
  splits = (dataset.train, dataset.validation, dataset.test)
  counts = np.stack([np.bincount(s.labels, minlength=len(class_names))
                     for s in splits], axis=1)
  width = max(len(name) for name in class_names)
  lines = ['Images per class (train / validation / test):']
  lines += [f'  {name:<{width}}  {a} / {b} / {c}'
            for name, (a, b, c) in zip(class_names, counts, strict=True)]
  for name, (a, b, c) in zip(class_names, counts, strict=True):
    if a + b + c >= FEW_IMAGES:
      continue
    untested = ' It is never tested (no test images).' if not c else ''
    total = int(a + b + c)
    lines.append(
        f'Warning: class {name} has {total} image{"s" * (total != 1)} (fewer '
        f'than {FEW_IMAGES}): {a} train, {b} validation, {c} test; too few '
        f'to learn it from.{untested} Add images or remove the class.')
  return lines


def load_data(config: ml_collections.ConfigDict, workdir: str
              ) -> data_lib.Dataset:
  """The dataset of a trained workdir (for ``training.load_context``)."""
  return load_own_images(config, workdir)[0]


def input_channels(config: ml_collections.ConfigDict) -> int:
  """The channels the run's model reads."""
  options = config.model_options
  if 'input_shape' in options:
    return int(options.input_shape[-1])
  return int(options.input_channels)


def with_data_shapes(config: ml_collections.ConfigDict,
                     dataset: data_lib.Dataset,
                     class_names: Sequence[str],
                     say: Callable[[str], None] = print
                     ) -> ml_collections.ConfigDict:
  """A copy of ``config`` whose model reads the data's images and classes
  (``input_shape`` or ``input_channels``, ``num_classes``), with
  ``class_names``; the batch no larger than the training split."""
  config = config.copy_and_resolve_references()
  config.unlock()
  shape = tuple(int(n) for n in dataset.train.images.shape[1:])
  valid = models.model_options(config.model)
  if 'num_classes' not in valid or not {'input_shape',
                                        'input_channels'} & set(valid):
    raise ValueError(
        f'model {config.model!r} takes the options {", ".join(valid)}; on '
        f'your own images the data sets num_classes and input_shape (or '
        f'input_channels, for a model of any image size): give its '
        f'constructor those keywords (docs/own_model.md).')
  if 'input_shape' in valid:
    config.model_options.input_shape = shape
  if 'input_channels' in valid:
    config.model_options.input_channels = shape[-1]
  config.model_options.num_classes = len(class_names)
  config.class_names = tuple(class_names)
  num_train = len(dataset.train.labels)
  devices = make_mesh(fill_defaults(config).num_devices or None).size
  if config.batch_size > num_train:
    if num_train < devices:
      raise ValueError(f'{num_train} training images for {devices} devices; '
                       f'add images or lower config.validation_fraction.')
    batch = num_train - num_train % devices
    say(f'config.batch_size {config.batch_size} is more than the '
        f'{num_train} training images: batches of {batch}.')
    config.batch_size = batch
  return config


# ----------------------------------------------------------------------------
# The model's size, before the first step.


class ModelSize(NamedTuple):
  """What a run will hold: parameters, capsules, memory (bytes)."""

  num_params: int
  capsules: str  # e.g. '2,048 primary capsules, 20,480 votes (16-D) per image'
  state_bytes: int  # parameters and optimiser state, on each device
  train_bytes: int  # a training step's peak, its state included
  eval_bytes: int  # an evaluation batch's peak, the parameters included
  data_bytes: int  # the splits' images on the device
  num_devices: int
  on_host: bool  # the devices share the host's memory (CPU)

  @property
  def total_bytes(self) -> int:
    """On one accelerator, or on the host for all CPU devices."""
    step = max(self.train_bytes, self.eval_bytes)
    return step * (self.num_devices if self.on_host else 1) + self.data_bytes


def _abstract_model(config: ml_collections.ConfigDict):
  """The model as shapes only: nothing is allocated or initialised."""
  return nnx.eval_shape(lambda: state_lib.create_model(config))


def capsule_counts(model: nnx.Module, input_shape: Sequence[int]) -> str:
  """Primary (or input) capsules and votes per image of a model, said."""
  if isinstance(model, models.MatrixCapsNet):
    rows, cols = model.grid_sizes
    b = model.primary.num_types
    c, d = (layer.weights.shape[3] for layer in (model.caps1, model.caps2))
    k1, k2 = model.caps1.kernel_size, model.caps2.kernel_size
    num_classes = model.class_caps.weights.shape[1]
    votes = (rows[1] * cols[1] * k1 * k1 * b * c +
             rows[2] * cols[2] * k2 * k2 * c * d +
             rows[2] * cols[2] * d * num_classes)
    return (f'{rows[0] * cols[0] * b:,} primary capsules (4x4 poses), '
            f'{votes:,} votes (4x4) per image')
  graphdef, state = nnx.split(model)
  images = jax.ShapeDtypeStruct((1, *input_shape), jnp.float32)
  outputs = jax.eval_shape(
      lambda s, x: nnx.merge(graphdef, s)(x, train=False), state, images)
  if 'coupling' not in outputs:
    return 'no capsules'
  _, num_in, num_out = outputs['coupling'].shape
  if isinstance(model, models.CapsNet | models.EfficientCapsNet):
    kind = 'primary capsules'
  elif isinstance(model, models.TwoDigitCapsNet):
    kind = 'input capsules (trunk positions)'
  else:  # a model of yours: its 'coupling' is that of the class capsules
    kind = 'capsules routed to the class capsules'
  dim = (f' ({outputs["capsules"].shape[-1]}-D)' if 'capsules' in outputs
         else '')
  return f'{num_in:,} {kind}, {num_in * num_out:,} votes{dim} per image'


def _abstract_state(params, model_state, optimizer) -> state_lib.TrainState:
  """A TrainState of shapes (``jax.ShapeDtypeStruct``) only."""
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  return state_lib.TrainState(scalar, params, model_state,
                              jax.eval_shape(optimizer.init, params), scalar)


def model_size(config: ml_collections.ConfigDict,
               steps: state_lib.FamilySteps, optimizer,
               dataset: data_lib.Dataset) -> ModelSize:
  """Parameters, capsules and memory of ``config``'s run on ``dataset``,
  from shapes alone (``memory.step_bytes``)."""
  model = _abstract_model(config)
  shape = tuple(dataset.train.images.shape[1:])
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  state = _abstract_state(params, model_state, optimizer)
  mesh_size = make_mesh(fill_defaults(config).num_devices or None).size
  per_device = max(1, config.batch_size // mesh_size)
  largest = max(len(dataset.validation.labels), len(dataset.test.labels))
  eval_batch = max(1, min(config.eval_batch_size, largest))

  def batch(size, dtype=jnp.uint8):
    return (jax.ShapeDtypeStruct((size, *shape), dtype),
            jax.ShapeDtypeStruct((size,), jnp.int32))

  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  train_peak = memory.step_bytes(functools.partial(steps.train_step, graphdef),
                                 state, *batch(per_device), key)
  mask = jax.ShapeDtypeStruct((eval_batch,), jnp.bool_)
  eval_peak = memory.step_bytes(functools.partial(steps.eval_step, graphdef),
                                params, model_state, *batch(eval_batch), mask)
  state_bytes = memory.tree_bytes(state)
  params_bytes = memory.tree_bytes((params, model_state))
  pixels = int(np.prod(shape))
  splits = (dataset.train, dataset.validation, dataset.test)
  return ModelSize(
      num_params=sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)),
      capsules=capsule_counts(model, shape),
      state_bytes=state_bytes,
      train_bytes=state_bytes + train_peak + per_device * pixels,
      eval_bytes=params_bytes + eval_peak + eval_batch * pixels,
      data_bytes=sum(s.images.nbytes + s.labels.nbytes for s in splits),
      num_devices=mesh_size,
      on_host=jax.devices()[0].platform == 'cpu')


def describe_size(config: ml_collections.ConfigDict, size: ModelSize,
                  available: int | None) -> list[str]:
  """The lines said before the first step."""
  shape = 'x'.join(map(str, _input_shape(config)))
  fmt = memory.format_bytes
  of = f', {fmt(available)} available' if available else ''
  activations = size.train_bytes - size.state_bytes
  return [
      f'Model {config.model}: {size.num_params:,} parameters; '
      f'{size.capsules}; {shape} images, {len(config.class_names)} classes.',
      f'Memory: about {fmt(size.total_bytes)} needed{of} (a training batch '
      f'of {config.batch_size}: {fmt(size.train_bytes)}, of which '
      f'parameters and optimiser {fmt(size.state_bytes)}, activations '
      f'{fmt(activations)}; an evaluation batch {fmt(size.eval_bytes)}; '
      f'the images {fmt(size.data_bytes)}).']


def _input_shape(config: ml_collections.ConfigDict) -> tuple[int, int, int]:
  size = config.image_size
  return (size, size, input_channels(config))


def available_bytes(config: ml_collections.ConfigDict) -> int | None:
  """``config.memory_limit_gb`` (> 0), else what the device has free."""
  if config.memory_limit_gb:
    return int(config.memory_limit_gb * 1e9)
  return memory.device_available_bytes()


def _at_image_size(config: ml_collections.ConfigDict,
                   dataset: data_lib.Dataset, side: int
                   ) -> tuple[ml_collections.ConfigDict, data_lib.Dataset]:
  """``config`` and abstract-size stand-ins of ``dataset`` at ``side``."""
  config = config.copy_and_resolve_references()
  config.image_size = side
  channels = input_channels(config)
  if 'input_shape' in config.model_options:
    config.model_options.input_shape = (side, side, channels)

  def resized(split):
    # Only shapes and byte counts are read: a broadcast view, no copy.
    image = np.zeros((1, side, side, channels), np.uint8)
    return data_lib.Split(np.broadcast_to(image, (len(split.labels),)
                                          + image.shape[1:]), split.labels)

  return config, dataset._replace(train=resized(dataset.train),
                                  validation=resized(dataset.validation),
                                  test=resized(dataset.test))


def what_fits(config: ml_collections.ConfigDict, size: ModelSize,
              dataset: data_lib.Dataset, trainer, available: int,
              make_optimizer) -> list[str]:
  """The changes that would fit in ``available`` bytes, as flags."""
  advice, fitting = [], None
  for side in (s for s in _SMALLER_SIZES if s < config.image_size):
    smaller_config, smaller_data = _at_image_size(config, dataset, side)
    try:
      optimizer = make_optimizer(smaller_config)
      smaller = model_size(smaller_config,
                           trainer.make_steps(smaller_config, optimizer),
                           optimizer, smaller_data)
    except ValueError:  # the model's kernels no longer fit the image
      break
    if smaller.total_bytes <= available:
      fitting = (side, smaller.total_bytes)
      break
  advice.append(f'--config.image_size ({fitting[0]} fits: about '
                f'{memory.format_bytes(fitting[1])})' if fitting else
                '--config.image_size')
  copies = size.num_devices if size.on_host else 1
  per_image = (size.train_bytes - size.state_bytes) / max(
      1, config.batch_size // size.num_devices)
  room = (available - size.data_bytes) / copies - size.state_bytes
  batch = 2 ** int(np.log2(room / per_image)) if room > per_image else 0
  advice.append(f'--config.batch_size ({batch * size.num_devices} fits)'
                if 0 < batch < config.batch_size else '--config.batch_size')
  types = {'capsnet': 'primary_types', 'matrix_capsnet': 'B, C, D',
           'baseline_cnn': 'conv_channels',
           'efficient_capsnet': 'conv_channels',
           'two_digit_baseline': 'trunk_widths',
           'two_digit_capsnet': 'trunk_widths'}.get(config.model)
  advice.append(f'the capsule types or widths (--config.model_options.'
                f'{types})' if types else "the model's capsule types or "
                'widths (its --config.model_options)')
  return advice


# Above this fraction of the free memory a run is said to be close to it:
# the estimate can be 15% under what XLA allocates (memory.py).
_CLOSE_FRACTION = 0.8


def check_memory(config: ml_collections.ConfigDict, size: ModelSize,
                 available: int | None, advice: Callable[[], list[str]],
                 say: Callable[[str], None] = print) -> None:
  """ModelTooLarge, one line saying what to lower, when the run needs more
  than ``available`` bytes (``config.memory_check`` False: never); a
  warning when it needs most of them."""
  if not config.memory_check or available is None:
    return
  if size.total_bytes <= available:
    if size.total_bytes > _CLOSE_FRACTION * available:
      say(f'Warning: that is close to the free memory; if the run is killed '
          f'for memory, lower one of {", ".join(advice())}.')
    return
  shape = 'x'.join(map(str, _input_shape(config)))
  fmt = memory.format_bytes
  raise ModelTooLarge(
      f'{config.model} on {shape} images needs about '
      f'{fmt(size.total_bytes)} (a training batch of {config.batch_size}: '
      f'{fmt(size.train_bytes)}, of which parameters and optimiser '
      f'{fmt(size.state_bytes)}; images {fmt(size.data_bytes)}) but '
      f'{fmt(available)} is available; lower one of {", ".join(advice())}; '
      f'or set --config.memory_check=False to try anyway. Nothing was '
      f'trained.')


# ----------------------------------------------------------------------------
# Training.


def _optimizer_factory(trainer) -> Callable:
  """The family's optimiser (EM clips gradients) or the shared one."""
  return getattr(trainer, 'make_optimizer', state_lib.make_optimizer)


def prepare(config: ml_collections.ConfigDict, workdir: str, trainer,
            say: Callable[[str], None] = print
            ) -> tuple[ml_collections.ConfigDict, state_lib.FamilySteps,
                       data_lib.Dataset, images_lib.OwnImages]:
  """Everything before ``loop.fit``: the data read (or a clear error), the
  config completed from it, the model's size said and checked."""
  dataset, own = load_own_images(config, workdir, say)
  for line in images_lib.report_lines(own.report):
    say(line)
  say(splits_line(config, dataset, own))
  for line in class_count_lines(dataset, own.class_names):
    say(line)
  if advice := images_lib.size_advice(own.report, config.image_size):
    say(advice)
  config = with_data_shapes(config, dataset, own.class_names, say)
  config.images = images_lib.absolute_source(config.images)
  # Bad values are named now, not as a failure to trace the step.
  loop.check_config(config)
  evaluators.check(config)
  make_optimizer = _optimizer_factory(trainer)
  optimizer = make_optimizer(config)
  steps = trainer.make_steps(config, optimizer)
  # Before the size is traced from the steps: a model without the outputs
  # its family reads is one line, not a failure inside the trace.
  state_lib.check_model(config, loop.model_input_shape(steps, dataset),
                        len(own.class_names))
  size = model_size(config, steps, optimizer, dataset)
  available = available_bytes(config)
  for line in describe_size(config, size, available):
    say(line)
  check_memory(config, size, available, lambda: what_fits(
      config, size, dataset, trainer, available, make_optimizer), say)
  return config, steps, dataset, own


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       trainer, say: Callable[[str], None] = print, *,
                       load_workdir: loop.LoadWorkdir | None = None
                       ) -> dict[str, Any]:
  """Train ``config.model`` (its family's ``trainer``) on
  ``config.images``; ``loop.fit``'s summary (``load_workdir``: see
  ``loop.fit``). ``classes.json`` in the workdir then maps the class
  indices to names."""
  config, steps, dataset, own = prepare(config, workdir, trainer, say)
  summary = loop.fit(config, workdir, steps, dataset,
                     load_workdir=load_workdir)
  if jax.process_index() == 0:  # one writer of the run's files
    metrics_lib.write_json_atomic(
        os.path.join(os.path.abspath(workdir), 'classes.json'),
        {'class_names': list(config.class_names),
         'image_size': config.image_size, 'channels': input_channels(config),
         'resize_mode': config.resize_mode, 'source': config.images,
         'source_report': own.report})
  return summary


# ----------------------------------------------------------------------------
# Prediction on new image files.


class Prediction(NamedTuple):
  """One image's class: its name and the winning score (a capsule length;
  an activation for EM models)."""

  path: str
  class_index: int
  class_name: str
  score: float
  scores: np.ndarray  # float32 [K]


def score_name(config: ml_collections.ConfigDict) -> str:
  """What ``Prediction.score`` is for ``config.model`` (its family's)."""
  return families.of(config.model).score_name


def predict(context: evaluators.Context, paths: Sequence[str | os.PathLike],
            *, say: Callable[[str], None] | None = None) -> list[Prediction]:
  """The class of each image file among ``paths`` (files, or folders read
  recursively; other files ignored), decoded as the run decoded its
  training images (``config.image_size``, ``resize_mode``, the model's
  channels).

  A path that is missing or a file that cannot be decoded is passed over
  (whatever the run's ``skip_bad_images``): ``say`` is told each one, one
  line each, and how many files were ignored.

  Raises:
    DataError: no image among ``paths`` could be read (nothing to predict).
  """
  config = context.config
  options = image_options(config)._replace(channels=input_channels(config),
                                           skip_bad_images=True)
  found = images_lib.find_image_files(list(paths))
  if not found.files and not found.missing:
    raise images_lib.no_images_error(list(paths))
  images, decoded, counts = images_lib.read_image_files(found.files, options)
  unreadable = ([f'{path}: no such file or folder' for path in found.missing]
                + counts['bad_messages'])
  if say:
    for message in unreadable:
      say(f'{message}; skipped.')
    if found.ignored:
      say(f'Ignored {found.ignored} files that are not images.')
  if not decoded:
    what = (f'none of the {len(unreadable)} image files given could be read'
            if len(unreadable) > 1 else 'the image file given could not be '
            'read')
    raise data_lib.DataError(f'{what} ({unreadable[0]}); nothing was '
                             f'predicted.')
  scores = confusion.predict_scores(context, images)
  names = confusion.class_names(config, scores.shape[-1])
  winners = np.argmax(scores, axis=-1)
  return [Prediction(os.fspath(path), int(k), names[k], float(s[k]), s)
          for path, k, s in zip(decoded, winners, scores, strict=True)]
