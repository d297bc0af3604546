"""affNIST: the official .mat release, and the affNIST recipe applied to MNIST.

The release (https://www.cs.toronto.edu/~tijmen/affNIST/) holds MATLAB v5
.mat files (``test.mat``, ``test_batches/1.mat`` .. ``32.mat``, also for
training, validation, training_and_validation; distributed zipped) with a
struct ``affNISTdata``; the fields used here are ``image``, uint8
``[1600, N]``, and ``label_int``, ``[1, N]``.

Pixel order: each column of ``image`` is one 40x40 image in ROW-MAJOR (C)
order, pixel (row r, column c) at index ``40 r + c``; so the images are
``image.T.reshape(N, 40, 40)``. This is how the public loaders read the
release (transpose, then a C-order reshape) and they show upright digits;
a Fortran-order reshape would give transposed digits. The tests write files
the same way (``images.reshape(N, 1600).T``).

``affine_mnist`` applies the affNIST recipe to MNIST digits (e.g. the test
split) when the release is not at hand.
"""

from __future__ import annotations

import functools
import io
import math
import os
import re
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy import ndimage
from jax.typing import ArrayLike

from capsjax.data.idx import PathLike
from capsjax.data.idx import Split
from capsjax.data.idx import data_error

IMAGE_SIZE = 40
STRUCT = 'affNISTdata'
_FIX = ('Re-download it from https://www.cs.toronto.edu/~tijmen/affNIST/ '
        '(and unzip it, or pass the .mat.zip).')

# The affNIST transformations (Tieleman's description of the dataset).
MAX_ROTATION_DEGREES = 20.0
MAX_SHEAR = 0.2
SCALE_RANGE = (0.8, 1.2)


def _loadmat(source, path: PathLike) -> dict:
  try:
    from scipy import io as scipy_io
  except ImportError as e:
    raise ImportError('reading affNIST .mat files needs scipy: '
                      'pip install scipy') from e
  try:
    return scipy_io.loadmat(source)
  except Exception as e:  # scipy raises many kinds on corrupt files
    raise data_error(path, f'not a readable MATLAB .mat file '
                     f'({type(e).__name__}: {e})', _FIX) from e


def _whole_numbers_in(values: np.ndarray, low: int, high: int) -> bool:
  """Every entry of the real array ``values`` is an integer in [low, high]."""
  if not (np.issubdtype(values.dtype, np.integer) or
          np.issubdtype(values.dtype, np.floating) or values.dtype == bool):
    return False
  with np.errstate(invalid='ignore'):  # NaN compares False: rejected
    return bool(np.all((values >= low) & (values <= high) &
                       (values == np.floor(values))))


def read_affnist_mat(path: PathLike) -> Split:
  """Reads one release file (``.mat``, or a ``.zip`` holding one ``.mat``).

  Returns:
    ``Split`` with uint8 ``[N, 40, 40, 1]`` images, int32 ``[N]`` labels.

  Raises:
    DataError: not a .mat file, no ``affNISTdata`` struct, or bad shapes.
  """
  if os.fspath(path).endswith('.zip'):
    try:
      with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith('.mat')]
        content = archive.read(names[0]) if len(names) == 1 else None
    except Exception as e:  # zipfile raises many kinds on corrupt archives
      raise data_error(path, f'not a readable zip file ({type(e).__name__}: '
                       f'{e})', _FIX) from e
    if content is None:
      raise data_error(path, f'expected one .mat file in the zip, found '
                       f'{names}', _FIX)
    mat = _loadmat(io.BytesIO(content), path)
  else:
    mat = _loadmat(path, path)
  if STRUCT not in mat:
    raise data_error(path, f'no {STRUCT!r} struct (variables: '
                     f'{sorted(k for k in mat if not k.startswith("__"))})',
                     _FIX)
  record = mat[STRUCT]
  if isinstance(record, np.ndarray) and record.dtype.names is not None:
    record = record.reshape(-1)[0]
  try:
    image = np.asarray(record['image'])
    label = np.asarray(record['label_int']).reshape(-1)
  except (KeyError, ValueError, IndexError, TypeError) as e:
    raise data_error(path, f"{STRUCT} lacks the fields 'image' and "
                     "'label_int'", _FIX) from e
  if image.ndim != 2 or image.shape[0] != IMAGE_SIZE ** 2:
    raise data_error(path, f'expected image [1600, N], got {image.shape}',
                     _FIX)
  if len(label) != image.shape[1]:
    raise data_error(path, f'{len(label)} labels for {image.shape[1]} '
                     'images', _FIX)
  if not _whole_numbers_in(label, 0, 9):
    raise data_error(path, f'labels outside 0-9 or not whole numbers '
                     f'({label.dtype})', _FIX)
  # Any other pixel value would wrap or round silently in the uint8 cast.
  if not _whole_numbers_in(image, 0, 255):
    raise data_error(path, f'pixels outside 0-255 or not whole numbers '
                     f'({image.dtype}; the release has uint8)', _FIX)
  images = image.T.reshape(-1, IMAGE_SIZE, IMAGE_SIZE, 1)
  return Split(np.ascontiguousarray(images, np.uint8), label.astype(np.int32))


