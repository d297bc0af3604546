"""On-device augmentation: pure, jit-able functions of a PRNG key and a batch;
and the fixed canvases of the evaluation sets (``on_canvas``).

Shape legend: B batch, H and W image height and width, C channels.
"""

from __future__ import annotations

import functools

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


# ----------------------------------------------------------------------------
# Efficient-CapsNet's MNIST augmentation (Mazzia, Salvetti, Chiaberge 2021),
# as the authors' utils/pre_process_mnist.py draws it for each training
# image: a rotation, a shift within the digit's margins, a horizontal
# squeeze, a 4x4 erased patch, in that order.

# The largest rotation: int(30 * r) for |r| <= 0.9999 (OpenCV takes the
# angle in whole degrees).
EFFICIENT_MAX_DEGREES = 29
# OpenCV's warpAffine (before 4.11) places each sample on a grid of 1/32
# pixel (INTER_BITS), from coordinates in fixed point of 1/1024 pixel.
_INTER_BITS = 5
_AB_BITS = 10


@functools.lru_cache(maxsize=8)
def _opencv_rotation_offsets(height: int, width: int, max_degrees: int
                             ) -> np.ndarray:
  """int32 [2 * max_degrees + 1, 2, 2, max(H, W)]: for each whole angle
  -max_degrees..max_degrees, the fixed-point source coordinates (x, y) that
  OpenCV's warpAffine sums per output column (adelta, bdelta: [.., 0, :, x])
  and per output row (X0, Y0 with its rounding offset: [.., 1, :, y]).

  In float64, as OpenCV: getRotationMatrix2D about (W/2, H/2), inverted as
  warpAffine inverts it, products scaled by 1024 and rounded half to even.
  """
  scale = 1 << _AB_BITS
  round_delta = scale >> (_INTER_BITS + 1)
  size = max(height, width)
  out = np.zeros((2 * max_degrees + 1, 2, 2, size), np.int64)
  cx, cy = width / 2, height / 2
  for k, degrees in enumerate(range(-max_degrees, max_degrees + 1)):
    alpha, beta = np.cos(np.deg2rad(degrees)), np.sin(np.deg2rad(degrees))
    m = [alpha, beta, (1 - alpha) * cx - beta * cy,
         -beta, alpha, beta * cx + (1 - alpha) * cy]
    det = m[0] * m[4] - m[1] * m[3]
    det = 1.0 / det if det else 0.0
    m[0], m[4] = m[4] * det, m[0] * det
    m[1], m[3] = -m[1] * det, -m[3] * det
    m[2], m[5] = (-m[0] * m[2] - m[1] * m[5], -m[3] * m[2] - m[4] * m[5])
    i = np.arange(size)
    out[k, 0, 0] = np.rint(m[0] * i * scale)
    out[k, 0, 1] = np.rint(m[3] * i * scale)
    out[k, 1, 0] = np.rint((m[1] * i + m[2]) * scale) + round_delta
    out[k, 1, 1] = np.rint((m[4] * i + m[5]) * scale) + round_delta
  return out.astype(np.int32)


def rotate_opencv(images: ArrayLike, degrees: ArrayLike,
                  max_degrees: int = EFFICIENT_MAX_DEGREES) -> jax.Array:
  """Each image rotated by its own whole number of degrees, as OpenCV's
  ``warpAffine(image, getRotationMatrix2D((W/2, H/2), degrees, 1), (W, H))``
  computes it (counter-clockwise for positive degrees; the centre is the
  corner between the four middle pixels' top-left one and its
  neighbours, (14, 14) on MNIST, not the image's centre (13.5, 13.5)).

  Bilinear, zeros outside, and each sample position rounded to 1/32 pixel
  as OpenCV did until 4.11 (the authors' 2021 code; OpenCV 4.11 on
  interpolates at the exact position: up to 0.02 apart on MNIST digits).

  Args:
    images: [B, H, W, C] float.
    degrees: int [B] in [-max_degrees, max_degrees] (static bound; larger
      angles are clipped to it).
  Returns:
    [B, H, W, C], dtype of ``images``.
  """
  images = jnp.asarray(images)
  b, h, w, _ = images.shape
  table = jnp.asarray(_opencv_rotation_offsets(h, w, max_degrees))
  index = jnp.clip(jnp.asarray(degrees, jnp.int32), -max_degrees,
                   max_degrees) + max_degrees
  per_column, per_row = table[index, 0], table[index, 1]  # [B, 2, size]
  shift = _AB_BITS - _INTER_BITS
  # [B, H, W] source coordinates in 1/32 pixel (arithmetic shifts floor).
  x = (per_row[:, 0, :h, None] + per_column[:, 0, None, :w]) >> shift
  y = (per_row[:, 1, :h, None] + per_column[:, 1, None, :w]) >> shift
  steps = 1 << _INTER_BITS
  x0, y0 = x >> _INTER_BITS, y >> _INTER_BITS
  fx = ((x & (steps - 1)) / steps).astype(images.dtype)[..., None]
  fy = ((y & (steps - 1)) / steps).astype(images.dtype)[..., None]

  def tap(rows, cols):
    inside = (rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)
    batch = jnp.arange(b)[:, None, None]
    values = images[batch, jnp.clip(rows, 0, h - 1), jnp.clip(cols, 0, w - 1)]
    return jnp.where(inside[..., None], values, 0)

  return ((1 - fy) * ((1 - fx) * tap(y0, x0) + fx * tap(y0, x0 + 1)) +
          fy * ((1 - fx) * tap(y0 + 1, x0) + fx * tap(y0 + 1, x0 + 1)))


