"""Per-class accuracy and the confusion matrix on a split of the run's data.

    config.evals.per_class = dict(type='confusion', split='test')

Returns the accuracy, each class's accuracy by name (the run's
``config.class_names``, else ``figures.CLASS_NAMES`` of its dataset, else
the indices) and the matrix (rows the true classes, columns the predicted
ones); with ``figure`` True draws it into ``output_dir`` (default
``WORKDIR/figures``) as ``confusion_<split>.png``. The predictions are the
model's at test time after the run's own evaluation preprocessing, so the
accuracy is ``summary['test']['accuracy']`` again.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from capsjax import evaluators
from capsjax import figures

SPLITS = ('test', 'validation')


def confusion_matrix(labels: ArrayLike, predictions: ArrayLike,
                     num_classes: int) -> np.ndarray:
  """int64 [K, K]: entry (t, p) counts the examples of class t predicted p.

  Args:
    labels, predictions: int [N] in 0 .. K-1.
  """
  labels, predictions = np.asarray(labels), np.asarray(predictions)
  if labels.shape != predictions.shape or labels.ndim != 1:
    raise ValueError(f'labels and predictions must be int [N] alike, got '
                     f'{labels.shape} and {predictions.shape}.')
  flat = labels.astype(np.int64) * num_classes + predictions
  return np.bincount(flat, minlength=num_classes**2).reshape(
      num_classes, num_classes)


def per_class_accuracy(confusion: ArrayLike) -> np.ndarray:
  """float64 [K]: each row's diagonal over its sum; NaN for a class with no
  examples."""
  confusion = np.asarray(confusion, np.float64)
  totals = confusion.sum(axis=1)
  with np.errstate(invalid='ignore', divide='ignore'):
    return np.where(totals > 0, np.diag(confusion) / totals, np.nan)


@nnx.jit
def _scores(model: nnx.Module, inputs: jax.Array) -> jax.Array:
  return model(inputs, train=False)['class_scores']


def predict_scores(context: evaluators.Context, images: np.ndarray,
                   batch_size: int | None = None) -> np.ndarray:
  """uint8 images [N, H, W, C] -> float32 class scores [N, K]: the context's
  model after the run's evaluation preprocessing (``context.eval_inputs``).

  Batches of ``batch_size`` (default ``config.eval_batch_size``); the last
  one is padded, so one shape compiles.
  """
  num = len(images)
  batch_size = max(1, min(batch_size or context.config.eval_batch_size, num))
  chunks = []
  for start in range(0, num, batch_size):
    idx = np.minimum(np.arange(start, start + batch_size), num - 1)
    inputs = jnp.asarray(context.eval_inputs(images[idx]))
    chunks.append(np.asarray(_scores(context.model, inputs), np.float32))
  return np.concatenate(chunks)[:num]


def class_names(config: ml_collections.ConfigDict, num_classes: int
                ) -> tuple[str, ...]:
  """The run's class names: ``config.class_names`` (your own images),
  ``figures.CLASS_NAMES`` of its dataset, else the indices."""
  names = tuple(config.get('class_names') or
                figures.CLASS_NAMES.get(config.get('dataset'), ()))
  if len(names) == num_classes:
    return tuple(str(n) for n in names)
  return tuple(str(k) for k in range(num_classes))


def check(config: ml_collections.ConfigDict, *, split: str = 'test',
          figure: bool = True, output_dir: str = '') -> None:
  del config, figure, output_dir
  if split not in SPLITS:
    raise ValueError(f'the confusion evaluator takes split in {SPLITS}, got '
                     f'{split!r}.')


def evaluate(context: evaluators.Context, *, split: str = 'test',
             figure: bool = True, output_dir: str = '') -> dict[str, Any]:
  """{'accuracy', 'per_class_accuracy' (name -> accuracy, None for a class
  absent from the split), 'class_names', 'confusion' (rows true, columns
  predicted), 'num_examples'} and 'figure' (the PNG's path) when drawn."""
  check(context.config, split=split)
  data = getattr(context.dataset, split)
  if not len(data.labels):
    return {'num_examples': 0}
  scores = predict_scores(context, data.images)
  num_classes = scores.shape[-1]
  confusion = confusion_matrix(data.labels, np.argmax(scores, axis=-1),
                               num_classes)
  names = class_names(context.config, num_classes)
  accuracies = per_class_accuracy(confusion)
  result = {
      'accuracy': float(np.trace(confusion) / confusion.sum()),
      'per_class_accuracy': {n: None if np.isnan(a) else float(a)
                             for n, a in zip(names, accuracies, strict=True)},
      'class_names': list(names),
      'confusion': confusion.tolist(),
      'num_examples': int(confusion.sum()),
  }
  if figure and context.write_files:
    path = context.output_path(
        f'confusion_{split}.png',
        output_dir or os.path.join(context.workdir, 'figures'))
    figures.confusion_figure(
        confusion, names, path, title=f'{context.config.model}, {split} '
        f'split: {100 * result["accuracy"]:.2f}% correct')
    result['figure'] = path
  return result