def _batch_files(directory: Path) -> list[Path]:
  numbered = [p for p in directory.glob('*.mat') if re.fullmatch(r'\d+', p.stem)]
  return sorted(numbered, key=lambda p: int(p.stem))


def affnist_files(path_or_dir: PathLike, split: str = 'test') -> list[Path]:
  """The release files ``load_affnist`` reads, in order, without reading
  them; FileNotFoundError saying what is missing and where to get it.

  Args:
    path_or_dir: a release file (``test.mat``, ``test_batches/7.mat``,
      ``test.mat.zip``), or a directory holding ``<split>.mat`` (or
      ``.mat.zip``), or ``<split>_batches/`` with numbered files, or the
      numbered files themselves (concatenated in numeric order).
    split: 'test', 'training', 'validation' or 'training_and_validation';
      used only for a directory.
  """
  path = Path(path_or_dir).expanduser()
  if path.is_file():
    return [path]
  if not path.is_dir():
    raise FileNotFoundError(f'{path}: no such affNIST file or directory')
  for name in (f'{split}.mat', f'{split}.mat.zip'):
    if (path / name).is_file():
      return [path / name]
  batches = _batch_files(path / f'{split}_batches') or _batch_files(path)
  if not batches:
    raise FileNotFoundError(
        f'{path}: found neither {split}.mat, {split}.mat.zip, '
        f'{split}_batches/<n>.mat nor <n>.mat files. Download affNIST from '
        'https://www.cs.toronto.edu/~tijmen/affNIST/ and unzip it there.')
  return batches


def load_affnist(path_or_dir: PathLike, *, split: str = 'test') -> Split:
  """affNIST images and labels from the release (``affnist_files`` says
  which files).

  Returns:
    ``Split`` with uint8 ``[N, 40, 40, 1]`` images and int32 ``[N]`` labels.
  """
  parts = [read_affnist_mat(p) for p in affnist_files(path_or_dir, split)]
  if len(parts) == 1:
    return parts[0]
  return Split(np.concatenate([p.images for p in parts]),
               np.concatenate([p.labels for p in parts]))


# ----------------------------------------------------------------------------
# The affNIST recipe on MNIST digits.


def affine_matrix(rotation: ArrayLike, shear: ArrayLike, scale: ArrayLike
                  ) -> jax.Array:
  """The 2x2 map R(rotation) @ Shear(shear) @ diag(scale), in (x, y).

  x is the column, y the row (pointing down). Shear(s) = [[1, s], [0, 1]]
  (x += s y). The output point is ``A (p - centre) + centre + t``.

  Args:
    rotation: ``[...]`` radians.
    shear: ``[...]``.
    scale: ``[..., 2]`` (scale_x, scale_y).
  Returns:
    ``[..., 2, 2]``.
  """
  rotation, shear, scale = map(jnp.asarray, (rotation, shear, scale))
  cos, sin = jnp.cos(rotation), jnp.sin(rotation)
  one, zero = jnp.ones_like(shear), jnp.zeros_like(shear)
  r = jnp.stack([jnp.stack([cos, -sin], -1), jnp.stack([sin, cos], -1)], -2)
  s = jnp.stack([jnp.stack([one, shear], -1), jnp.stack([zero, one], -1)], -2)
  # M @ diag(scale) scales the columns of M.
  return (r @ s) * scale[..., None, :]


@jax.jit
def warp(canvas: ArrayLike, matrix: ArrayLike, translation: ArrayLike
         ) -> jax.Array:
  """Bilinear affine warp of one image about its centre, zeros outside.

  ``out(p) = canvas(A^-1 (p - c - t) + c)`` with c the centre
  ``((W - 1) / 2, (H - 1) / 2)``, p = (x, y) = (column, row).

  Args:
    canvas: ``[H, W]`` float.
    matrix: ``[2, 2]`` A, in (x, y).
    translation: ``[2]`` t = (tx, ty) in pixels.
  Returns:
    float32 ``[H, W]``.
  """
  canvas = jnp.asarray(canvas, jnp.float32)
  h, w = canvas.shape
  centre = jnp.array([[[(w - 1) / 2, (h - 1) / 2]]])  # [1, 1, 2]
  translation = jnp.reshape(translation, (1, 1, 2))
  y, x = jnp.meshgrid(jnp.arange(h, dtype=jnp.float32),
                      jnp.arange(w, dtype=jnp.float32), indexing='ij')
  points = jnp.stack([x, y], -1) - centre - translation  # [H, W, 2]
  source = points @ jnp.linalg.inv(matrix).T + centre
  return ndimage.map_coordinates(canvas, [source[..., 1], source[..., 0]],
                                 order=1, mode='constant', cval=0.0)


