"""SVHN cropped digits (the release's format 2) from its .mat files.

The release (http://ufldl.stanford.edu/housenumbers/) has
``train_32x32.mat`` (73,257 digits), ``test_32x32.mat`` (26,032) and
``extra_32x32.mat`` (531,131; not read: Sabour et al. trained on the 73,257
alone). Each is a MATLAB v5 file holding ``X``, uint8 ``[32, 32, 3, N]``
(row, column, colour, image), and ``y``, ``[N, 1]`` labels 1-10 where 10 is
the digit 0; here the digit itself (0-9) is the label.

Validation is the LAST ``validation_size`` images of ``train_32x32.mat``;
test is ``test_32x32.mat``. TFDS name: ``svhn_cropped`` (its labels are the
digits already).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from jax.typing import ArrayLike

from capsjax.data.idx import Dataset
from capsjax.data.idx import PathLike
from capsjax.data.idx import Split
from capsjax.data.idx import candidate_dirs
from capsjax.data.idx import carve_validation
from capsjax.data.idx import data_error
from capsjax.data.idx import import_tfds
from capsjax.data.idx import load_tfds_supervised
from capsjax.data.idx import not_found_message
from capsjax.data.idx import search_dirs

NUM_CLASSES = 10
IMAGE_SIZE = 32
SUBDIRS = ('svhn', 'SVHN', 'svhn_cropped')
FILES = {'train': 'train_32x32.mat', 'test': 'test_32x32.mat'}
# The release's label of the digit 0.
ZERO_LABEL = 10
_FIX = ('Re-download it from http://ufldl.stanford.edu/housenumbers/ '
        '(format 2, cropped digits) or point data_dir at a good copy.')


def _loadmat(path: PathLike) -> dict:
  try:
    from scipy import io as scipy_io
  except ImportError as e:
    raise ImportError('reading SVHN .mat files needs scipy: pip install '
                      'scipy') from e
  try:
    return scipy_io.loadmat(path, variable_names=('X', 'y'))
  except NotImplementedError as e:  # what scipy says of a v7.3 file
    raise data_error(path, 'a MATLAB v7.3 (HDF5) file; the release is '
                     'MATLAB v5', _FIX) from e
  except Exception as e:  # scipy raises many kinds on corrupt files
    raise data_error(path, f'not a readable MATLAB .mat file '
                     f'({type(e).__name__}: {e})', _FIX) from e


def read_svhn_mat(path: PathLike) -> Split:
  """Reads ``train_32x32.mat`` or ``test_32x32.mat``.

  Returns:
    ``Split`` with uint8 ``[N, 32, 32, 3]`` images and int32 ``[N]`` digits
    (the release's 10 read as 0).

  Raises:
    DataError: not a v5 .mat file, truncated, ``X`` or ``y`` missing or of
      the wrong shape or type, counts that differ, labels outside 1-10; the
      message names the file.
  """
  mat = _loadmat(path)
  missing = [k for k in ('X', 'y') if k not in mat]
  if missing:
    raise data_error(path, f'no variable {" or ".join(missing)} (the '
                     f'release holds X and y; found {sorted(mat)})', _FIX)
  x, y = mat['X'], mat['y']
  if (x.dtype != np.uint8 or x.ndim != 4
      or x.shape[:3] != (IMAGE_SIZE, IMAGE_SIZE, 3) or not x.shape[3]):
    raise data_error(path, f'expected X uint8 [32, 32, 3, N] with N > 0, got '
                     f'{x.dtype} {x.shape}', _FIX)
  n = x.shape[3]
  if (y.ndim != 2 or y.shape[1] != 1 or not (
      np.issubdtype(y.dtype, np.integer) or
      np.issubdtype(y.dtype, np.floating))):
    raise data_error(path, f'expected y [N, 1] of numbers, got {y.dtype} '
                     f'{y.shape}', _FIX)
  if len(y) != n:
    raise data_error(path, f'{len(y)} labels in y for {n} images in X', _FIX)
  labels = y[:, 0]
  with np.errstate(invalid='ignore'):  # NaN compares False: rejected
    good = (labels >= 1) & (labels <= ZERO_LABEL) & (labels == np.floor(labels))
  if not np.all(good):
    raise data_error(path, f'label {labels[~good][0]} of image '
                     f'{np.flatnonzero(~good)[0]} is not one of 1-10 (10 is '
                     'the digit 0)', _FIX)
  images = np.ascontiguousarray(x.transpose(3, 0, 1, 2))
  return Split(images, (labels.astype(np.int32) % ZERO_LABEL))


def write_svhn_mat(path: PathLike, images: ArrayLike, labels: ArrayLike
                   ) -> None:
  """Writes images and digits as a release file (e.g. a small fake release).

  Args:
    images: uint8 ``[N, 32, 32, 3]``.
    labels: int ``[N]`` digits 0-9 (written as the release's 1-10).
  """
  from scipy import io as scipy_io
  images, labels = np.asarray(images), np.asarray(labels)
  if (images.dtype != np.uint8 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE,
                                                       3)
      or labels.shape != images.shape[:1]):
    raise ValueError(f'expected uint8 [N, 32, 32, 3] images and [N] labels, '
                     f'got {images.dtype} {images.shape} and {labels.shape}')
  y = np.where(labels == 0, ZERO_LABEL, labels).astype(np.uint8)[:, None]
  scipy_io.savemat(path, {'X': images.transpose(1, 2, 3, 0), 'y': y},
                   format='5', do_compression=True)


def find_release(directory: Path) -> dict[str, Path] | None:
  """``{'train': path, 'test': path}`` when both files are in ``directory``."""
  paths = {k: directory / name for k, name in FILES.items()}
  return paths if all(p.is_file() for p in paths.values()) else None


def load_svhn(*, data_dir: PathLike | None = None, validation_size: int = 5000,
              source: str = 'auto') -> Dataset:
  """SVHN's 73,257 training and 26,032 test digits, uint8 ``[N, 32, 32, 3]``;
  see ``load_dataset``."""
  if source not in ('auto', 'local', 'tfds'):
    raise ValueError(f"source must be 'auto', 'local' or 'tfds', got "
                     f'{source!r}')
  if source == 'tfds':
    train, test = load_tfds_supervised('svhn_cropped')
  else:
    places = candidate_dirs(SUBDIRS, data_dir)
    found = search_dirs(places, find_release)
    if found is not None:
      train, test = (read_svhn_mat(found[1][k]) for k in ('train', 'test'))
    else:
      message = lambda tried: not_found_message(  # noqa: E731
          'SVHN', places, ', '.join(FILES.values()), 'svhn',
          tfds_tried=tried)
      if source == 'local' or data_dir is not None:
        raise FileNotFoundError(message(False))
      try:
        import_tfds('svhn_cropped')
      except ImportError as e:
        raise FileNotFoundError(message(True)) from e
      train, test = load_tfds_supervised('svhn_cropped')
  train, validation = carve_validation(*train, validation_size)
  return Dataset(train, validation, test, NUM_CLASSES, 'svhn')