def margin_shift(images: ArrayLike, amounts: ArrayLike, directions: ArrayLike
                 ) -> jax.Array:
  """The authors' ``image_shift_rand``: each image moved within its
  margins, the empty rows and columns around its content.

  Horizontally by floor(-a_x * left) (``directions[:, 1]`` 0) or
  floor(a_x * (1 + right)) (1), vertically likewise with a_y, top, bottom
  and ``directions[:, 0]``; a roll, as theirs, whose wrapped rows and columns
  are empty ones (for a < 1 the content never wraps, for images >= 0). An
  all-zero image stays.

  Args:
    images: [B, H, W, C], >= 0 (a pixel is content where its row or column
      sums to more than 0 over W x C or H x C).
    amounts: [B, 2] (a_x, a_y) in [0, 1).
    directions: int [B, 2] in {0, 1}: (vertical, horizontal).
  Returns:
    [B, H, W, C], dtype of ``images``.
  """
  images = jnp.asarray(images)
  _, h, w, _ = images.shape
  amounts = jnp.asarray(amounts, jnp.float32)
  directions = jnp.asarray(directions, jnp.int32)

  def margins(content, size):  # content: bool [B, size]
    index = jnp.arange(size)
    first = jnp.min(jnp.where(content, index, size), axis=-1)
    last = jnp.max(jnp.where(content, index, -1), axis=-1)
    empty = ~jnp.any(content, axis=-1)
    return (jnp.where(empty, 0, first),
            jnp.where(empty, 0, size - 1 - last))

  left, right = margins(jnp.sum(images, axis=(1, 3)) > 0, w)
  top, bottom = margins(jnp.sum(images, axis=(2, 3)) > 0, h)

  def amount(a, before, after, direction):
    back = jnp.floor(-a * before.astype(jnp.float32))
    forth = jnp.floor(a * (1 + after).astype(jnp.float32))
    return jnp.where(direction == 0, back, forth).astype(jnp.int32)

  dx = amount(amounts[:, 0], left, right, directions[:, 1])
  dy = amount(amounts[:, 1], top, bottom, directions[:, 0])
  return jax.vmap(lambda image, rows, cols: jnp.roll(
      image, (rows, cols), axis=(0, 1)))(images, dy, dx)


def squeeze_width(images: ArrayLike, amounts: ArrayLike) -> jax.Array:
  """The authors' ``image_squish_random``: each image resized narrower
  (Lanczos-3 with antialiasing, ``tf.image.resize``'s) and placed at a
  column offset, the columns left over zeros.

  With (a, b) = ``amounts``: n = floor(a W / 4 + 1) columns fewer (1 to
  W/4 + 1, at least 1: every image is squeezed), placed from column
  n // 2 + floor(2 b). One ``jax.image.scale_and_translate`` per image
  (TF's ScaleAndTranslate, which tf.image.resize calls), along the width
  only: the authors' resize keeps the height, where Lanczos-3 at scale 1 is
  the identity.

  Args:
    images: [B, H, W, C] float.
    amounts: [B, 2] in [0, 1).
  Returns:
    [B, H, W, C], dtype of ``images``.
  """
  images = jnp.asarray(images)
  _, _, w, _ = images.shape
  amounts = jnp.asarray(amounts, jnp.float32)
  removed = jnp.floor(amounts[:, 0] * (w / 4) + 1).astype(jnp.int32)
  offset = removed // 2 + jnp.floor(amounts[:, 1] * 2).astype(jnp.int32)
  scale = (w - removed).astype(jnp.float32) / w

  def one(image, s, t):
    return jax.image.scale_and_translate(
        image, image.shape, (1,), s[None], t[None], 'lanczos3',
        antialias=True)

  # float32: the input pipeline's resampling, before the model's compute
  # dtype (the images are float32 until the model casts them).
  return jax.vmap(one)(images, scale,
                       offset.astype(jnp.float32)).astype(images.dtype)


