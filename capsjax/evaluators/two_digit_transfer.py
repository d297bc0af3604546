"""Su's two-digit transfer test.

From Su Jianlin's 2018 post 揭开迷雾，来一顿美味的Capsule盛宴
("Lifting the fog: a Capsule feast").

    config.evals.pairs = dict(type='two_digit_transfer', num_pairs=0)
    config.evals.side_by_side = dict(type='two_digit_transfer',
                                     layout='side_by_side')

A model trained on single MNIST digits is shown two different test digits
in one image, stacked as Su's code joins them (56x28) or side by side
(28x56, harder), ``data.digit_pairs`` with the run's seed or ``seed``, and
asked to name both. Su's two accuracies (``pair_accuracies``):
a pair counts when the two highest scores are its two classes ('top2',
accuracy 1), and when moreover both of those scores exceed
``confidence_threshold`` ('top2_confident', accuracy 2). He reports about
40% / 10% for the pooling baseline and above 90% / 90% for the capsule head.

Shape legend: M pairs, K classes, H x W x C an image.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from capsjax import data as data_lib
from capsjax import evaluators


def pair_accuracies(scores: ArrayLike, labels: ArrayLike,
                    threshold: float = 0.5) -> dict[str, jax.Array]:
  """Su's two criteria for each pair; jit-able.

  Args:
    scores: [M, K] class scores (sigmoid outputs or capsule lengths).
    labels: int [M, 2], the two (different) true classes, in any order.
    threshold: the score both named classes must exceed for accuracy 2.

  Returns:
    ``top2``: bool [M], the two highest scores are the two true classes (in
    either order); ``top2_confident``: bool [M], ``top2`` and the second
    highest score (hence both) above ``threshold``.
  """
  scores = jnp.asarray(scores)
  labels = jnp.asarray(labels)
  if scores.ndim != 2 or labels.shape != (scores.shape[0], 2):
    raise ValueError(f'scores must be [M, K] and labels [M, 2], got shapes '
                     f'{scores.shape} and {labels.shape}.')
  values, top = jax.lax.top_k(scores, 2)
  same = (((top[:, 0] == labels[:, 0]) & (top[:, 1] == labels[:, 1])) |
          ((top[:, 0] == labels[:, 1]) & (top[:, 1] == labels[:, 0])))
  return {'top2': same, 'top2_confident': same & (values[:, 1] > threshold)}


@nnx.jit
def _scores(model: nnx.Module, images: jax.Array) -> jax.Array:
  images = data_lib.to_float(images) if images.dtype == jnp.uint8 else images
  return model(images, train=False)['class_scores']


def predict_scores(model: nnx.Module, images: ArrayLike,
                   batch_size: int = 500) -> np.ndarray:
  """[M, K] test-time class scores of [M, H, W, C] images (uint8 or [0, 1]).

  Batches of ``batch_size``; the last one is padded, so one shape compiles.
  """
  images = np.asarray(images)
  num = len(images)
  batch_size = max(1, min(batch_size, num))
  chunks = []
  for start in range(0, num, batch_size):
    idx = np.minimum(np.arange(start, start + batch_size), num - 1)
    chunks.append(np.asarray(_scores(model, jnp.asarray(images[idx]))))
  return np.concatenate(chunks)[:num]


def test_pairs(test: data_lib.Split, seed: int, num_pairs: int = 0,
               layout: str = 'stacked') -> dict[str, np.ndarray]:
  """The pairs of ``data.digit_pairs``, the first ``num_pairs`` (0: all,
  about 9,000 of the MNIST test split)."""
  pairs = data_lib.digit_pairs(test.images, test.labels, seed, layout)
  if num_pairs:
    pairs = {k: v[:num_pairs] for k, v in pairs.items()}
  return pairs


def check(config, *, num_pairs: int = 0, seed: int | None = None,
          confidence_threshold: float = 0.5, layout: str = 'stacked',
          batch_size: int = 500) -> None:
  del seed, batch_size
  if config.dataset != 'mnist':
    raise ValueError(f"Su's test is on MNIST digits; config.dataset is "
                     f'{config.dataset!r}.')
  evaluators.check_int('two_digit_transfer', 'num_pairs', num_pairs, 0,
                      ' (0: all)')
  if not 0 <= confidence_threshold < 1:
    raise ValueError(f'confidence_threshold must be in [0, 1), got '
                     f'{confidence_threshold!r}.')
  if layout not in data_lib.PAIR_LAYOUTS:
    raise ValueError(f'two_digit_transfer: layout must be one of '
                     f'{data_lib.PAIR_LAYOUTS}, got {layout!r}.')


def evaluate(context: evaluators.Context, *, num_pairs: int = 0,
             seed: int | None = None, confidence_threshold: float = 0.5,
             layout: str = 'stacked', batch_size: int = 500
             ) -> dict[str, Any]:
  """{'top2', 'top2_confident'} accuracies over the pairs, 'num_pairs',
  'layout' and 'eval_s'; the pairs are drawn with ``seed`` (None: the run's
  seed)."""
  seed = context.config.seed if seed is None else seed
  pairs = test_pairs(context.dataset.test, seed, num_pairs, layout)
  start = time.perf_counter()
  scores = predict_scores(context.model, pairs['image'], batch_size)
  correct = jax.device_get(pair_accuracies(scores, pairs['labels'],
                                           confidence_threshold))
  return {'top2': float(np.mean(correct['top2'])),
          'top2_confident': float(np.mean(correct['top2_confident'])),
          'num_pairs': int(len(pairs['labels'])), 'layout': layout,
          'eval_s': time.perf_counter() - start}
