"""On-device augmentation: random shifts with zero padding, canvas placement."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capsjax.data import center_crop
from capsjax.data import place_on_canvas
from capsjax.data import random_shift
from capsjax.data import shift
from capsjax.data import to_float
from capsjax.data.augment import random_offsets
from capsjax.training import state as state_lib

# One compiled function per operation, shared by the tests (compiling is
# most of their cost).
shift_jit = jax.jit(random_shift, static_argnums=2)
offsets_jit = jax.jit(random_offsets, static_argnums=(1, 2))
place_jit = jax.jit(place_on_canvas)


def shift_ref(image, dy, dx):
  """np.roll, then zero the rows/columns that wrapped around."""
  out = np.roll(image, (dy, dx), axis=(0, 1))
  if dy > 0:
    out[:dy] = 0
  elif dy < 0:
    out[dy:] = 0
  if dx > 0:
    out[:, :dx] = 0
  elif dx < 0:
    out[:, dx:] = 0
  return out


@pytest.fixture(scope='module')
def images():
  # Strictly positive, so every zero in an output is padding.
  rng = np.random.default_rng(0)
  return rng.uniform(0.1, 1.0, (300, 28, 28, 1)).astype(np.float32)


def test_random_shift_matches_reference_with_zero_padding(images):
  key = jax.random.key(0)
  out = np.asarray(shift_jit(key, images, 2))
  assert out.shape == images.shape and out.dtype == np.float32
  offsets = np.asarray(offsets_jit(key, len(images), 2))
  for image, result, (dy, dx) in zip(images, out, offsets, strict=True):
    np.testing.assert_array_equal(result, shift_ref(image, dy, dx))
    # Vacated rows/columns are exactly 0, everything else is content.
    assert np.sum(result == 0) == 28 * 28 - (28 - abs(dy)) * (28 - abs(dx))


def test_shift_range_covers_all_offsets(images):
  offsets = np.asarray(offsets_jit(jax.random.key(1), 2000, 2))
  assert offsets.min() == -2 and offsets.max() == 2
  assert set(map(tuple, offsets)) == set(itertools.product(range(-2, 3),
                                                           repeat=2))
  # The amount of zero padding tells the shift: never more than 2 rows and
  # 2 columns.
  out = np.asarray(shift_jit(jax.random.key(1), images, 2))
  zero_rows = np.sum(np.all(out == 0, axis=(2, 3)), axis=1)
  zero_cols = np.sum(np.all(out == 0, axis=(1, 3)), axis=1)
  assert zero_rows.max() == 2 and zero_cols.max() == 2


def test_explicit_shift_directions():
  image = np.zeros((1, 5, 5, 1), np.uint8)
  image[0, 2, 2, 0] = 9
  out = np.asarray(shift(image, np.array([[1, -2]]), 2))
  assert out.dtype == np.uint8
  assert out[0, 3, 0, 0] == 9 and out.sum() == 9  # down 1, left 2


def test_determinism_dtype_and_identity(images):
  a = shift_jit(jax.random.key(5), images, 3)
  b = shift_jit(jax.random.key(5), images, 3)
  c = shift_jit(jax.random.key(6), images, 3)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  as_uint8 = (images * 255).astype(np.uint8)
  assert shift_jit(jax.random.key(0), as_uint8, 2).dtype == jnp.uint8
  np.testing.assert_array_equal(shift_jit(jax.random.key(0), images, 0),
                                images)


def test_random_shift_inside_a_jitted_step(images):
  @jax.jit
  def step(key, batch):
    key, sub = jax.random.split(key)
    return key, random_shift(sub, to_float(batch)).sum()

  batch = (images[:16] * 255).astype(np.uint8)
  _, total = step(jax.random.key(0), batch)
  assert np.isfinite(total) and total > 0


def test_place_on_canvas(images):
  batch = images[:200]
  out = np.asarray(place_jit(jax.random.key(0), batch))
  assert out.shape == (200, 40, 40, 1)
  corners = []
  for image, canvas in zip(batch, out, strict=True):
    rows = np.flatnonzero(np.any(canvas > 0, axis=(1, 2)))
    cols = np.flatnonzero(np.any(canvas > 0, axis=(0, 2)))
    top, left = rows[0], cols[0]
    assert len(rows) == 28 and len(cols) == 28
    np.testing.assert_array_equal(canvas[top:top + 28, left:left + 28], image)
    assert canvas.sum() == pytest.approx(image.sum(), rel=1e-6)
    corners.append((top, left))
  corners = np.array(corners)
  assert corners.min() == 0 and corners.max() == 12
  np.testing.assert_array_equal(
      place_jit(jax.random.key(0), batch), out)


def test_to_float():
  x = to_float(np.array([0, 51, 255], np.uint8))
  assert x.dtype == jnp.float32
  np.testing.assert_allclose(x, [0.0, 0.2, 1.0], rtol=1e-6)


def test_center_crop_keeps_the_central_window():
  x = np.arange(2 * 7 * 6 * 1).reshape(2, 7, 6, 1)
  out = np.asarray(center_crop(x, 4))
  # Top-left ((7 - 4) // 2, (6 - 4) // 2) = (1, 1).
  np.testing.assert_array_equal(out, x[:, 1:5, 1:5])
  np.testing.assert_array_equal(center_crop(x, 6)[:, :, :, 0],
                                x[:, :6, :, 0])
  for size in (0, 7):
    with pytest.raises(ValueError, match='H, W >= '):
      center_crop(x, size)


def test_digit_inputs_shift_then_crop():
  """Training shifts the 28x28 digit, then both paths crop the centre."""
  images = (np.arange(2 * 28 * 28) % 256).astype(np.uint8).reshape(2, 28, 28, 1)
  key = jax.random.key(3)
  train = state_lib.digit_inputs(images, key, 2, center_crop=20)
  shifted = random_shift(key, to_float(images), 2)
  np.testing.assert_array_equal(train, shifted[:, 4:24, 4:24])
  evaluation = state_lib.digit_inputs(images, None, 2, center_crop=20)
  np.testing.assert_allclose(evaluation, images[:, 4:24, 4:24] / 255.0,
                             rtol=1e-6)
