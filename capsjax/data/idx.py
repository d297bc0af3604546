"""File-level primitives shared by every reader: errors, containers, IDX.

``Split`` and ``Dataset`` are the containers every loader returns; images are
uint8 ``[N, H, W, C]`` and labels int32 ``[N]`` so that a whole split fits in
host memory in its stored size and is converted to float only per batch.

The IDX format (LeCun's MNIST files, also used by Fashion-MNIST): a 4-byte
magic ``00 00 <dtype> <ndim>``, then ``ndim`` big-endian uint32 sizes, then the
data in C order, big-endian. MNIST images are ``0x00000803`` (uint8, 3 dims)
and labels ``0x00000801`` (uint8, 1 dim). Files may be gzip-compressed.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple
from typing import TypeVar

import numpy as np

PathLike = str | os.PathLike
T = TypeVar('T')

# Environment variable naming a directory that holds the datasets (each in
# its own subdirectory, e.g. mnist/) or one dataset's files directly.
DATA_DIR_ENV = 'CAPSJAX_DATA_DIR'
# The directory above the capsjax package: a clone's root.
REPO_ROOT = Path(__file__).resolve().parents[2]

GZIP_MAGIC = b'\x1f\x8b'

# IDX type byte -> element type (big-endian where it matters).
IDX_DTYPES = {
    0x08: np.dtype('u1'),
    0x09: np.dtype('i1'),
    0x0B: np.dtype('>i2'),
    0x0C: np.dtype('>i4'),
    0x0D: np.dtype('>f4'),
    0x0E: np.dtype('>f8'),
}

_REDOWNLOAD = (
    'Re-download the original file (and check its MD5 against the published '
    'one) or point data_dir at a good copy.')


class DataError(ValueError):
  """A data file is missing pieces, truncated, corrupt or of the wrong kind.

  The message names the file, the problem and how to fix it.
  """


class Split(NamedTuple):
  """One split of a dataset.

  Attributes:
    images: uint8 ``[N, H, W, C]``.
    labels: int32 ``[N]``.
  """

  images: np.ndarray
  labels: np.ndarray


class Dataset(NamedTuple):
  """Train, validation and test splits of one dataset."""

  train: Split
  validation: Split
  test: Split
  num_classes: int
  name: str


def data_error(path: PathLike, problem: str, fix: str = _REDOWNLOAD) -> DataError:
  """Builds a ``DataError`` whose message names ``path``, problem and fix."""
  return DataError(f'{os.fspath(path)}: {problem}. {fix}')


def payload_array(data: bytes, header_size: int, dims: tuple[int, ...],
                  dtype: np.dtype, path: PathLike, fix: str = _REDOWNLOAD
                  ) -> np.ndarray:
  """The array after a binary header, checked to fill the file exactly.

  Shared by the IDX and smallNORB readers; ``dtype`` carries the file's byte
  order and the result is in native order.
  """
  expected = math.prod(dims) * dtype.itemsize
  payload = len(data) - header_size
  if payload != expected:
    problem = 'truncated' if payload < expected else 'trailing bytes'
    raise data_error(
        path, f'{problem}: dims {dims} of {dtype.name} need {expected} bytes '
        f'of data, found {payload}', fix)
  array = np.frombuffer(data, dtype, offset=header_size).reshape(dims)
  return array.astype(dtype.newbyteorder('='))


def read_bytes(path: PathLike) -> bytes:
  """Returns the content of ``path``, gunzipped when it is gzip-compressed.

  A file is decompressed when it starts with the gzip magic bytes, whatever
  its name. A name ending in ``.gz`` whose content is not gzip is an error
  (usually an HTML error page saved under the data file's name).

  Raises:
    FileNotFoundError: ``path`` does not exist.
    DataError: the gzip stream is corrupt or truncated, or a ``.gz`` file is
      not gzip.
  """
  with open(path, 'rb') as f:
    raw = f.read()
  if raw[:2] == GZIP_MAGIC:
    try:
      return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
      raise data_error(
          path, f'corrupt or truncated gzip stream ({type(e).__name__}: {e})'
      ) from e
  if os.fspath(path).endswith('.gz'):
    raise data_error(
        path, f'named .gz but not gzip-compressed (starts with {raw[:4]!r})',
        'Re-download it; if you decompressed it yourself, drop the .gz '
        'suffix.')
  return raw


def parse_idx(data: bytes, path: PathLike = '<bytes>') -> np.ndarray:
  """Parses the bytes of an IDX file; ``path`` is used in error messages.

  Returns:
    The array, in native byte order, with the dimensions from the header.
  """
  if len(data) < 4:
    raise data_error(path, f'only {len(data)} bytes, shorter than an IDX header')
  zero, type_code, ndim = data[:2], data[2], data[3]
  if zero != b'\x00\x00' or type_code not in IDX_DTYPES:
    raise data_error(
        path, f'bad IDX magic 0x{data[:4].hex()} (expected 0x00000803 for '
        'images, 0x00000801 for labels; 0x0000TTDD in general)')
  if ndim == 0:
    raise data_error(path, 'IDX header declares 0 dimensions')
  header_size = 4 + 4 * ndim
  if len(data) < header_size:
    raise data_error(
        path, f'truncated IDX header: {ndim} dims need {header_size} bytes, '
        f'file has {len(data)}')
  dims = tuple(int(d) for d in np.frombuffer(data, '>u4', ndim, offset=4))
  return payload_array(data, header_size, dims, IDX_DTYPES[type_code], path)


def read_idx(path: PathLike) -> np.ndarray:
  """Reads an IDX file (gzip-compressed or not).

  Args:
    path: e.g. ``.../train-images-idx3-ubyte.gz``.

  Returns:
    The array: uint8 ``[N, 28, 28]`` for MNIST images, uint8 ``[N]`` labels.

  Raises:
    DataError: wrong magic, truncated header or payload, trailing bytes, bad
      gzip; the message names the file.
  """
  return parse_idx(read_bytes(path), path)


def carve_validation(images: np.ndarray, labels: np.ndarray,
                     validation_size: int) -> tuple[Split, Split]:
  """Splits off the LAST ``validation_size`` examples as validation.

  Args:
    images: ``[N, H, W, C]``.
    labels: ``[N]``.
    validation_size: 0 <= validation_size < N; 0 gives an empty split.

  Returns:
    ``(train, validation)`` with ``N - validation_size`` and
    ``validation_size`` examples.
  """
  n = len(labels)
  if not 0 <= validation_size < n:
    raise ValueError(
        f'validation_size must be in [0, {n}) for {n} training examples, '
        f'got {validation_size}')
  cut = n - validation_size
  return (Split(images[:cut], labels[:cut]),
          Split(images[cut:], labels[cut:]))


# ----------------------------------------------------------------------------
# Finding a dataset's directory.


class Place(NamedTuple):
  """A directory looked at, and why it was looked at."""

  path: Path
  reason: str


def candidate_dirs(subdirs: Sequence[str],
                   data_dir: PathLike | None = None) -> list[Place]:
  """The directories to look in for one dataset, in order.

  An explicit ``data_dir`` is the only place looked at: the directory itself
  and its ``subdirs``. Otherwise: ``$CAPSJAX_DATA_DIR`` (itself and its
  ``subdirs``), then ``../shared/data/<subdir>`` relative to the working
  directory and relative to the repository root (the directory above the
  capsjax package), so that a clone with ``shared/`` beside it needs no flag.

  Args:
    subdirs: names of the dataset's directory, e.g. ``('fashion-mnist',
      'fashion_mnist')``.
    data_dir: the directory the user gave, or None.
  """
  def with_subdirs(base: Path, reason: str) -> list[Place]:
    return [Place(base, reason)] + [Place(base / s, reason) for s in subdirs]

  if data_dir is not None:
    return with_subdirs(Path(data_dir).expanduser(), 'data_dir argument')
  places = []
  env = os.environ.get(DATA_DIR_ENV)
  if env:
    places += with_subdirs(Path(env).expanduser(), f'${DATA_DIR_ENV}')
  for root, why in ((Path.cwd(), 'the working directory'),
                    (REPO_ROOT, 'the repository root')):
    places += [Place(root.parent / 'shared' / 'data' / s,
                     f'../shared/data relative to {why}') for s in subdirs]
  unique, seen = [], set()
  for place in places:
    key = os.path.abspath(place.path)
    if key not in seen:
      seen.add(key)
      unique.append(place)
  return unique


def search_dirs(places: Sequence[Place],
                find: Callable[[Path], T | None]) -> tuple[Path, T] | None:
  """Returns ``(directory, find(directory))`` for the first place found."""
  for place in places:
    if place.path.is_dir():
      found = find(place.path)
      if found is not None:
        return place.path, found
  return None


# Where each dataset's original files are published.
SOURCES = {
    'MNIST': 'http://yann.lecun.com/exdb/mnist/',
    'Fashion-MNIST': 'https://github.com/zalandoresearch/fashion-mnist',
    'smallNORB': 'https://cs.nyu.edu/~ylclab/data/norb-v1.0-small/',
    'CIFAR-10': 'https://www.cs.toronto.edu/~kriz/cifar.html',
    'SVHN': 'http://ufldl.stanford.edu/housenumbers/',
}
# tensorflow-datasets, from PyPI or from a source checkout of capsjax.
TFDS_INSTALL = "pip install 'capsjax[tfds]' (from a checkout: pip install -e '.[tfds]')"


def not_found_message(what: str, places: Sequence[Place], files: str,
                      subdir: str, *, tfds_tried: bool) -> str:
  """Lists every place looked at, where the files are published and every
  way to provide them.

  ``tfds_tried``: the message adds that tensorflow-datasets is not installed.
  """
  looked = '\n'.join(f'  - {p.path} ({p.reason})' for p in places)
  explicit = any(p.reason == 'data_dir argument' for p in places)
  env_note = ('' if explicit or os.environ.get(DATA_DIR_ENV) else
              f'  - ${DATA_DIR_ENV} (not set)\n')
  return (
      f'Could not find the {what} files ({files}). Looked in:\n'
      f'{env_note}{looked}\n'
      + ('and tensorflow-datasets is not installed.\n' if tfds_tried else '')
      + 'Provide the files by one of:\n'
      f'  - --config.data_dir=/path (data_dir=... in Python): a directory '
      f'holding the files or a {subdir}/ subdirectory with them;\n'
      f'  - export {DATA_DIR_ENV}=/path (same layout);\n'
      '  - put them in ../shared/data/' + subdir + '/ beside the repository;\n'
      f'  - {TFDS_INSTALL} to download them through TensorFlow Datasets.'
      + (f'\nThe original files are published at {SOURCES[what]}.'
         if what in SOURCES else ''))


def import_tfds(name: str):
  """Imports tensorflow_datasets lazily, with a clear error when missing."""
  try:
    import tensorflow_datasets as tfds
  except ImportError as e:
    raise ImportError(
        f"source='tfds' for {name!r} needs tensorflow-datasets, which is not "
        f'installed: {TFDS_INSTALL}. Or use local files: '
        f"source='local' with data_dir=... (--config.data_dir) or "
        f'${DATA_DIR_ENV}.') from e
  return tfds


def load_tfds_supervised(name: str) -> tuple[Split, Split]:
  """The train and test splits of TFDS dataset ``name`` as (image, label)
  pairs: uint8 ``[N, H, W, C]`` images, int32 ``[N]`` labels."""
  tfds = import_tfds(name)
  splits = []
  for split in ('train', 'test'):
    images, labels = tfds.as_numpy(tfds.load(
        name, split=split, batch_size=-1, as_supervised=True))
    splits.append(Split(images.astype(np.uint8), labels.astype(np.int32)))
  return splits[0], splits[1]
