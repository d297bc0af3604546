"""Accuracy and loss over a whole split, data-parallel, the last batch padded."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from capsjax import data as data_lib
from capsjax.training.sharding import batch_sharded
from capsjax.training.sharding import on_mesh
from capsjax.training.sharding import replicated
from capsjax.training.sharding import take_batch
from capsjax.training.state import TrainState


def evaluate(eval_step: Callable, state: TrainState,
             split: data_lib.Split, batch_size: int, mesh: Mesh,
             images_on_device: jax.Array | None = None) -> dict[str, float]:
  """Accuracy and mean loss over a whole split, padding the last batch.

  ``eval_step(params, model_state, images, labels, mask)`` returns
  sums {'correct', 'loss', 'count'} over the masked examples.
  ``images_on_device``: the split's images already replicated on ``mesh``
  (a split evaluated many times is placed once); None places them here.
  """
  num = len(split.labels)
  if num == 0:
    return {}
  if images_on_device is None:
    images_on_device = on_mesh(split.images, replicated(mesh))
  # No bigger than the split needs (rounded up to the device count).
  batch_size = min(batch_size, -(-num // mesh.size) * mesh.size)
  batch_size = max(mesh.size, batch_size - batch_size % mesh.size)
  totals: dict[str, float] = {}
  for start in range(0, num, batch_size):
    idx = np.arange(start, start + batch_size)
    mask = idx < num
    idx = np.minimum(idx, num - 1)
    sums = eval_step(state.params, state.model_state,
                     take_batch(images_on_device, idx, mesh),
                     on_mesh(split.labels[idx], batch_sharded(mesh)),
                     on_mesh(mask, batch_sharded(mesh)))
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + float(v)
  count = totals.pop('count')
  return {'accuracy': totals['correct'] / count,
          'error': 1.0 - totals['correct'] / count,
          'loss': totals['loss'] / count}
