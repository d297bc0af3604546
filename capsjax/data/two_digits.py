"""Su's two-digit test set (seed 004): two test digits side by side.

Shape legend: N digits in the source split, M pairs kept, H x W x C a digit.
"""

from __future__ import annotations

import numpy as np
from jax.typing import ArrayLike


def side_by_side_pairs(images: ArrayLike, labels: ArrayLike, seed: int
                       ) -> dict[str, np.ndarray]:
  """Each digit beside a partner of another class, deterministic by ``seed``.

  Su's recipe: pair digit i (left) with digit perm[i] (right) for a random
  permutation ``perm`` of the split, and keep the pairs whose classes differ
  (about 90% of them for MNIST). Every digit is on the left of one pair at
  most and on the right of one pair at most; the order of the kept pairs is
  that of their left digits.

  Args:
    images: ``[N, H, W, C]`` digits, any dtype (uint8 for MNIST).
    labels: int ``[N]``.
    seed: seed of the permutation (``np.random.default_rng(seed)``).

  Returns:
    ``image``: ``[M, H, 2W, C]``, dtype of ``images``: ``images[i]`` then
    ``images[perm[i]]`` along the width (28x28 digits give 28x56);
    ``labels``: int32 ``[M, 2]``, the (left, right) classes, always
    different; ``indices``: int64 ``[M, 2]``, the source digits.
  """
  images = np.asarray(images)
  labels = np.asarray(labels)
  if images.ndim != 4:
    raise ValueError(f'images must be [N, H, W, C], got shape {images.shape}.')
  if labels.shape != images.shape[:1]:
    raise ValueError(f'labels must be [N] = [{images.shape[0]}], got shape '
                     f'{labels.shape}.')
  left = np.arange(len(labels))
  right = np.random.default_rng(seed).permutation(len(labels))
  keep = labels[left] != labels[right]
  left, right = left[keep], right[keep]
  return {
      'image': np.concatenate([images[left], images[right]], axis=2),
      'labels': np.stack([labels[left], labels[right]], 1).astype(np.int32),
      'indices': np.stack([left, right], 1).astype(np.int64),
  }