def erase(images: ArrayLike, corners: ArrayLike, size: int = 4) -> jax.Array:
  """Each image with a ``size`` x ``size`` square set to 0, its top-left
  pixel at ``corners`` (row, column): the authors' ``image_erase_random``.

  Args:
    images: [B, H, W, C].
    corners: int [B, 2].
  Returns:
    [B, H, W, C], dtype of ``images``.
  """
  images = jnp.asarray(images)
  _, h, w, _ = images.shape
  corners = jnp.asarray(corners, jnp.int32)
  rows = jnp.arange(h)[None, :] - corners[:, :1]  # [B, H]
  cols = jnp.arange(w)[None, :] - corners[:, 1:]  # [B, W]
  inside = (((rows >= 0) & (rows < size))[:, :, None] &
            ((cols >= 0) & (cols < size))[:, None, :])
  return jnp.where(inside[..., None], jnp.zeros((), images.dtype), images)


def efficient_capsnet_draws(key: jax.Array, batch_size: int, height: int = 28,
                            width: int = 28) -> dict[str, jax.Array]:
  """The random numbers of ``efficient_capsnet_augment``, as the authors'
  functions draw them for each image (normals of std 0.33):

  'degrees' int [B]: int(30 r) with r a normal clipped to +-0.9999, or 0 when
    a second such normal is > 0 (half the images keep their angle);
  'shift_amounts' [B, 2]: |normal| capped at 0.9999;
  'shift_directions' int [B, 2]: floor(2 u), u uniform in [0, 1);
  'squeeze_amounts' [B, 2]: |normal| capped at 0.9999;
  'erase_corners' int [B, 2]: floor(u (H - 9)) + 4 and floor(u (W - 9)) + 4
    (rows and columns 4 to 22 on MNIST).
  """
  keys = jax.random.split(key, 5)
  shape = (batch_size, 2)
  rotation = jnp.clip(0.33 * jax.random.normal(keys[0], shape), -0.9999,
                      0.9999)
  degrees = jnp.trunc(rotation[:, 0] * 30).astype(jnp.int32)

  def capped(k):
    return jnp.minimum(jnp.abs(0.33 * jax.random.normal(k, shape)), 0.9999)

  corner = jax.random.uniform(keys[4], shape)
  return {
      'degrees': jnp.where(rotation[:, 1] > 0, 0, degrees),
      'shift_amounts': capped(keys[1]),
      'shift_directions': jnp.floor(
          2 * jax.random.uniform(keys[2], shape)).astype(jnp.int32),
      'squeeze_amounts': capped(keys[3]),
      'erase_corners': (jnp.floor(corner * jnp.array([[height - 9, width - 9]]))
                        + 4).astype(jnp.int32),
  }


def efficient_capsnet_augment(key: jax.Array, images: ArrayLike
                              ) -> jax.Array:
  """Efficient-CapsNet's MNIST training augmentation: ``rotate_opencv``,
  ``margin_shift``, ``squeeze_width``, ``erase``, in the authors' order,
  with ``efficient_capsnet_draws(key, ...)``. Deterministic given ``key``.

  Args:
    key: PRNG key.
    images: [B, H, W, C] float in [0, 1] (the authors scale pixels by 1/256,
      capsjax by 1/255).
  Returns:
    [B, H, W, C], dtype of ``images``.
  """
  images = jnp.asarray(images)
  b, h, w, _ = images.shape
  draws = efficient_capsnet_draws(key, b, h, w)
  images = rotate_opencv(images, draws['degrees'])
  images = margin_shift(images, draws['shift_amounts'],
                        draws['shift_directions'])
  images = squeeze_width(images, draws['squeeze_amounts'])
  return erase(images, draws['erase_corners'])
