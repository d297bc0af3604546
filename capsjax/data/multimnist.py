"""MultiMNIST (Sabour et al. 2017, section 6): two overlaid digits.

Each example overlays two digits of DIFFERENT classes from the same split.
Each digit is put in the centre of a 36x36 black canvas and shifted by up to
4 pixels in each direction (zero padding; the canvas is exactly large enough,
so nothing is cut off); the image is the pixelwise sum clipped to [0, 1]. The
paper reports about 80% overlap on average.

For training, ``multimnist_batch`` draws each batch on the device from the
digits; validation and test are fixed sets (``load_multimnist``), packed
into uint8 (``pack_pairs``, ``unpack_pairs``).

Shape legend: N digits in the source split, B the batch, M pairs of a fixed
set, S = 36 the canvas side.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from capsjax.data.augment import place
from capsjax.data.augment import to_float
from capsjax.data.idx import Dataset
from capsjax.data.idx import Split
from capsjax.data.mnist import load_mnist

CANVAS_SIZE = 36
MAX_SHIFT = 4
NUM_CLASSES = 10
# Examples generated per compiled call in multimnist_test_set. Part of the
# recipe: changing it changes which pairs a seed gives.
TEST_SET_CHUNK = 1000


def _check_classes(labels: ArrayLike, num_classes: int) -> None:
  if isinstance(labels, np.ndarray):
    counts = np.bincount(labels.astype(np.int64), minlength=num_classes)
    if len(counts) != num_classes or np.any(counts == 0):
      raise ValueError(f'every class 0..{num_classes - 1} needs at least one '
                       f'image; counts {counts.tolist()}')


def multimnist_batch(key: jax.Array, images: ArrayLike, labels: ArrayLike,
                     batch_size: int, *, max_shift: int = MAX_SHIFT,
                     canvas_size: int = CANVAS_SIZE,
                     num_classes: int = NUM_CLASSES) -> dict[str, jax.Array]:
  """A random batch of MultiMNIST examples, generated on device.

  The first digit is uniform over the split. The second's class is the
  first's plus an offset uniform in 1..num_classes-1 (mod num_classes), so it
  always differs, with no rejection loop; its image is uniform among that
  class's images, found through a class-sorted index table computed here
  (an argsort of N labels per call: pass device arrays, e.g.
  ``jax.device_put(images)``, to avoid a host transfer per call). Every class
  must have at least one image (checked when ``labels`` is a NumPy array).
  Deterministic given ``key``; jit-able with ``batch_size`` and the keyword
  options static.

  Args:
    key: PRNG key.
    images: uint8 ``[N, h, w, 1]`` digits (28x28 MNIST).
    labels: int ``[N]`` in ``[0, num_classes)``.
    batch_size: B.

  Returns:
    ``image``: float32 ``[B, S, S, 1]`` in [0, 1], ``clip(first + second)``
    with S = canvas_size; ``labels``: int32 ``[B, 2]``, the first and second
    digit's classes (always different); ``first``, ``second``: float32
    ``[B, S, S, 1]``, each shifted digit alone (reconstruction targets).
  """
  images = jnp.asarray(images)
  _check_classes(labels, num_classes)
  labels = jnp.asarray(labels).astype(jnp.int32)
  n, h, w, _ = images.shape
  if canvas_size < max(h, w) + 2 * max_shift:
    raise ValueError(f'a {canvas_size} canvas cannot hold {h}x{w} digits '
                     f'shifted by up to {max_shift}')
  first_key, offset_key, pick_key, shift_key = jax.random.split(key, 4)
  order = jnp.argsort(labels, stable=True)
  counts = jnp.bincount(labels, length=num_classes)
  starts = jnp.cumsum(counts) - counts

  first = jax.random.randint(first_key, (batch_size,), 0, n)
  first_label = labels[first]
  class_offset = jax.random.randint(offset_key, (batch_size,), 1, num_classes)
  second_label = (first_label + class_offset) % num_classes
  within = jax.random.randint(pick_key, (batch_size,), 0,
                              counts[second_label])
  second = order[starts[second_label] + within]

  centre = jnp.array([[(canvas_size - h) // 2, (canvas_size - w) // 2]])
  shifts = jax.random.randint(shift_key, (2, batch_size, 2), -max_shift,
                              max_shift + 1)
  first_image = place(to_float(images[first]), centre + shifts[0],
                      canvas_size)
  second_image = place(to_float(images[second]), centre + shifts[1],
                       canvas_size)
  return {
      'image': jnp.clip(first_image + second_image, 0.0, 1.0),
      'labels': jnp.stack([first_label, second_label], axis=1),
      'first': first_image,
      'second': second_image,
  }


_multimnist_batch_jit = jax.jit(
    multimnist_batch,
    static_argnames=('batch_size', 'max_shift', 'canvas_size', 'num_classes'))


def multimnist_test_set(images: ArrayLike, labels: ArrayLike,
                        num_pairs: int, seed: int, *,
                        max_shift: int = MAX_SHIFT,
                        canvas_size: int = CANVAS_SIZE,
                        num_classes: int = NUM_CLASSES
                        ) -> dict[str, np.ndarray]:
  """A fixed MultiMNIST set (use the test split), deterministic by ``seed``.

  Generated as ``multimnist_batch`` in chunks of ``TEST_SET_CHUNK`` with key
  ``fold_in(key(seed), chunk_index)``. Memory: about 15.6 KB per example
  (three float32 36x36 images).

  Args:
    images: uint8 ``[N, 28, 28, 1]``.
    labels: int ``[N]``.
    num_pairs: number of examples M.
    seed: int.

  Returns:
    The keys of ``multimnist_batch`` as NumPy arrays with M examples.
  """
  _check_classes(np.asarray(labels), num_classes)
  make = functools.partial(
      _multimnist_batch_jit, batch_size=TEST_SET_CHUNK, max_shift=max_shift,
      canvas_size=canvas_size, num_classes=num_classes)
  key = jax.random.key(seed)
  images, labels = jax.device_put(images), jax.device_put(labels)
  chunks = [jax.device_get(make(jax.random.fold_in(key, i), images, labels))
            for i in range(math.ceil(num_pairs / TEST_SET_CHUNK))]
  if not chunks:
    chunks = [jax.device_get(make(key, images, labels))]
  return {k: np.concatenate([c[k] for c in chunks])[:num_pairs]
          for k in chunks[0]}


def pack_pairs(pairs: dict[str, np.ndarray]) -> Split:
  """A ``multimnist_test_set`` as a Split: uint8 [M, S, S, 3] images with
  channels (overlay, first digit, second digit), int32 [M, 2] labels.

  Every pixel is a multiple of 1/255 (digits are uint8 / 255, the overlay
  their sum clipped to 1), so this keeps them up to float32 rounding, in a
  quarter of the float32 memory.
  """
  channels = np.concatenate([pairs['image'], pairs['first'], pairs['second']],
                            axis=-1)
  images = np.rint(channels * 255.0).astype(np.uint8)
  return Split(images, pairs['labels'].astype(np.int32))


def unpack_pairs(images: jax.Array) -> tuple[jax.Array, jax.Array]:
  """uint8 [B, S, S, 3] from ``pack_pairs`` -> float inputs [B, S, S, 1] and
  digits [B, 2, S, S, 1]."""
  images = to_float(images)
  digits = jnp.moveaxis(images[..., 1:], -1, 1)[..., None]
  return images[..., :1], digits


def multimnist_pairs(split: Split, num_pairs: int, seed: int,
                     max_shift: int = MAX_SHIFT) -> Split:
  """A fixed packed MultiMNIST set from a digit split (empty if either is)."""
  if num_pairs == 0 or len(split.labels) == 0:
    return Split(np.zeros((0, CANVAS_SIZE, CANVAS_SIZE, 3), np.uint8),
                 np.zeros((0, 2), np.int32))
  return pack_pairs(multimnist_test_set(
      split.images, split.labels, num_pairs, seed, max_shift=max_shift))


def load_multimnist(*, data_dir: str | None, validation_size: int,
                    validation_pairs: int, test_pairs: int, seed: int,
                    max_shift: int = MAX_SHIFT) -> Dataset:
  """MultiMNIST for training: the MNIST training digits (pairs are drawn
  per batch, ``multimnist_batch``) and fixed packed pair sets.

  Validation: ``validation_pairs`` pairs of validation-split digits (key
  ``seed``); test: ``test_pairs`` pairs of test-split digits (key ``seed +
  1``), the same for every training seed.
  """
  mnist = load_mnist('mnist', data_dir=data_dir,
                     validation_size=validation_size)
  return Dataset(
      mnist.train,
      multimnist_pairs(mnist.validation, validation_pairs, seed, max_shift),
      multimnist_pairs(mnist.test, test_pairs, seed + 1, max_shift),
      mnist.num_classes, 'multimnist')
