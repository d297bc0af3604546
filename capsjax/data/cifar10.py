"""CIFAR-10 from its binary or python release; the official CapsNet pipeline.

The binary release (https://www.cs.toronto.edu/~kriz/cifar.html,
``cifar-10-binary.tar.gz``, extracted to ``cifar-10-batches-bin/``) is
``data_batch_1.bin`` .. ``data_batch_5.bin`` (training, 10,000 images each)
and ``test_batch.bin``: records of 3,073 bytes, one label byte (0-9) then
the 32x32 image as its red, green and blue planes of 1,024 bytes each, every
plane row by row (CHW). The python release (``cifar-10-python.tar.gz`` ->
``cifar-10-batches-py/``) has the same images as ``data_batch_1`` ..
``data_batch_5`` and ``test_batch``, each a pickled dict with ``b'data'``
uint8 ``[10000, 3072]`` (the same CHW rows) and ``b'labels'`` (10,000
ints); they are read by an unpickler that builds nothing but NumPy arrays,
so a file that is not what it claims cannot run code.

Validation is the LAST ``validation_size`` images of the training files in
order (the end of ``data_batch_5``); test is ``test_batch``.

Preprocessing, on the device (Sabour et al. 2017, section 7; the official
code's ``input_data/cifar10/cifar10_input.inputs``): training takes a random
24x24 crop, flips it left-right with probability 1/2, adds a random
brightness (max delta 63 of 255), scales each channel's deviation from its
mean by a factor in [0.2, 1.8) and standardises each image; evaluation takes
the central 24x24 and standardises it.

Shape legend: N examples, B batch, H = W = 32 stored, S the crop side (24).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from capsjax.data import smallnorb
from capsjax.data.idx import Dataset
from capsjax.data.idx import PathLike
from capsjax.data.idx import Place
from capsjax.data.idx import Split
from capsjax.data.idx import candidate_dirs
from capsjax.data.idx import carve_validation
from capsjax.data.idx import data_error
from capsjax.data.idx import import_tfds
from capsjax.data.idx import load_tfds_supervised
from capsjax.data.idx import not_found_message
from capsjax.data.idx import read_bytes
from capsjax.data.idx import search_dirs

NUM_CLASSES = 10
IMAGE_SIZE = 32
CHANNELS = 3
IMAGE_BYTES = CHANNELS * IMAGE_SIZE * IMAGE_SIZE
RECORD_BYTES = 1 + IMAGE_BYTES
# The official input's training crop and test window.
CROP_SIZE = 24
# The directories the archives extract to, and the official code's
# data_dir/cifar-10-batches-bin.
SUBDIRS = ('cifar10', 'cifar-10', 'cifar-10-batches-bin',
           'cifar-10-batches-py', 'cifar10/cifar-10-batches-bin',
           'cifar10/cifar-10-batches-py')
# Release format -> (training file names, test file name).
RELEASES = {
    'binary': (tuple(f'data_batch_{i}.bin' for i in range(1, 6)),
               'test_batch.bin'),
    'python': (tuple(f'data_batch_{i}' for i in range(1, 6)), 'test_batch'),
}
_FIX = ('Re-download it from https://www.cs.toronto.edu/~kriz/cifar.html '
        '(cifar-10-binary.tar.gz or cifar-10-python.tar.gz, extracted) or '
        'point data_dir at a good copy.')


# ----------------------------------------------------------------------------
# The binary release.


def _check_labels(labels: np.ndarray, path: PathLike) -> np.ndarray:
  if len(labels) and labels.max() >= NUM_CLASSES:
    bad = np.flatnonzero(labels >= NUM_CLASSES)[0]
    raise data_error(path, f'label {labels[bad]} of image {bad} is outside '
                     f'0-{NUM_CLASSES - 1}', _FIX)
  return labels.astype(np.int32)


def _chw_rows_to_images(rows: np.ndarray) -> np.ndarray:
  """uint8 [N, 3072] CHW rows -> uint8 [N, 32, 32, 3]."""
  chw = rows.reshape(-1, CHANNELS, IMAGE_SIZE, IMAGE_SIZE)
  return np.ascontiguousarray(chw.transpose(0, 2, 3, 1))


def parse_cifar_binary(data: bytes, path: PathLike = '<bytes>') -> Split:
  """Parses one binary batch file; ``path`` is used in error messages.

  Returns:
    ``Split`` with uint8 ``[N, 32, 32, 3]`` images, int32 ``[N]`` labels.
  """
  if not data:
    raise data_error(path, 'empty file (no 3,073-byte records)', _FIX)
  if len(data) % RECORD_BYTES:
    whole, rest = divmod(len(data), RECORD_BYTES)
    raise data_error(
        path, f'truncated or trailing bytes: {len(data)} bytes are {whole} '
        f'records of {RECORD_BYTES} (1 label + {IMAGE_BYTES} pixels) and '
        f'{rest} bytes more', _FIX)
  records = np.frombuffer(data, np.uint8).reshape(-1, RECORD_BYTES)
  labels = _check_labels(records[:, 0], path)
  return Split(_chw_rows_to_images(records[:, 1:]), labels)


def read_cifar_binary(path: PathLike) -> Split:
  """Reads ``data_batch_K.bin`` or ``test_batch.bin`` (gzip-compressed or not).

  Raises:
    DataError: empty, truncated or over-long file, a label above 9, a bad
      gzip stream; the message names the file.
  """
  return parse_cifar_binary(read_bytes(path), path)


def cifar_binary_bytes(images: ArrayLike, labels: ArrayLike) -> bytes:
  """The records of a binary batch file.

  Args:
    images: uint8 ``[N, 32, 32, 3]``.
    labels: int ``[N]`` in 0-9.
  """
  images, labels = np.asarray(images), np.asarray(labels)
  if (images.dtype != np.uint8 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE,
                                                       CHANNELS)
      or labels.shape != images.shape[:1]):
    raise ValueError(f'expected uint8 [N, 32, 32, 3] images and [N] labels, '
                     f'got {images.dtype} {images.shape} and {labels.shape}')
  if len(labels) and not 0 <= labels.min() <= labels.max() < NUM_CLASSES:
    raise ValueError(f'labels must be in 0-9, got {sorted(set(labels))}')
  rows = images.transpose(0, 3, 1, 2).reshape(len(images), IMAGE_BYTES)
  return np.concatenate([labels.astype(np.uint8)[:, None], rows], 1).tobytes()


def write_cifar_binary(path: PathLike, images: ArrayLike, labels: ArrayLike
                       ) -> None:
  """Writes a batch file of the binary release (e.g. a small fake release)."""
  with open(path, 'wb') as f:
    f.write(cifar_binary_bytes(images, labels))


# ----------------------------------------------------------------------------
# The python release.


# The globals a pickled NumPy array needs; anything else in a batch file is
# refused (unpickling can otherwise call any importable function).
_ALLOWED_GLOBALS = {
    ('numpy.core.multiarray', '_reconstruct'): np.empty(0).__reduce__()[0],
    ('numpy._core.multiarray', '_reconstruct'): np.empty(0).__reduce__()[0],
    ('numpy', 'ndarray'): np.ndarray,
    ('numpy', 'dtype'): np.dtype,
}


class _ArraysOnlyUnpickler(pickle.Unpickler):
  """Builds dicts, lists, bytes, numbers and NumPy arrays, nothing else."""

  def find_class(self, module: str, name: str):
    if (module, name) in _ALLOWED_GLOBALS:
      return _ALLOWED_GLOBALS[module, name]
    raise pickle.UnpicklingError(
        f'refused to load {module}.{name} (a CIFAR-10 batch holds only '
        'arrays, lists and bytes)')


def parse_cifar_pickle(data: bytes, path: PathLike = '<bytes>') -> Split:
  """Parses one python-release batch file; ``path`` is used in messages.

  Returns:
    ``Split`` with uint8 ``[N, 32, 32, 3]`` images, int32 ``[N]`` labels.
  """
  try:
    # The release was pickled by Python 2: its str keys are bytes here.
    batch = _ArraysOnlyUnpickler(io.BytesIO(data), encoding='bytes').load()
  except Exception as e:  # corrupt pickles raise many kinds
    raise data_error(path, f'not a readable CIFAR-10 python batch '
                     f'({type(e).__name__}: {e})', _FIX) from e
  if not isinstance(batch, dict) or not {b'data', b'labels'} <= set(batch):
    keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
    raise data_error(path, f"expected a dict with b'data' and b'labels', got "
                     f'{keys}', _FIX)
  rows = batch[b'data']
  if (not isinstance(rows, np.ndarray) or rows.dtype != np.uint8
      or rows.ndim != 2 or rows.shape[1] != IMAGE_BYTES or not len(rows)):
    shape = getattr(rows, 'shape', type(rows).__name__)
    raise data_error(path, f"expected b'data' uint8 [N, {IMAGE_BYTES}] with "
                     f'N > 0, got {getattr(rows, "dtype", "")} {shape}', _FIX)
  try:
    labels = np.asarray(batch[b'labels'], np.int64).reshape(-1)
  except (TypeError, ValueError, OverflowError) as e:
    raise data_error(path, f"b'labels' is not a list of ints ({e})",
                     _FIX) from e
  if len(labels) != len(rows):
    raise data_error(path, f'{len(labels)} labels for {len(rows)} images',
                     _FIX)
  if labels.min() < 0:
    raise data_error(path, f'label {labels.min()} is outside 0-9', _FIX)
  return Split(_chw_rows_to_images(rows), _check_labels(labels, path))


def read_cifar_pickle(path: PathLike) -> Split:
  """Reads ``data_batch_K`` or ``test_batch`` of the python release.

  Raises:
    DataError: not a pickle, not the release's dict, wrong shapes or
      labels, a global other than NumPy's array constructors; the message
      names the file.
  """
  return parse_cifar_pickle(read_bytes(path), path)


_RECONSTRUCT = _ALLOWED_GLOBALS['numpy.core.multiarray', '_reconstruct']


class _Python2Pickler(pickle._Pickler):
  """Pickles as Python 2 and NumPy 1 did the release: ``bytes`` and ``str``
  as Python 2's ``str`` (SHORT_BINSTRING, BINSTRING; Python 3's protocol 2
  would call ``_codecs.encode``) and arrays by
  ``numpy.core.multiarray._reconstruct``."""

  dispatch = dict(pickle._Pickler.dispatch)

  def save_python2_str(self, obj: bytes | str) -> None:
    data = obj.encode('latin-1') if isinstance(obj, str) else obj
    if len(data) < 256:
      self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
    else:
      self.write(pickle.BINSTRING + len(data).to_bytes(4, 'little') + data)
    self.memoize(obj)

  dispatch[bytes] = save_python2_str
  dispatch[str] = save_python2_str

  def save_global(self, obj, name=None) -> None:
    if obj is not _RECONSTRUCT:
      return super().save_global(obj, name)
    self.write(pickle.GLOBAL + b'numpy.core.multiarray\n_reconstruct\n')
    self.memoize(obj)


def cifar_pickle_bytes(images: ArrayLike, labels: ArrayLike) -> bytes:
  """A batch file of the python release as the release pickled it: protocol
  2 from Python 2, a dict with the keys ``b'batch_label'``, ``b'labels'`` (a
  list of ints), ``b'data'`` (uint8 [N, 3072] CHW rows) and
  ``b'filenames'``.

  Args:
    images: uint8 ``[N, 32, 32, 3]``.
    labels: int ``[N]`` in 0-9.
  """
  records = np.frombuffer(cifar_binary_bytes(images, labels),
                          np.uint8).reshape(-1, RECORD_BYTES)
  batch = {b'batch_label': b'capsjax test batch',
           b'labels': [int(v) for v in records[:, 0]],
           b'data': np.ascontiguousarray(records[:, 1:]),
           b'filenames': [f'{i}.png'.encode() for i in range(len(records))]}
  buffer = io.BytesIO()
  _Python2Pickler(buffer, protocol=2).dump(batch)
  return buffer.getvalue()


def write_cifar_pickle(path: PathLike, images: ArrayLike, labels: ArrayLike
                       ) -> None:
  """Writes a batch file of the python release (``cifar_pickle_bytes``)."""
  with open(path, 'wb') as f:
    f.write(cifar_pickle_bytes(images, labels))


# ----------------------------------------------------------------------------
# Finding and loading the release.


def find_release(directory: Path) -> tuple[str, list[Path], Path] | None:
  """``(format, training files, test file)`` when a whole release is in
  ``directory`` (the binary one first), else None."""
  for form, (train_names, test_name) in RELEASES.items():
    paths = [directory / n for n in (*train_names, test_name)]
    if all(p.is_file() for p in paths):
      return form, paths[:-1], paths[-1]
  return None


def _partial_releases(places: list[Place]) -> str:
  """Lines naming the files missing where a release is only partly there."""
  lines = []
  for place in places:
    for train_names, test_name in RELEASES.values():
      names = (*train_names, test_name)
      present = [n for n in names if (place.path / n).is_file()]
      if present:
        missing = [n for n in names if n not in present]
        lines.append(f'{place.path} has {", ".join(present)} but lacks '
                     f'{", ".join(missing)}.')
  return ''.join(f'\n{line}' for line in lines)


def _read_release(form: str, train_paths: list[Path], test_path: Path
                  ) -> tuple[Split, Split]:
  read = read_cifar_binary if form == 'binary' else read_cifar_pickle
  parts = [read(p) for p in train_paths]
  train = Split(np.concatenate([p.images for p in parts]),
                np.concatenate([p.labels for p in parts]))
  return train, read(test_path)


def load_cifar10(*, data_dir: PathLike | None = None,
                 validation_size: int = 5000, source: str = 'auto'
                 ) -> Dataset:
  """CIFAR-10, uint8 ``[N, 32, 32, 3]``; see ``load_dataset``.

  Files: the binary release (``data_batch_1.bin`` .. ``test_batch.bin``) or
  the python one (``data_batch_1`` .. ``test_batch``) in ``data_dir`` or one
  of its ``SUBDIRS`` (``cifar-10-batches-bin/`` as the archive extracts);
  TFDS name ``cifar10``.
  """
  if source not in ('auto', 'local', 'tfds'):
    raise ValueError(f"source must be 'auto', 'local' or 'tfds', got "
                     f'{source!r}')
  if source == 'tfds':
    train, test = load_tfds_supervised('cifar10')
  else:
    places = candidate_dirs(SUBDIRS, data_dir)
    found = search_dirs(places, find_release)
    if found is not None:
      train, test = _read_release(*found[1])
    else:
      message = lambda tried: not_found_message(  # noqa: E731
          'CIFAR-10', places, 'data_batch_1.bin .. data_batch_5.bin and '
          'test_batch.bin, or the python release\'s data_batch_1 .. '
          'test_batch', 'cifar10', tfds_tried=tried) + _partial_releases(
              places)
      if source == 'local' or data_dir is not None:
        raise FileNotFoundError(message(False))
      try:
        import_tfds('cifar10')
      except ImportError as e:
        raise FileNotFoundError(message(True)) from e
      train, test = load_tfds_supervised('cifar10')
  train, validation = carve_validation(*train, validation_size)
  return Dataset(train, validation, test, NUM_CLASSES, 'cifar10')


# ----------------------------------------------------------------------------
# Preprocessing (pure JAX, jit-able): the official code's input.


def flip_left_right(images: ArrayLike, flips: ArrayLike) -> jax.Array:
  """Mirrors the images whose ``flips`` entry is True.

  Args:
    images: ``[B, H, W, C]``.
    flips: bool ``[B]``.
  Returns:
    ``[B, H, W, C]``, dtype of ``images``.
  """
  images = jnp.asarray(images)
  flips = jnp.asarray(flips, bool)[:, None, None, None]
  return jnp.where(flips, images[:, :, ::-1], images)


def cifar10_train_draws(
    key: jax.Array, batch_size: int, height: int, width: int, *,
    crop_size: int = CROP_SIZE
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The random draws of ``cifar10_train_preprocess``, one set per image.

  Returns:
    offsets: int32 ``[B, 2]`` crop corners, uniform over every position.
    flips: bool ``[B]``, each True with probability 1/2.
    delta: float32 ``[B]`` brightness, uniform in [-63/255, 63/255).
    factor: float32 ``[B]`` contrast, uniform in [0.2, 1.8).
  The official code's tf.random_crop, tf.image.random_flip_left_right,
  random_brightness(max_delta=63) and random_contrast(0.2, 1.8).
  """
  crop_key, flip_key = jax.random.split(key)
  offsets, delta, factor = smallnorb.smallnorb_train_draws(
      crop_key, batch_size, height, width, crop_size=crop_size)
  flips = jax.random.bernoulli(flip_key, 0.5, (batch_size,))
  return offsets, flips, delta, factor


