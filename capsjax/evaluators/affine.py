"""The affNIST test of Sabour et al. 2017, section 5.2.

    config.evals.affine_mnist = dict(type='affine', source='affine_mnist',
                                     size=10_000, seed=0)
    config.evals.affnist = dict(type='affine', source='affnist',
                                directory='/data/affNIST')
    config.evals.translated = dict(type='affine',
                                   source='translated_mnist')

A model trained on MNIST digits placed at random on a 40x40 canvas is tested
on digits under affine transformations it never saw: ``source='affnist'``
reads the real affNIST test set from ``directory`` (its release files;
``data.affnist_files``), ``source='affine_mnist'`` makes an affNIST-like set
from the first ``size`` MNIST test digits with the affNIST recipe, seeded by
``seed`` (``data.affine_mnist``). ``source='translated_mnist'`` places the
same test digits at random on the 40x40 canvas, untransformed
(``data.place_on_canvas``, seeded by ``seed``): the canvas's and the
translation's share of the affine test's error, for a model that did not
train on the canvas. Returns {'accuracy', 'error', 'loss'}.
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np

from capsjax import data as data_lib
from capsjax import evaluators

SOURCES = ('affine_mnist', 'affnist', 'translated_mnist')
CANVAS_SIZE = 40  # affNIST's


def check(config: ml_collections.ConfigDict, *, source: str = 'affine_mnist',
          size: int = 10_000, seed: int = 0, directory: str = '') -> None:
  """A bad option, or affNIST files missing, fails before any training."""
  del config, seed
  if source not in SOURCES:
    raise ValueError(f'the affine evaluator takes source in {SOURCES}, got '
                     f'{source!r}.')
  if source == 'affnist':
    if not directory:
      raise ValueError("the affine evaluator with source='affnist' needs "
                       'directory=<the affNIST release>.')
    data_lib.affnist_files(directory, 'test')
  else:
    evaluators.check_int('affine', 'size', size, 1)


def test_split(config: ml_collections.ConfigDict, *,
               source: str = 'affine_mnist', size: int = 10_000,
               seed: int = 0, directory: str = '') -> data_lib.Split:
  """The test set of ``source``: uint8 [N, 40, 40, 1] images, [N] labels."""
  check(config, source=source, size=size, seed=seed, directory=directory)
  if source == 'affnist':
    return data_lib.load_affnist(directory, split='test')
  test = data_lib.load_dataset('mnist', data_dir=config.data_dir or None,
                               validation_size=0).test
  size = min(size, len(test.labels))
  if source == 'translated_mnist':
    images = np.asarray(data_lib.place_on_canvas(
        jax.random.key(seed), test.images[:size], CANVAS_SIZE))
  else:
    images = data_lib.affine_mnist(test.images[:size], seed)
  return data_lib.Split(images, test.labels[:size])


def evaluate(context: evaluators.Context, *, source: str = 'affine_mnist',
             size: int = 10_000, seed: int = 0, directory: str = ''
             ) -> dict[str, float]:
  return context.evaluate_split(test_split(
      context.config, source=source, size=size, seed=seed,
      directory=directory))
