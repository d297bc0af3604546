"""The MultiMNIST reconstructions of Sabour et al. 2017 (section 6, Fig. 5).

    config.evals.reconstructions = dict(type='multimnist_figure',
                                        num_examples=8)

The first ``num_examples`` pairs of the run's MultiMNIST test set (the pair
sets are generated in chunks, so a smaller set with the same key starts
alike), each above the digits decoded from its two longest capsules, the
first red and the second green; written to
``WORKDIR/multimnist_reconstructions.png``. A model without a decoder (the
baseline CNN, or CapsNet with ``reconstruction=False``) has nothing to draw:
the result says so and no file is written.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from capsjax import data as data_lib
from capsjax import evaluators
from capsjax import figures

FILE_NAME = 'multimnist_reconstructions.png'


@nnx.jit
def _two_longest_reconstructions(model: nnx.Module, images: jax.Array
                                 ) -> tuple[jax.Array, jax.Array]:
  """[N, K] lengths and [N, 2, S*S] digits decoded from the two longest
  capsules (longest first), as at test time in the paper's Fig. 5."""
  out = model(images, train=False)
  _, top2 = jax.lax.top_k(out['class_scores'], 2)
  return out['class_scores'], model.reconstruct_digits(out['capsules'], top2)


def check(config: ml_collections.ConfigDict, *, num_examples: int = 8) -> None:
  if config.dataset != 'multimnist':
    raise ValueError(f"the multimnist_figure evaluator needs config.dataset "
                     f"'multimnist', got {config.dataset!r}.")
  evaluators.check_int('multimnist_figure', 'num_examples', num_examples, 1)


def evaluate(context: evaluators.Context, *, num_examples: int = 8
             ) -> dict[str, Any]:
  """{'figure': the PNG's path}, or {'figure': None, 'skipped': why}."""
  config = context.config
  if getattr(context.model, 'decoder', None) is None:
    return {'figure': None,
            'skipped': f'{config.model} has no reconstruction decoder'}
  mnist = data_lib.load_dataset('mnist', data_dir=config.data_dir or None,
                                validation_size=0)
  pairs = data_lib.multimnist_test_set(
      mnist.test.images, mnist.test.labels, num_examples,
      config.eval_set_seed + 1, max_shift=config.max_shift)
  lengths, reconstructions = _two_longest_reconstructions(
      context.model, jnp.asarray(pairs['image']))
  predictions = np.asarray(jax.lax.top_k(lengths, 2)[1])
  path = context.output_path(FILE_NAME)
  if context.write_files:
    figures.multimnist_figure(pairs['image'], reconstructions, pairs['labels'],
                              predictions, path)
  return {'figure': path}
