"""On-device augmentation: pure, jit-able functions of a PRNG key and a batch;
and the fixed canvases of the evaluation sets (``on_canvas``).

Shape legend: B batch, H and W image height and width, C channels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from capsjax.data.idx import Dataset
from capsjax.data.idx import Split


def to_float(images: ArrayLike) -> jax.Array:
  """uint8 ``[...]`` in 0-255 -> float32 ``[...]`` in [0, 1]."""
  return jnp.asarray(images).astype(jnp.float32) / 255.0


def center_crop(images: ArrayLike, size: int) -> jax.Array:
  """The central ``size x size`` window of each image.

  Top-left corner ``((H - size) // 2, (W - size) // 2)``; the digit
  pipelines' ``center_crop`` option and ``smallnorb_eval_preprocess``.

  Args:
    images: ``[B, H, W, C]`` with H, W >= size.
  Returns:
    ``[B, size, size, C]``, dtype of ``images``.
  """
  images = jnp.asarray(images)
  if images.ndim != 4 or min(images.shape[1:3]) < size or size < 1:
    raise ValueError(f'center_crop: expected [B, H, W, C] images with '
                     f'H, W >= {size} >= 1, got {images.shape}')
  top = (images.shape[1] - size) // 2
  left = (images.shape[2] - size) // 2
  return images[:, top:top + size, left:left + size]


def random_offsets(key: jax.Array, batch_size: int, max_shift: int
                   ) -> jax.Array:
  """int32 ``[B, 2]`` (dy, dx), each uniform in ``[-max_shift, max_shift]``.

  ``random_shift(key, ...)`` shifts by ``random_offsets(key, B, max_shift)``.
  """
  return jax.random.randint(key, (batch_size, 2), -max_shift, max_shift + 1)


def shift(images: ArrayLike, offsets: ArrayLike, max_shift: int) -> jax.Array:
  """Shifts each image by its own integer offset, filling with zeros.

  ``out[b, i, j] = images[b, i - dy, j - dx]`` where that index is inside the
  image, else 0 (positive dy moves content down, positive dx right). No
  wraparound.

  Args:
    images: ``[B, H, W, C]``.
    offsets: int ``[B, 2]`` (dy, dx), each in ``[-max_shift, max_shift]``
      (larger ones are clamped to that range by ``lax.dynamic_slice``).
    max_shift: static bound on the offsets: the zero padding width.
  Returns:
    ``[B, H, W, C]``, dtype of ``images``.
  """
  images = jnp.asarray(images)
  if images.ndim != 4:
    raise ValueError(f'expected [B, H, W, C] images, got {images.shape}')
  m = max_shift
  padded = jnp.pad(images, ((0, 0), (m, m), (m, m), (0, 0)))
  size = images.shape[1:]

  def one(image, offset):
    return jax.lax.dynamic_slice(image, (m - offset[0], m - offset[1], 0),
                                 size)

  return jax.vmap(one)(padded, jnp.asarray(offsets, jnp.int32))


def random_shift(key: jax.Array, images: ArrayLike, max_shift: int = 2
                 ) -> jax.Array:
  """Shifts each image by (dy, dx) uniform in ``[-max_shift, max_shift]^2``.

  The MNIST augmentation of Sabour et al. 2017 (up to 2 pixels, zero
  padding). Deterministic given ``key``; ``max_shift`` is static.

  Args:
    key: PRNG key.
    images: ``[B, H, W, C]``, any dtype.
  Returns:
    ``[B, H, W, C]``, dtype of ``images``.
  """
  images = jnp.asarray(images)
  if max_shift < 0:
    raise ValueError(f'max_shift must be >= 0, got {max_shift}')
  offsets = random_offsets(key, images.shape[0], max_shift)
  return shift(images, offsets, max_shift)


def place(images: ArrayLike, corners: ArrayLike, canvas_size: int
          ) -> jax.Array:
  """Pastes each image onto a black ``canvas_size`` square at its corner.

  Args:
    images: ``[B, h, w, C]``.
    corners: int ``[B, 2]`` top-left (row, column), in
      ``[0, canvas_size - h] x [0, canvas_size - w]``.
  Returns:
    ``[B, canvas_size, canvas_size, C]``, dtype of ``images``.
  """
  images = jnp.asarray(images)
  _, h, w, c = images.shape
  if h > canvas_size or w > canvas_size:
    raise ValueError(f'images {h}x{w} do not fit on a {canvas_size} canvas')
  # A window of a zero-padded image (a gather, like ``shift``) rather than a
  # scatter into a blank canvas: the same result, faster to compile.
  mh, mw = canvas_size - h, canvas_size - w
  padded = jnp.pad(images, ((0, 0), (mh, mh), (mw, mw), (0, 0)))
  size = (canvas_size, canvas_size, c)

  def one(image, corner):
    return jax.lax.dynamic_slice(image, (mh - corner[0], mw - corner[1], 0),
                                 size)

  return jax.vmap(one)(padded, jnp.asarray(corners, jnp.int32))


def place_on_canvas(key: jax.Array, images: ArrayLike, canvas_size: int = 40
                    ) -> jax.Array:
  """Each image at a uniformly random position on a black canvas.

  The affNIST training set of Sabour et al. 2017: MNIST digits placed at
  random on a 40x40 black background. The top-left corner is uniform over
  all ``(canvas_size - h + 1) x (canvas_size - w + 1)`` positions.

  Args:
    key: PRNG key.
    images: ``[B, h, w, C]`` with h, w <= canvas_size.
  Returns:
    ``[B, canvas_size, canvas_size, C]``, dtype of ``images``.
  """
  images = jnp.asarray(images)
  b, h, w, _ = images.shape
  limits = jnp.array([[canvas_size - h + 1, canvas_size - w + 1]])
  corners = jax.random.randint(key, (b, 2), 0, limits)
  return place(images, corners, canvas_size)


def on_canvas(split: Split, canvas_size: int, seed: int) -> Split:
  """Each digit of ``split`` at a random place on a black canvas
  (``place_on_canvas``), fixed by ``seed``."""
  if len(split.labels) == 0:
    return Split(
        np.zeros((0, canvas_size, canvas_size, split.images.shape[-1]),
                 np.uint8), split.labels)
  images = place_on_canvas(jax.random.key(seed), split.images, canvas_size)
  return Split(np.asarray(images), split.labels)


def dataset_on_canvas(dataset: Dataset, canvas_size: int, seed: int
                      ) -> Dataset:
  """The "expanded MNIST" of Sabour et al.: validation and test digits
  placed once on a canvas (keys ``seed`` and ``seed + 1``); training digits
  stay as they are, to be placed at random in each step."""
  return dataset._replace(
      validation=on_canvas(dataset.validation, canvas_size, seed),
      test=on_canvas(dataset.test, canvas_size, seed + 1),
      name=f'{dataset.name}_on_{canvas_size}x{canvas_size}')
