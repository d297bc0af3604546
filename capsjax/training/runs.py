"""Runs by config and by workdir: the family trainer of a model, and a
trained workdir opened for the evaluators. A run on your own images
(``config.dataset == own_images.DATASET``) goes through ``own_images``,
which takes the model's shapes from the data."""

from __future__ import annotations

import functools
import types
from typing import Any

import ml_collections
from flax import nnx

from capsjax import evaluators
from capsjax import models
from capsjax.training import checkpoints
from capsjax.training import dynamic
from capsjax.training import em
from capsjax.training import own_images
from capsjax.training.evaluation import evaluate
from capsjax.training.sharding import make_mesh
from capsjax.training.state import make_optimizer

_FAMILIES = {'dynamic': dynamic, 'em': em}


def family(config: ml_collections.ConfigDict) -> types.ModuleType:
  """The trainer module (``dynamic`` or ``em``) of ``config.model``."""
  name = models.MODEL_FAMILY.get(config.model)
  if name is None:
    raise ValueError(f'unknown model {config.model!r}; valid names: '
                     f'{", ".join(models.list_models())}.')
  return _FAMILIES[name]


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Train ``config`` in ``workdir`` with its family's trainer; the summary."""
  if config.dataset == own_images.DATASET:
    return own_images.train_and_evaluate(config, workdir, family(config))
  return family(config).train_and_evaluate(config, workdir)


def load_context(workdir: str, which: str = 'selected',
                 data_dir: str | None = None) -> evaluators.Context:
  """The model trained in ``workdir`` (``which``: see
  ``checkpoints.load_trained_state``), ready for ``evaluators``;
  ``data_dir`` overrides the run's ``config.data_dir``."""
  config = checkpoints.read_workdir_config(workdir)
  if data_dir:
    config.data_dir = data_dir
  trainer = family(config)
  optimizer = make_optimizer(config)
  graphdef, state = checkpoints.load_trained_state(workdir, which)
  make = (trainer.make_multimnist_steps if config.dataset == 'multimnist'
          else trainer.make_steps)
  steps = make(config, optimizer)
  evaluate_split = functools.partial(
      evaluate, functools.partial(steps.eval_step, graphdef), state,
      batch_size=config.eval_batch_size, mesh=make_mesh(1))
  return evaluators.Context(
      model=nnx.merge(graphdef, state.params, state.model_state),
      config=config, workdir=workdir, evaluate_split=evaluate_split,
      eval_inputs=steps.eval_inputs, load_dataset=(
          functools.partial(own_images.load_data, config, workdir)
          if config.dataset == own_images.DATASET
          else lambda: trainer.load_data(config)))
