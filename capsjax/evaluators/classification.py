"""Accuracy, error and loss on a split of the run's own dataset.

    config.evals.test = dict(type='classification', split='test')

The numbers of ``summary['test']`` (or of the validation split) of a
trained workdir, recomputed from its checkpoint by the family's evaluation
step; used on workdirs opened with ``training.load_context``.
"""

from __future__ import annotations

import ml_collections

from capsjax import evaluators

SPLITS = ('test', 'validation')


def check(config: ml_collections.ConfigDict, *, split: str = 'test') -> None:
  del config
  if split not in SPLITS:
    raise ValueError(f'the classification evaluator takes split in {SPLITS}, '
                     f'got {split!r}.')


def evaluate(context: evaluators.Context, *, split: str = 'test'
             ) -> dict[str, float]:
  """{'accuracy', 'error', 'loss'} over the whole split."""
  check(context.config, split=split)
  return context.evaluate_split(getattr(context.dataset, split))
