"""Runs by config and by workdir: the trainer of a model's family, and a
trained workdir opened for the evaluators. A run on your own images
(``config.dataset == own_images.DATASET``) goes through ``own_images``,
which takes the model's shapes from the data.

The model is ``config.model``: a registered name (``models.list_models``)
or a model of yours as 'module:Class', or given to ``train`` from Python
(``model=``: a class or a module-level factory function).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import jax
import ml_collections
from flax import nnx

from capsjax import evaluators
from capsjax import families
from capsjax import models
from capsjax.training import checkpoints
from capsjax.training import matrix_capsules
from capsjax.training import own_images
from capsjax.training import vector_capsules
from capsjax.training.defaults import fill_defaults
from capsjax.training.evaluation import evaluate
from capsjax.training.sharding import make_mesh
from capsjax.training.state import make_optimizer

# ``Family.trainer_name`` -> its trainer: the families name theirs, so that
# capsjax.families imports nothing of training.
TRAINERS: dict[str, types.ModuleType] = {
    'matrix_capsules': matrix_capsules,
    'vector_capsules': vector_capsules,
}


def trainer_of(family_: families.Family) -> types.ModuleType:
  """The trainer module of a family (``vector_capsules`` or
  ``matrix_capsules``): ``steps_for``, ``load_data``,
  ``train_and_evaluate``."""
  return TRAINERS[family_.trainer_name]


def family(config: ml_collections.ConfigDict) -> types.ModuleType:
  """The trainer module (``vector_capsules`` or ``matrix_capsules``) of
  ``config.model``'s family (``families.of``; ValueError naming the valid
  models if unknown)."""
  return trainer_of(families.of(config.model))


def use_model(config: ml_collections.ConfigDict,
              model: str | models.ModelConstructor) -> None:
  """Sets ``config.model`` to ``model``: a name or 'module:Class' path as
  it is, a class or a factory function of yours as its 'module:QualName'
  path (``models.import_path``), which its workdir records."""
  config.model = model if isinstance(model, str) else models.import_path(model)


def train(config: ml_collections.ConfigDict, workdir: str,
          model: str | models.ModelConstructor | None = None, **fit_options
          ) -> dict[str, Any]:
  """Train ``config`` in ``workdir`` with its family's trainer; the summary.

  ``model``: instead of ``config.model`` (``use_model``): a name, or a
  model class or factory function of yours, defined at the top level of a
  module. ``fit_options`` go to ``loop.fit`` (not with your own images).
  """
  if model is not None:
    use_model(config, model)
  fill_defaults(config)
  if config.dataset == own_images.DATASET:
    if fit_options:
      raise ValueError(f'a run on your own images takes no fit options, got '
                       f'{sorted(fit_options)}.')
    return own_images.train_and_evaluate(config, workdir, family(config),
                                         load_workdir=load_context)
  # The evaluators open other trained workdirs (an ensemble's members)
  # with it: they may not import training.
  return family(config).train_and_evaluate(
      config, workdir, **{'load_workdir': load_context, **fit_options})


def load_context(workdir: str, which: str = 'selected',
                 data_dir: str | None = None) -> evaluators.Context:
  """The model trained in ``workdir`` (``which``: see
  ``checkpoints.load_trained_state``), ready for ``evaluators``;
  ``data_dir`` overrides the run's ``config.data_dir``."""
  config = checkpoints.read_workdir_config(workdir)
  if data_dir:
    config.data_dir = data_dir
  graphdef, state = checkpoints.load_trained_state(workdir, which)
  return context_of(config, graphdef, state, workdir)


def context_of(config: ml_collections.ConfigDict, graphdef: nnx.GraphDef,
               state, workdir: str, write_files: bool = True
               ) -> evaluators.Context:
  """A trained model (``graphdef`` and its train ``state``) of ``config``
  as the evaluators see it, its data read from ``config.data_dir`` on
  first use; ``workdir`` is where evaluators write their files."""
  trainer = family(config)
  steps = trainer.steps_for(config, make_optimizer(config))
  # Compiled once, as the training loop's (run op by op, each batch cost
  # one dispatch per operation).
  evaluate_split = functools.partial(
      evaluate, jax.jit(functools.partial(steps.eval_step, graphdef)), state,
      batch_size=config.eval_batch_size, mesh=make_mesh(1))
  return evaluators.Context(
      model=nnx.merge(graphdef, state.params, state.model_state),
      config=config, workdir=workdir, evaluate_split=evaluate_split,
      eval_inputs=steps.eval_inputs, load_dataset=(
          functools.partial(own_images.load_data, config, workdir)
          if config.dataset == own_images.DATASET
          else lambda: trainer.load_data(config)), write_files=write_files,
      load_workdir=load_context)
