"""Su's two-digit test set: two different test digits in one image.

From Su Jianlin's 2018 post 揭开迷雾，来一顿美味的Capsule盛宴
("Lifting the fog: a Capsule feast").

Shape legend: N digits in the source split, M pairs kept, H x W x C a digit.
"""

from __future__ import annotations

import numpy as np
from jax.typing import ArrayLike

# 'stacked': one digit above the other (2H x W, 56x28 for MNIST), as Su's
# code joins them; 'side_by_side': left and right (H x 2W), a harder variant.
PAIR_LAYOUTS = ('stacked', 'side_by_side')


def digit_pairs(images: ArrayLike, labels: ArrayLike, seed: int,
                layout: str = 'stacked') -> dict[str, np.ndarray]:
  """Each digit joined with a partner of another class, deterministic by ``seed``.

  Su's recipe (``np.concatenate([x_test, x_test[idx]], 1)`` on [N, 28, 28, 1]
  arrays): pair digit i (first) with digit perm[i] (second) for a random
  permutation ``perm`` of the split, and keep the pairs whose classes differ
  (about 90% of them for MNIST). Every digit is first in one pair at most
  and second in one pair at most; the kept pairs are in the order of their
  first digits. Both layouts give the same pairs for the same seed.

  Args:
    images: ``[N, H, W, C]`` digits, any dtype (uint8 for MNIST).
    labels: int ``[N]``.
    seed: seed of the permutation (``np.random.default_rng(seed)``).
    layout: 'stacked' (the first digit on top) or 'side_by_side' (the first
      on the left).

  Returns:
    ``image``: ``[M, 2H, W, C]`` stacked or ``[M, H, 2W, C]`` side by side,
    dtype of ``images``; ``labels``: int32 ``[M, 2]``, the (first, second)
    classes, always different; ``indices``: int64 ``[M, 2]``, the source
    digits.
  """
  images = np.asarray(images)
  labels = np.asarray(labels)
  if layout not in PAIR_LAYOUTS:
    raise ValueError(f'layout must be one of {PAIR_LAYOUTS}, got {layout!r}.')
  if images.ndim != 4:
    raise ValueError(f'images must be [N, H, W, C], got shape {images.shape}.')
  if labels.shape != images.shape[:1]:
    raise ValueError(f'labels must be [N] = [{images.shape[0]}], got shape '
                     f'{labels.shape}.')
  first = np.arange(len(labels))
  second = np.random.default_rng(seed).permutation(len(labels))
  keep = labels[first] != labels[second]
  first, second = first[keep], second[keep]
  axis = 1 if layout == 'stacked' else 2
  return {
      'image': np.concatenate([images[first], images[second]], axis=axis),
      'labels': np.stack([labels[first], labels[second]], 1).astype(np.int32),
      'indices': np.stack([first, second], 1).astype(np.int64),
  }


def blank_fields(images: ArrayLike, field: int = 14, stride: int = 2,
                 threshold: float = 0) -> np.ndarray:
  """Which receptive fields of a conv trunk see no ink at all.

  Output position (r, c) of a trunk whose receptive field is ``field`` x
  ``field`` at ``stride`` (Su's trunk: 14 and 2) sees the input window
  rows [r*stride, r*stride + field), columns likewise. A window with no
  pixel above ``threshold`` in any channel is blank. In Su's capsule model
  every position is an input capsule, so each blank window casts the same
  vote, whatever the digits.

  Args:
    images: ``[M, H, W, C]``, H, W >= ``field``.
  Returns:
    bool ``[M, (H - field) // stride + 1, (W - field) // stride + 1]``.
  """
  images = np.asarray(images)
  if images.ndim != 4 or min(images.shape[1:3]) < field:
    raise ValueError(f'images must be [M, H, W, C] with H, W >= {field}, got '
                     f'shape {images.shape}.')
  ink = (images > threshold).any(axis=-1).astype(np.int32)
  # Integral image: the ink count of any window from four corners.
  total = np.pad(ink.cumsum(1).cumsum(2), ((0, 0), (1, 0), (1, 0)))
  rows = np.arange(0, images.shape[1] - field + 1, stride)
  cols = np.arange(0, images.shape[2] - field + 1, stride)
  r, c = rows[:, None], cols[None, :]
  count = (total[:, r + field, c + field] - total[:, r, c + field] -
           total[:, r + field, c] + total[:, r, c])
  return count == 0