def _ink_corners(canvas: jax.Array) -> jax.Array:
  """(x, y) corners ``[4, 2]`` of the box of nonzero pixels (whole canvas if
  there are none)."""
  h, w = canvas.shape
  rows, cols = jnp.any(canvas > 0, axis=1), jnp.any(canvas > 0, axis=0)
  empty = ~jnp.any(rows)
  y0 = jnp.where(empty, 0, jnp.argmax(rows))
  y1 = jnp.where(empty, h - 1, h - 1 - jnp.argmax(rows[::-1]))
  x0 = jnp.where(empty, 0, jnp.argmax(cols))
  x1 = jnp.where(empty, w - 1, w - 1 - jnp.argmax(cols[::-1]))
  return jnp.array([[x0, y0], [x1, y0], [x0, y1], [x1, y1]], jnp.float32)


def translation_range(canvas: ArrayLike, matrix: ArrayLike
                      ) -> tuple[jax.Array, jax.Array]:
  """Translations ``[lo, hi]`` (each ``[2]``, (x, y)) keeping the ink inside.

  The box of the canvas's nonzero pixels, mapped by ``matrix`` about the
  centre, stays within the pixel centres 0..size-1 for every t in
  ``[lo, hi]``. When the box cannot fit, lo = hi = the centring translation.
  """
  canvas = jnp.asarray(canvas)
  h, w = canvas.shape
  size = jnp.array([w - 1, h - 1], jnp.float32)
  centre = size / 2
  mapped = (_ink_corners(canvas) - centre[None]) @ jnp.asarray(matrix).T
  lo = -centre - jnp.min(mapped, axis=0)
  hi = centre - jnp.max(mapped, axis=0)
  mid = (lo + hi) / 2
  fits = lo <= hi
  return jnp.where(fits, lo, mid), jnp.where(fits, hi, mid)


@functools.partial(jax.jit, static_argnums=1)
def sample_affine(key: jax.Array, num: int) -> dict[str, jax.Array]:
  """The random part of the recipe: ``rotation`` [num] radians uniform in
  +-20 degrees, ``shear`` [num] uniform in +-0.2, ``scale`` [num, 2] (x, y)
  each uniform in [0.8, 1.2], ``position`` [num, 2] uniform in [0, 1) (where
  in ``translation_range`` the digit lands)."""
  k_rot, k_shear, k_scale, k_pos = jax.random.split(key, 4)
  max_rotation = math.radians(MAX_ROTATION_DEGREES)
  return {
      'rotation': jax.random.uniform(k_rot, (num,), minval=-max_rotation,
                                     maxval=max_rotation),
      'shear': jax.random.uniform(k_shear, (num,), minval=-MAX_SHEAR,
                                  maxval=MAX_SHEAR),
      'scale': jax.random.uniform(k_scale, (num, 2), minval=SCALE_RANGE[0],
                                  maxval=SCALE_RANGE[1]),
      'position': jax.random.uniform(k_pos, (num, 2)),
  }


@jax.jit
def _affine_batch(images: jax.Array, params: dict[str, jax.Array]
                  ) -> jax.Array:
  n, h, w, _ = images.shape
  top, left = (IMAGE_SIZE - h) // 2, (IMAGE_SIZE - w) // 2
  canvas = jnp.zeros((n, IMAGE_SIZE, IMAGE_SIZE), jnp.float32)
  canvas = canvas.at[:, top:top + h, left:left + w].set(images[..., 0])
  matrices = affine_matrix(params['rotation'], params['shear'],
                           params['scale'])

  def one(image, matrix, position):
    lo, hi = translation_range(image, matrix)
    return warp(image, matrix, lo + position * (hi - lo))

  out = jax.vmap(one)(canvas, matrices, params['position'])
  return jnp.clip(jnp.round(out), 0, 255).astype(jnp.uint8)[..., None]


def affine_mnist(images: ArrayLike, key_or_seed: jax.Array | int
                 ) -> np.ndarray:
  """affNIST-style images from MNIST digits, deterministic by key or seed.

  Each digit is put in the centre of a 40x40 black canvas and warped by
  ``affine_matrix(rotation, shear, scale)`` about the canvas centre, with
  rotation uniform in +-20 degrees, shear in +-0.2, scale in [0.8, 1.2] per
  axis (``sample_affine``), then translated by a uniformly random amount
  that keeps the box of the digit's ink inside the canvas
  (``translation_range``: on MNIST test digits, whose ink box is about
  20x20, the allowed shift averages about +-10 pixels per axis, less for
  large or strongly rotated ones); bilinear sampling, rounded to uint8.
  This follows the published description of affNIST; it is not
  byte-identical to the release.

  Args:
    images: uint8 ``[N, h, w, 1]`` with h, w <= 40 (28x28 MNIST).
    key_or_seed: a PRNG key or an int seed.

  Returns:
    uint8 ``[N, 40, 40, 1]`` (NumPy).
  """
  images = jnp.asarray(images)
  if images.ndim != 4 or images.shape[-1] != 1 or max(images.shape[1:3]) > 40:
    raise ValueError(f'expected [N, h, w, 1] images with h, w <= 40, got '
                     f'{images.shape}')
  key = (jax.random.key(int(key_or_seed))
         if isinstance(key_or_seed, int | np.integer) else key_or_seed)
  params = sample_affine(key, images.shape[0])
  return np.asarray(_affine_batch(images.astype(jnp.float32), params))
