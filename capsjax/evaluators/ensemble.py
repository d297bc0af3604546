"""An ensemble: the class scores of several trained models averaged.

    config.evals.ensemble = dict(type='ensemble', members=('/w/model_1',
                                                           '/w/model_2'))

Sabour et al. 2017, section 7: CIFAR-10's 10.6% is "an ensemble of 7
models". The official code's ``experiment.evaluate_ensemble`` sums the
class capsules' lengths of the 7 checkpoints on each test image and takes
the argmax; the mean taken here has the same argmax. The run's own model
is the first member; ``members`` names the other trained workdirs (each
opened by the context's ``load_workdir``, ``training.load_context``, its
own evaluation preprocessing applied).
``ensemble_workdirs(workdirs, load_context=training.load_context)`` does
the same for trained workdirs alone. Returns {'accuracy', 'error',
'num_models', 'member_accuracies', 'num_examples'}.

Shape legend: M models, N examples, K classes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from capsjax import evaluators

SPLITS = ('test', 'validation')


def average_scores(scores: ArrayLike) -> jax.Array:
  """float32 ``[M, N, K]`` class scores of M models -> their mean ``[N, K]``."""
  scores = jnp.asarray(scores, jnp.float32)
  if scores.ndim != 3 or not scores.shape[0]:
    raise ValueError(f'scores must be [M, N, K] with M >= 1, got shape '
                     f'{scores.shape}.')
  return jnp.mean(scores, axis=0)


def accuracy(scores: ArrayLike, labels: ArrayLike) -> float:
  """The fraction of the N examples whose highest of the ``[N, K]`` scores
  is the label (int ``[N]``)."""
  predictions = np.argmax(np.asarray(scores), axis=-1)
  return float(np.mean(predictions == np.asarray(labels)))


@nnx.jit
def _scores(model: nnx.Module, inputs: jax.Array) -> jax.Array:
  return model(inputs, train=False)['class_scores']


def class_scores(context: evaluators.Context, images: np.ndarray
                 ) -> np.ndarray:
  """uint8 images ``[N, H, W, C]`` -> float32 class scores ``[N, K]`` of the
  context's model after the run's evaluation preprocessing.

  Batches of ``config.eval_batch_size``; the last one is padded with its
  last image, so one shape compiles.
  """
  num = len(images)
  batch_size = max(1, min(context.config.eval_batch_size, num))
  chunks = []
  for start in range(0, num, batch_size):
    index = np.minimum(np.arange(start, start + batch_size), num - 1)
    inputs = jnp.asarray(context.eval_inputs(images[index]))
    chunks.append(np.asarray(_scores(context.model, inputs), np.float32))
  return np.concatenate(chunks)[:num]


def check(config: ml_collections.ConfigDict, *, members: Sequence[str] = (),
          split: str = 'test', which: str = 'selected') -> None:
  del config, which
  if split not in SPLITS:
    raise ValueError(f'the ensemble evaluator takes split in {SPLITS}, got '
                     f'{split!r}.')
  if isinstance(members, str):
    raise ValueError(f'the ensemble evaluator takes members as a sequence of '
                     f'workdirs, got the string {members!r}.')
  for member in members:
    if not os.path.isdir(member):
      raise ValueError(f'ensemble member {member} is not a directory (a '
                       'trained workdir).')


LoadWorkdir = Callable[[str, str, str | None], evaluators.Context]


def _members(context: evaluators.Context, members: Sequence[str], which: str,
             load_workdir: LoadWorkdir | None = None
             ) -> list[evaluators.Context]:
  """The context and the members' contexts (opened by ``load_workdir``,
  default the context's), checked to share their data."""
  load_workdir = load_workdir or context.load_workdir
  if members and load_workdir is None:
    raise ValueError('the ensemble evaluator opens its members with the '
                     "context's load_workdir, and this context has none "
                     '(training.train and training.load_context give one).')
  contexts = [context]
  for member in members:
    other = load_workdir(member, which, context.config.data_dir or None)
    if (other.config.dataset != context.config.dataset or
        other.config.validation_size != context.config.validation_size):
      raise ValueError(
          f'ensemble member {member} was trained on {other.config.dataset} '
          f'(validation_size {other.config.validation_size}), the first '
          f'model on {context.config.dataset} (validation_size '
          f'{context.config.validation_size}): the members must share their '
          'data.')
    contexts.append(other)
  return contexts


def _metrics(contexts: Sequence[evaluators.Context], images: np.ndarray,
             labels: np.ndarray) -> dict[str, Any]:
  if not len(labels):
    return {'num_examples': 0, 'num_models': len(contexts)}
  scores = [class_scores(c, images) for c in contexts]
  if len({s.shape for s in scores}) != 1:
    raise ValueError(f'the members score {[s.shape[-1] for s in scores]} '
                     'classes: they must share their classes.')
  combined = accuracy(average_scores(np.stack(scores)), labels)
  return {
      'accuracy': combined,
      'error': 1.0 - combined,
      'num_models': len(scores),
      'member_accuracies': [accuracy(s, labels) for s in scores],
      'num_examples': len(labels),
  }


def evaluate(context: evaluators.Context, *, members: Sequence[str] = (),
             split: str = 'test', which: str = 'selected') -> dict[str, Any]:
  """The ensemble of the context's model and the ``members``' selected (or
  ``which``: see ``checkpoints.load_trained_state``) models on the run's
  ``split``."""
  check(context.config, members=members, split=split, which=which)
  data = getattr(context.dataset, split)
  return _metrics(_members(context, members, which), *data)


def ensemble_workdirs(workdirs: Sequence[str], *, load_context: LoadWorkdir,
                      splits: Sequence[str] = ('test',),
                      which: str = 'selected', data_dir: str | None = None
                      ) -> dict[str, dict[str, Any]]:
  """``evaluate`` of trained workdirs on each of ``splits`` (split -> its
  metrics): every model loaded once by ``load_context`` (pass
  ``training.load_context``), the first one's dataset read once."""
  if not workdirs:
    raise ValueError('an ensemble needs at least one trained workdir.')
  context = load_context(workdirs[0], which, data_dir)
  for split in splits:
    check(context.config, members=workdirs[1:], split=split, which=which)
  contexts = _members(context, workdirs[1:], which, load_context)
  return {split: _metrics(contexts, *getattr(context.dataset, split))
          for split in splits}