def cifar10_distort(images: ArrayLike, offsets: ArrayLike, flips: ArrayLike,
                    delta: ArrayLike, factor: ArrayLike, *,
                    crop_size: int = CROP_SIZE, pixel_max: float = 255.0
                    ) -> jax.Array:
  """The training distortions for given draws (``cifar10_train_draws``).

  The official order: the crop at ``offsets``, the flip, brightness,
  contrast about each channel's mean over the crop, standardisation. The
  flip is applied last here: brightness, contrast and the standardisation
  treat every pixel alike, so they commute with it, and the rest is
  ``smallnorb_distort``'s crop-first path.

  Args:
    images: uint8 ``[B, H, W, C]``.
    offsets: int ``[B, 2]``; flips: bool ``[B]``; delta, factor: ``[B]``.
    pixel_max: pixels are scaled to [0, pixel_max] first: 255 is the
      official code's scale (its floats are the stored bytes); it only
      matters through the standardisation's std floor 1/sqrt(S*S*C).
  Returns:
    float32 ``[B, S, S, C]``.
  """
  x = smallnorb.smallnorb_distort(images, offsets, delta, factor,
                                  crop_size=crop_size, order='crop_first',
                                  pixel_max=pixel_max)
  return flip_left_right(x, flips)


def cifar10_train_preprocess(key: jax.Array, images: ArrayLike, *,
                             crop_size: int = CROP_SIZE, flip: bool = True,
                             pixel_max: float = 255.0) -> jax.Array:
  """The official training input: random crop, flip, brightness, contrast,
  per-image standardisation (``cifar10_distort``); ``flip=False`` drops the
  flip.

  Args:
    key: PRNG key.
    images: uint8 ``[B, H, W, C]`` with H, W >= crop_size.
  Returns:
    float32 ``[B, S, S, C]``.
  """
  images = jnp.asarray(images)
  if images.ndim != 4 or min(images.shape[1:3]) < crop_size:
    raise ValueError(f'expected [B, H, W, C] images with H, W >= {crop_size},'
                     f' got {images.shape}')
  b, h, w, _ = images.shape
  offsets, flips, delta, factor = cifar10_train_draws(key, b, h, w,
                                                      crop_size=crop_size)
  if not flip:
    flips = jnp.zeros_like(flips)
  return cifar10_distort(images, offsets, flips, delta, factor,
                         crop_size=crop_size, pixel_max=pixel_max)


def cifar10_eval_preprocess(images: ArrayLike, *, crop_size: int = CROP_SIZE,
                            pixel_max: float = 255.0) -> jax.Array:
  """The official test input: the central ``crop_size`` window
  (tf.image.resize_image_with_crop_or_pad: top-left ((H - S) // 2, ..)),
  standardised.

  Args:
    images: uint8 ``[B, H, W, C]``.
  Returns:
    float32 ``[B, S, S, C]``.
  """
  return smallnorb.smallnorb_eval_preprocess(images, crop_size=crop_size,
                                             pixel_max=pixel_max)

