"""Su's two-digit transfer test (seed 004, SPEC section 3).

Both of Su's models are trained on single MNIST digits as 10 binary problems
(``train_dynamic``), then shown two different test digits side by side
(28x56, ``data.side_by_side_pairs``) and asked to name both:

    summary = transfer.train_and_evaluate(config, workdir)

Su's two accuracies (``pair_accuracies``): a pair counts when the two highest
scores are its two classes (accuracy 1), and when moreover both of those
scores exceed 0.5 (accuracy 2). He reports about 40% / 10% for the pooling
baseline and above 90% / 90% for the capsule head, both models at about
99.3% on the normal test set.

Shape legend: M pairs, K classes, H x W x C an image.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from capsjax import data as data_lib
from capsjax import train_dynamic
from capsjax import train_lib

# Su's numbers (seed 004): normal MNIST test accuracy, accuracy 1 and 2.
REPORTED = {
    'two_digit_baseline': {'test_accuracy': 'about 0.993', 'top2': 'about 0.40',
                           'top2_confident': 'about 0.10'},
    'two_digit_capsnet': {'test_accuracy': 'about 0.993', 'top2': 'above 0.90',
                          'top2_confident': 'above 0.90'},
}


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
  return train_dynamic.class_scores(model(images, train=False))


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


def model_config(config: ml_collections.ConfigDict, name: str
                 ) -> ml_collections.ConfigDict:
  """The training config of model ``name``: shared keys + its head options."""
  out = ml_collections.ConfigDict(config.to_dict())
  out.model = name
  out.model_options.update(config.head_options.get(name, {}))
  return out


def _check_config(config: ml_collections.ConfigDict) -> None:
  allowed = ('two_digit_baseline', 'two_digit_capsnet')
  if not config.models or any(name not in allowed for name in config.models):
    raise ValueError(f'config.models must be a non-empty subset of {allowed}, '
                     f'got {tuple(config.models)}.')
  if config.dataset != 'mnist':
    raise ValueError(f"Su's test is on MNIST digits; config.dataset is "
                     f'{config.dataset!r}.')
  if config.num_pairs < 0:
    raise ValueError(f'config.num_pairs must be >= 0 (0: all), got '
                     f'{config.num_pairs}.')


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str
                       ) -> dict[str, Any]:
  """Train each of ``config.models`` on single digits, test them on pairs.

  Each model trains in ``workdir/<model>`` (``train_dynamic``: checkpoints,
  resume, validation split, single-digit test accuracy). The pairs come from
  the MNIST test split with ``config.seed``. Writes ``workdir/summary.json``
  and ``workdir/pairs.png`` (the first ``config.figure_pairs`` pairs with each
  model's two highest scores) and returns the summary.
  """
  from capsjax import figures  # matplotlib: only when drawing
  _check_config(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  test = data_lib.load_dataset(config.dataset, data_dir=config.data_dir or None,
                               validation_size=0).test
  pairs = data_lib.side_by_side_pairs(test.images, test.labels, config.seed)
  if config.num_pairs:
    pairs = {k: v[:config.num_pairs] for k, v in pairs.items()}
  results, scores = {}, {}
  for name in config.models:
    run = train_dynamic.train_and_evaluate(model_config(config, name),
                                           os.path.join(workdir, name))
    model = train_lib.load_trained_model(os.path.join(workdir, name))
    start = time.perf_counter()
    scores[name] = predict_scores(model, pairs['image'], config.eval_batch_size)
    eval_s = time.perf_counter() - start
    correct = jax.device_get(pair_accuracies(scores[name], pairs['labels'],
                                             config.confidence_threshold))
    results[name] = {
        'num_params': run['num_params'],
        'test_accuracy': run['test']['accuracy'],
        'validation_accuracy': (run['validation'] or {}).get('accuracy'),
        'steps': run['steps'],
        'epochs': run['epochs'],
        'selected_step': run['selected_step'],
        'train_wall_s_this_run': run['train_wall_s_this_run'],
        'train_images_per_s': run['train_images_per_s'],
        'pair_top2_accuracy': float(np.mean(correct['top2'])),
        'pair_top2_confident_accuracy': float(
            np.mean(correct['top2_confident'])),
        'pair_eval_s': eval_s,
    }
    print(f'{name}: test accuracy {results[name]["test_accuracy"]:.4f}; '
          f'pairs: top-2 {results[name]["pair_top2_accuracy"]:.4f}, top-2 '
          f'and both > {config.confidence_threshold} '
          f'{results[name]["pair_top2_confident_accuracy"]:.4f}', flush=True)
  shown = slice(0, config.figure_pairs)
  figure_path = os.path.join(workdir, 'pairs.png')
  figures.pair_predictions_figure(
      data_lib.to_float(pairs['image'][shown]), pairs['labels'][shown],
      {name.removeprefix('two_digit_'): s[shown] for name, s in scores.items()},
      figure_path,
      threshold=config.confidence_threshold)
  summary = {
      'experiment': 'two_digit_transfer',
      'models': results,
      'reported': {name: REPORTED[name] for name in config.models},
      'num_pairs': int(len(pairs['labels'])),
      'pair_seed': config.seed,
      'confidence_threshold': config.confidence_threshold,
      'figure': figure_path,
      **train_lib.environment(),
  }
  train_lib.write_json_atomic(os.path.join(workdir, 'summary.json'), summary)
  return summary
