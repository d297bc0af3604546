"""smallNORB: the NYU binary matrix reader, loader and the EM paper's crops.

The release (https://cs.nyu.edu/~ylclab/data/norb-v1.0-small/) is six files,
gzip-compressed or not::

  smallnorb-5x46789x9x18x6x2x96x96-training-{dat,cat,info}.mat
  smallnorb-5x01235x9x18x6x2x96x96-testing-{dat,cat,info}.mat

each in the release's "binary matrix" format: a little-endian int32 magic
(``MAGIC_TO_DTYPE``), an int32 ``ndim``, then ``max(ndim, 3)`` int32 sizes
(the slots beyond ``ndim`` hold 1 and are not dimensions), then the data in C
order, little-endian. ``dat`` is uint8 ``[24300, 2, 96, 96]`` (the stereo
pair), ``cat`` int32 ``[24300]`` (category 0-4: animal, human, airplane,
truck, car), ``info`` int32 ``[24300, 4]``: instance, elevation index 0-8
(30 to 70 degrees in steps of 5), azimuth 0, 2, .., 34 (times 10 = degrees),
lighting 0-5.

Shape legend: N examples, B batch, C channels (2 = both stereo images, 1 =
the left one), H = W = 48 after downsampling, 32 after cropping.
"""

from __future__ import annotations

import gzip
import math
import os
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from capsjax.data.augment import center_crop
from capsjax.data.idx import Dataset
from capsjax.data.idx import PathLike
from capsjax.data.idx import Split
from capsjax.data.idx import candidate_dirs
from capsjax.data.idx import carve_validation
from capsjax.data.idx import data_error
from capsjax.data.idx import import_tfds
from capsjax.data.idx import not_found_message
from capsjax.data.idx import payload_array
from capsjax.data.idx import read_bytes
from capsjax.data.idx import search_dirs

MAGIC_TO_DTYPE = {
    0x1E3D4C51: np.dtype('<f4'),  # single-precision matrix
    0x1E3D4C53: np.dtype('<f8'),  # double-precision matrix
    0x1E3D4C54: np.dtype('<i4'),  # integer matrix
    0x1E3D4C55: np.dtype('u1'),  # byte matrix
    0x1E3D4C56: np.dtype('<i2'),  # short matrix
}
DTYPE_TO_MAGIC = {dtype.newbyteorder('<'): magic
                  for magic, dtype in MAGIC_TO_DTYPE.items()}
# The format allows any ndim; more than this is taken as corruption (the
# release uses 1, 2 and 4).
MAX_NDIM = 16

NUM_CLASSES = 5
SUBDIRS = ('smallnorb', 'smallNORB', 'norb')
SPLIT_FILES = {'training': 'smallnorb-5x46789x9x18x6x2x96x96-training',
               'testing': 'smallnorb-5x01235x9x18x6x2x96x96-testing'}
# Viewpoint generalisation (Hinton et al. 2018, section 5.1): train on these
# azimuths (degrees), test on the other 12; or train on the 3 lowest
# elevations and test on the other 6.
TRAIN_AZIMUTHS_DEGREES = (300, 320, 340, 0, 20, 40)
TRAIN_ELEVATIONS = (0, 1, 2)
VIEWPOINT_SPLITS = (None, 'azimuth', 'elevation')

CROP_SIZE = 32
# How the 96x96 release becomes 48x48 (``downsample``).
DOWNSAMPLE_METHODS = ('mean', 'pick')
# The order of the training distortions (``smallnorb_distort``).
AUGMENT_ORDERS = ('crop_first', 'released')
# Test-time crop patterns (``multicrop_offsets``).
MULTICROP_PATTERNS = ('grid', 'released')
# tf.image.random_brightness(max_delta=63) and random_contrast(0.2, 1.8) of
# the authors' code, on a 0-255 scale; here images are in [0, 1].
MAX_BRIGHTNESS_DELTA = 63 / 255
CONTRAST_RANGE = (0.2, 1.8)

_FIX = ('Re-download the smallNORB file from '
        'https://cs.nyu.edu/~ylclab/data/norb-v1.0-small/ or point data_dir '
        'at a good copy.')


# ----------------------------------------------------------------------------
# The binary matrix format.


def parse_norb_matrix(data: bytes, path: PathLike = '<bytes>') -> np.ndarray:
  """Parses the bytes of one release file; ``path`` is used in messages.

  Returns:
    The array with the header's dimensions, in native byte order.
  """
  if len(data) < 8:
    raise data_error(path, f'only {len(data)} bytes, shorter than a '
                     'smallNORB matrix header', _FIX)
  magic, ndim = (int(v) for v in np.frombuffer(data, '<i4', 2))
  if magic not in MAGIC_TO_DTYPE:
    raise data_error(
        path, f'bad magic 0x{magic & 0xFFFFFFFF:08X} (expected one of '
        f'{", ".join(f"0x{m:08X}" for m in MAGIC_TO_DTYPE)}; 0x1E3D4C55 for '
        '-dat.mat, 0x1E3D4C54 for -cat.mat and -info.mat)', _FIX)
  if not 1 <= ndim <= MAX_NDIM:
    raise data_error(path, f'header declares {ndim} dimensions (expected 1 '
                     f'to {MAX_NDIM})', _FIX)
  header_size = 8 + 4 * max(ndim, 3)
  if len(data) < header_size:
    raise data_error(path, f'truncated header: {ndim} dims need '
                     f'{header_size} bytes, file has {len(data)}', _FIX)
  dims = tuple(int(d) for d in np.frombuffer(data, '<i4', ndim, offset=8))
  if min(dims) < 0:
    raise data_error(path, f'negative size in dims {dims}', _FIX)
  return payload_array(data, header_size, dims, MAGIC_TO_DTYPE[magic], path,
                       _FIX)


def read_norb_matrix(path: PathLike) -> np.ndarray:
  """Reads one release file (``-dat.mat``, ``-cat.mat``, ``-info.mat``, .gz).

  Raises:
    DataError: bad magic, ndim, truncated or over-long data, bad gzip; the
      message names the file.
  """
  return parse_norb_matrix(read_bytes(path), path)


def norb_matrix_bytes(array: ArrayLike) -> bytes:
  """The bytes of ``array`` in the release's binary matrix format."""
  array = np.asarray(array)
  dtype = array.dtype.newbyteorder('<')
  if dtype not in DTYPE_TO_MAGIC:
    raise ValueError(f'cannot write dtype {array.dtype} as a smallNORB '
                     'matrix; use uint8, int16, int32, float32 or float64')
  if not 1 <= array.ndim <= MAX_NDIM:
    raise ValueError(f'can write 1 to {MAX_NDIM} dims, got {array.shape}')
  dims = list(array.shape) + [1] * (3 - array.ndim)
  header = np.array([DTYPE_TO_MAGIC[dtype], array.ndim, *dims], '<i4')
  return header.tobytes() + np.ascontiguousarray(array, dtype).tobytes()


def write_norb_matrix(path: PathLike, array: ArrayLike) -> None:
  """Writes ``array`` as a file of the release; gzip when ``path`` ends in .gz.

  The exact layout of the NYU files, e.g. to build a small fake release::

    write_norb_matrix(d / f'{SPLIT_FILES["training"]}-dat.mat', dat)  # uint8
    write_norb_matrix(d / f'{SPLIT_FILES["training"]}-cat.mat', cat)  # int32
    write_norb_matrix(d / f'{SPLIT_FILES["training"]}-info.mat', info)

  Args:
    path: output file.
    array: uint8, int16, int32, float32 or float64, 1 to 16 dims.
  """
  data = norb_matrix_bytes(array)
  if os.fspath(path).endswith('.gz'):
    data = gzip.compress(data, mtime=0)
  with open(path, 'wb') as f:
    f.write(data)


# ----------------------------------------------------------------------------
# The release: reading, checking, downsampling, viewpoint splits.


class NorbArrays(NamedTuple):
  """One split of the release as stored.

  Attributes:
    dat: uint8 ``[N, 2, H, W]`` (96x96 in the release).
    cat: int32 ``[N]`` category 0-4.
    info: int32 ``[N, 4]``: instance, elevation 0-8, azimuth 0-34 (even),
      lighting 0-5.
  """

  dat: np.ndarray
  cat: np.ndarray
  info: np.ndarray


def _find_split_files(directory: Path, split: str) -> dict[str, Path] | None:
  files = {}
  for kind in ('dat', 'cat', 'info'):
    stem = f'{SPLIT_FILES[split]}-{kind}.mat'
    matches = [directory / stem, directory / f'{stem}.gz']
    matches += sorted(directory.glob(f'*-{split}-{kind}.mat'))
    matches += sorted(directory.glob(f'*-{split}-{kind}.mat.gz'))
    found = [m for m in matches if m.is_file()]
    if not found:
      return None
    files[kind] = found[0]
  return files


def find_release(directory: Path) -> dict[str, dict[str, Path]] | None:
  """``{'training': {'dat': path, ..}, 'testing': {..}}`` or None."""
  splits = {s: _find_split_files(directory, s) for s in SPLIT_FILES}
  return None if None in splits.values() else splits


def check_norb_arrays(arrays: NorbArrays, paths: dict[str, PathLike]
                      ) -> NorbArrays:
  """Checks shapes, dtypes, counts and value ranges; returns ``arrays``."""
  dat, cat, info = arrays
  if dat.dtype != np.uint8 or dat.ndim != 4 or dat.shape[1] != 2:
    raise data_error(paths['dat'], f'expected uint8 [N, 2, H, W] images, got '
                     f'{dat.dtype} {dat.shape}', _FIX)
  if dat.shape[2] % 2 or dat.shape[3] % 2:
    raise data_error(paths['dat'], f'image size {dat.shape[2:]} is not even '
                     '(cannot downsample by 2)', _FIX)
  n = dat.shape[0]
  if cat.ndim != 1 or cat.dtype.kind not in 'iu' or len(cat) != n:
    raise data_error(paths['cat'], f'expected integer [{n}] categories '
                     f'(one per image in {paths["dat"]}), got {cat.dtype} '
                     f'{cat.shape}', _FIX)
  if n and (cat.min() < 0 or cat.max() >= NUM_CLASSES):
    raise data_error(paths['cat'], f'categories outside 0-{NUM_CLASSES - 1}: '
                     f'{sorted(set(cat.tolist()))}', _FIX)
  if info.ndim != 2 or info.shape != (n, 4) or info.dtype.kind not in 'iu':
    raise data_error(paths['info'], f'expected integer [{n}, 4] info, got '
                     f'{info.dtype} {info.shape}', _FIX)
  elevation, azimuth, lighting = info[:, 1], info[:, 2], info[:, 3]
  if n and not (elevation.min() >= 0 and elevation.max() <= 8
                and azimuth.min() >= 0 and azimuth.max() <= 34
                and not np.any(azimuth % 2) and lighting.min() >= 0
                and lighting.max() <= 5):
    raise data_error(paths['info'], 'values out of range (elevation 0-8, '
                     'azimuth 0-34 even, lighting 0-5)', _FIX)
  return NorbArrays(dat, cat.astype(np.int32), info.astype(np.int32))


def read_release_split(files: dict[str, PathLike]) -> NorbArrays:
  """Reads and checks one split, ``files = {'dat': .., 'cat': .., 'info': ..}``."""
  arrays = NorbArrays(*(read_norb_matrix(files[k])
                        for k in ('dat', 'cat', 'info')))
  return check_norb_arrays(arrays, files)


def downsample(dat: np.ndarray, *, method: str = 'mean',
               chunk: int = 2048) -> np.ndarray:
  """Halves the release's images, by ``method``.

  'mean' (capsjax): the 2x2 mean (an area resize), rounded half up.
  'pick' (the released code): pixel (2i, 2j), the top-left of each 2x2
  block. ``norb_record._read_and_decode`` calls ``tf.image.resize_images``
  with its TF1 defaults: bilinear, ``align_corners=False`` and the legacy
  pixel mapping src = dst * in / out, so output (i, j) samples source
  (2i, 2j) with a zero weight on its neighbours: a copy, no interpolation.

  Args:
    dat: uint8 ``[N, C, H, W]`` as stored (C = 2, the stereo pair).
    method: 'mean' or 'pick'.
  Returns:
    uint8 ``[N, H/2, W/2, C]`` (channels last).
  """
  if method not in DOWNSAMPLE_METHODS:
    raise ValueError(f'method must be one of {DOWNSAMPLE_METHODS}, got '
                     f'{method!r}')
  n, c, h, w = dat.shape
  if method == 'pick':
    return np.ascontiguousarray(dat[:, :, ::2, ::2].transpose(0, 2, 3, 1))
  out = np.empty((n, h // 2, w // 2, c), np.uint8)
  for start in range(0, n, chunk):
    block = dat[start:start + chunk].reshape(-1, c, h // 2, 2, w // 2, 2)
    total = block.sum(axis=(3, 5), dtype=np.uint16)
    out[start:start + chunk] = ((total + 2) // 4).transpose(0, 2, 3, 1)
  return out


def viewpoint_mask(info: np.ndarray, viewpoint_split: str) -> np.ndarray:
  """True where an example's viewpoint belongs to the TRAINING viewpoints.

  Args:
    info: int ``[N, 4]``.
    viewpoint_split: 'azimuth' (train azimuths ``TRAIN_AZIMUTHS_DEGREES``) or
      'elevation' (train elevations ``TRAIN_ELEVATIONS``).
  Returns:
    bool ``[N]``.
  """
  if viewpoint_split == 'azimuth':
    return np.isin(info[:, 2] * 10, TRAIN_AZIMUTHS_DEGREES)
  if viewpoint_split == 'elevation':
    return np.isin(info[:, 1], TRAIN_ELEVATIONS)
  raise ValueError(f"viewpoint_split must be one of {VIEWPOINT_SPLITS}, got "
                   f'{viewpoint_split!r}')


def to_split(arrays: NorbArrays, *, stereo: bool = True,
             downsample_method: str = 'mean') -> Split:
  """Downsampled 48x48 images (2 channels, or the left image) and categories.

  ``downsample_method``: see ``downsample``.
  """
  dat = arrays.dat if stereo else arrays.dat[:, :1]
  return Split(downsample(dat, method=downsample_method),
               arrays.cat.astype(np.int32))


def _load_tfds_release() -> dict[str, NorbArrays]:
  tfds = import_tfds('smallnorb')
  out = {}
  for split, tfds_split in (('training', 'train'), ('testing', 'test')):
    d = tfds.as_numpy(tfds.load('smallnorb', split=tfds_split, batch_size=-1))
    dat = np.stack([d['image'][..., 0], d['image2'][..., 0]], axis=1)
    # TFDS stores the azimuth as 0..17 (steps of 20 degrees), the release as
    # 0, 2, .., 34 (steps of 10 degrees).
    info = np.stack([d['instance'], d['label_elevation'],
                     2 * d['label_azimuth'], d['label_lighting']], axis=1)
    out[split] = NorbArrays(dat.astype(np.uint8),
                            d['label_category'].astype(np.int32),
                            info.astype(np.int32))
  return out


def load_release(*, data_dir: PathLike | None = None,
                 source: str = 'auto') -> dict[str, NorbArrays]:
  """``{'training': NorbArrays, 'testing': NorbArrays}`` from files or TFDS.

  Directory resolution as ``load_dataset`` (data_dir, $CAPSJAX_DATA_DIR,
  ../shared/data/smallnorb); TFDS when ``source='tfds'``, or when nothing is
  found and ``source='auto'`` and tensorflow-datasets is installed.
  """
  if source not in ('auto', 'local', 'tfds'):
    raise ValueError(f"source must be 'auto', 'local' or 'tfds', got {source!r}")
  if source != 'tfds':
    places = candidate_dirs(SUBDIRS, data_dir)
    found = search_dirs(places, find_release)
    if found is not None:
      return {s: read_release_split(f) for s, f in found[1].items()}
    if source == 'local' or data_dir is not None:
      raise FileNotFoundError(_not_found(places, tfds_tried=False))
    try:
      import_tfds('smallnorb')
    except ImportError as e:
      raise FileNotFoundError(_not_found(places, tfds_tried=True)) from e
  return _load_tfds_release()


def _not_found(places, *, tfds_tried: bool) -> str:
  return not_found_message(
      'smallNORB', places, '*-training-{dat,cat,info}.mat and '
      '*-testing-{dat,cat,info}.mat, optionally .gz', 'smallnorb',
      tfds_tried=tfds_tried)


def load_smallnorb(*, data_dir: PathLike | None = None,
                   validation_size: int = 5000, source: str = 'auto',
                   stereo: bool = True,
                   viewpoint_split: str | None = None,
                   downsample: str = 'mean') -> Dataset:
  """smallNORB at 48x48, labels = category 0-4.

  Args:
    data_dir: directory with the six release files (or a smallnorb/
      subdirectory with them).
    validation_size: the last ``validation_size`` examples of the (filtered)
      training file, in the release's order; 0 gives an empty split.
    source: 'auto', 'local' or 'tfds' (see ``load_release``).
    stereo: 2 channels (both stereo images) if True, else the left image.
    viewpoint_split: None (the standard split), 'azimuth' or 'elevation':
      train on the training viewpoints (``viewpoint_mask``) of the training
      file, test on the other viewpoints of the test file.
    downsample: how 96x96 becomes 48x48: 'mean' (capsjax's 2x2 mean) or
      'pick' (the released code's pixel (2i, 2j)); see ``downsample``.

  Returns:
    ``Dataset`` with uint8 ``[N, 48, 48, C]`` images.
  """
  if viewpoint_split not in VIEWPOINT_SPLITS:
    raise ValueError(f'viewpoint_split must be one of {VIEWPOINT_SPLITS}, got '
                     f'{viewpoint_split!r}')
  if downsample not in DOWNSAMPLE_METHODS:
    raise ValueError(f'downsample must be one of {DOWNSAMPLE_METHODS}, got '
                     f'{downsample!r}')
  release = load_release(data_dir=data_dir, source=source)
  train, test = release['training'], release['testing']
  if viewpoint_split is not None:
    train = NorbArrays(*(a[viewpoint_mask(train.info, viewpoint_split)]
                         for a in train))
    test = NorbArrays(*(a[~viewpoint_mask(test.info, viewpoint_split)]
                        for a in test))
  train_split = to_split(train, stereo=stereo, downsample_method=downsample)
  train_split, validation = carve_validation(*train_split, validation_size)
  name = 'smallnorb' + (f'_{viewpoint_split}' if viewpoint_split else '')
  test_split = to_split(test, stereo=stereo, downsample_method=downsample)
  return Dataset(train_split, validation, test_split, NUM_CLASSES, name)


# ----------------------------------------------------------------------------
# Preprocessing (pure JAX, jit-able): the EM paper's crops and normalisation.


def standardize(images: ArrayLike) -> jax.Array:
  """tf.image.per_image_standardization of each image.

  (x - mean) / max(std, 1 / sqrt(H W C)), mean and std over all of an
  image's pixels and channels.

  Args:
    images: ``[B, H, W, C]``.
  Returns:
    float32 ``[B, H, W, C]``.
  """
  x = jnp.asarray(images, jnp.float32)
  num_elements = math.prod(x.shape[1:])
  mean = jnp.mean(x, axis=(1, 2, 3), keepdims=True)
  std = jnp.std(x, axis=(1, 2, 3), keepdims=True)
  return (x - mean) / jnp.maximum(std, 1.0 / math.sqrt(num_elements))


def crop(images: ArrayLike, offsets: ArrayLike, *,
         crop_size: int = CROP_SIZE) -> jax.Array:
  """Crops each image at its own top-left corner.

  Args:
    images: ``[B, H, W, C]``.
    offsets: int ``[B, 2]`` (row, column) of the top-left corner, each in
      ``[0, H - crop_size]`` (``lax.dynamic_slice`` clamps larger ones).
  Returns:
    ``[B, crop_size, crop_size, C]``, dtype of ``images``.
  """
  images = jnp.asarray(images)
  size = (crop_size, crop_size, images.shape[-1])
  one = lambda image, o: jax.lax.dynamic_slice(image, (o[0], o[1], 0), size)
  return jax.vmap(one)(images, jnp.asarray(offsets, jnp.int32))


def _check_crop(images: jax.Array, crop_size: int) -> None:
  if images.ndim != 4 or min(images.shape[1:3]) < crop_size:
    raise ValueError(f'expected [B, H, W, C] images with H, W >= {crop_size},'
                     f' got {images.shape}')


def _to_pixel_range(images: jax.Array, pixel_max: float) -> jax.Array:
  """uint8 -> float32 in [0, pixel_max] (1: capsjax's [0, 1]; 255: as stored)."""
  return images.astype(jnp.float32) / (255.0 / pixel_max)


def smallnorb_train_draws(
    key: jax.Array, batch_size: int, height: int, width: int, *,
    crop_size: int = CROP_SIZE,
    max_brightness_delta: float = MAX_BRIGHTNESS_DELTA,
    contrast_range: tuple[float, float] = CONTRAST_RANGE
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The random draws of ``smallnorb_train_preprocess``, one set per image.

  Returns:
    offsets: int32 ``[B, 2]`` top-left (row, column) of the crop, uniform
      over all ``(height - crop_size + 1) x (width - crop_size + 1)``
      positions (tf.random_crop's).
    delta: float32 ``[B]`` brightness delta uniform in
      ``[-max_brightness_delta, max_brightness_delta)``, a fraction of the
      pixel range (tf.image.random_brightness's max_delta=63 on 0-255).
    factor: float32 ``[B]`` contrast factor uniform in ``contrast_range``
      (tf.image.random_contrast's).
  """
  crop_key, brightness_key, contrast_key = jax.random.split(key, 3)
  offsets = jax.random.randint(crop_key, (batch_size, 2), 0,
                               jnp.array([[height - crop_size + 1,
                                           width - crop_size + 1]]))
  delta = jax.random.uniform(brightness_key, (batch_size,),
                             minval=-max_brightness_delta,
                             maxval=max_brightness_delta)
  factor = jax.random.uniform(contrast_key, (batch_size,),
                              minval=contrast_range[0],
                              maxval=contrast_range[1])
  return offsets, delta, factor


def _brightness_contrast(x: jax.Array, delta: jax.Array, factor: jax.Array
                         ) -> jax.Array:
  """x + delta, then each channel's deviation from its mean times factor.

  tf.image.adjust_brightness then adjust_contrast on float images (no
  clipping); the mean is over all of x's rows and columns.
  x: ``[B, H, W, C]``; delta, factor: ``[B]`` in x's units / unitless.
  """
  x = x + delta[:, None, None, None]
  channel_mean = jnp.mean(x, axis=(1, 2), keepdims=True)
  return (x - channel_mean) * factor[:, None, None, None] + channel_mean


def smallnorb_distort(images: ArrayLike, offsets: ArrayLike, delta: ArrayLike,
                      factor: ArrayLike, *, crop_size: int = CROP_SIZE,
                      order: str = 'crop_first', pixel_max: float = 1.0
                      ) -> jax.Array:
  """The training distortions for given draws (``smallnorb_train_draws``).

  Pixels are first scaled to [0, ``pixel_max``]; the brightness delta is
  ``delta * pixel_max``. Then, by ``order``:

  'crop_first' (capsjax): the crop at ``offsets``, brightness, contrast
  about each channel's mean over the 32x32 crop, ``standardize``.
  'released' (the released ``norb_record._read_and_decode``, distort=1):
  brightness and contrast on the whole 48x48 image (each channel's mean over
  48x48), then the crop, then ``standardize``.

  ``pixel_max``: 1 (capsjax, [0, 1]) or 255 (the released code, which
  never rescales the stored bytes). It only matters through the std floor
  1/sqrt(32 * 32 * C) of ``standardize``: in [0, 1] it binds on crops whose
  std is below ~5.6 grey levels (C = 2), e.g. low-contrast crops after a
  contrast factor near 0.2; in 0-255 practically never.

  The standardisation removes the brightness delta exactly in both orders
  and, above the floor, the contrast factor for one channel; with two
  channels the contrast step moves the channels' means apart or together.
  In 'released' those means are the 48x48 image's, not the crop's.

  Args:
    images: uint8 ``[B, H, W, C]`` (48x48 smallNORB).
    offsets: int ``[B, 2]``; delta, factor: ``[B]``.
  Returns:
    float32 ``[B, crop_size, crop_size, C]``.
  """
  if order not in AUGMENT_ORDERS:
    raise ValueError(f'order must be one of {AUGMENT_ORDERS}, got {order!r}')
  images = jnp.asarray(images)
  _check_crop(images, crop_size)
  delta = jnp.asarray(delta, jnp.float32) * pixel_max
  factor = jnp.asarray(factor, jnp.float32)
  if order == 'crop_first':
    x = _to_pixel_range(crop(images, offsets, crop_size=crop_size), pixel_max)
    return standardize(_brightness_contrast(x, delta, factor))
  x = _brightness_contrast(_to_pixel_range(images, pixel_max), delta, factor)
  return standardize(crop(x, offsets, crop_size=crop_size))


def smallnorb_train_preprocess(
    key: jax.Array, images: ArrayLike, *, crop_size: int = CROP_SIZE,
    max_brightness_delta: float = MAX_BRIGHTNESS_DELTA,
    contrast_range: tuple[float, float] = CONTRAST_RANGE,
    order: str = 'crop_first', pixel_max: float = 1.0) -> jax.Array:
  """Training distortions of the authors' code, per image.

  ``smallnorb_distort(images, *smallnorb_train_draws(key, ...))``: a random
  ``crop_size`` crop, a brightness delta (no clipping, as
  tf.image.random_brightness on float images), a contrast factor
  (tf.image.random_contrast), ``standardize``; ``order`` and ``pixel_max``
  choose capsjax's form (crop first, [0, 1]) or the released code's
  (brightness and contrast on the 48x48 image, then the crop; 0-255).

  Args:
    key: PRNG key; split into (crop, brightness, contrast) keys.
    images: uint8 ``[B, H, W, C]`` (48x48 smallNORB).
  Returns:
    float32 ``[B, crop_size, crop_size, C]``.
  """
  images = jnp.asarray(images)
  _check_crop(images, crop_size)
  b, h, w, _ = images.shape
  draws = smallnorb_train_draws(key, b, h, w, crop_size=crop_size,
                                max_brightness_delta=max_brightness_delta,
                                contrast_range=contrast_range)
  return smallnorb_distort(images, *draws, crop_size=crop_size, order=order,
                           pixel_max=pixel_max)


def smallnorb_eval_preprocess(images: ArrayLike, *,
                              crop_size: int = CROP_SIZE,
                              pixel_max: float = 1.0) -> jax.Array:
  """Centre crop (top-left ``((H - crop_size) // 2, ..)``) then ``standardize``.

  The released code's test crop too (tf.image.resize_image_with_crop_or_pad).
  ``pixel_max``: the pixel range standardised, as ``smallnorb_distort``.

  Args:
    images: uint8 ``[B, H, W, C]``.
  Returns:
    float32 ``[B, crop_size, crop_size, C]``.
  """
  images = jnp.asarray(images)
  _check_crop(images, crop_size)
  x = center_crop(images, crop_size)
  return standardize(_to_pixel_range(x, pixel_max))


def _glimpse_corner(offset: int, size: int, glimpse: int) -> int:
  """The first row (or column) TF1's ExtractGlimpse takes for a centred,
  unnormalised ``offset`` of the glimpse's centre: it halves the offset, adds
  half the image, removes half the glimpse and truncates toward zero (the
  op's own arithmetic; ``tf.compat.v1.image.extract_glimpse`` keeps it)."""
  return math.trunc(offset / 2 + size / 2 - glimpse / 2)


def multicrop_offsets(height: int, width: int, num_crops: int = 13, *,
                      crop_size: int = CROP_SIZE, pattern: str = 'grid'
                      ) -> tuple[tuple[int, int], ...]:
  """Top-left corners of the test-time crops, the centre first.

  ``pattern='grid'`` (capsjax): with ``m = H - crop_size`` (16 for 48x48
  images) the 13 corners are, in order: the centre (m/2, m/2); the 4 corners
  (0, 0), (0, m), (m, 0), (m, m); the 4 edge midpoints (0, m/2), (m/2, 0),
  (m/2, m), (m, m/2); the 4 inner points (m/4, m/4), (m/4, 3m/4),
  (3m/4, m/4), (3m/4, 3m/4) (fractions rounded down).

  ``pattern='released'`` (``norb_record.inputs`` with patching, the test of
  ``experiment.eval_once`` that run.sh runs): the centre crop, then
  ``tf.image.extract_glimpse(centered=True, normalized=False)`` at glimpse
  centres k (dy, dx) for k = 1, 2, 3 and (dy, dx) in (1, 1), (1, -1),
  (-1, 1), (-1, -1). The op halves those offsets (``_glimpse_corner``), so
  on 48x48 the corners are (8, 8), then (8, 8), (8, 7), (7, 8), (7, 7);
  (9, 9), (9, 7), (7, 9), (7, 7); (9, 9), (9, 6), (6, 9), (6, 6): shifts of
  at most 2 pixels, with repeats (the centre, (7, 7) and (9, 9) twice
  each), all kept.

  ``num_crops < 13`` takes the first ``num_crops``.
  """
  if not 1 <= num_crops <= 13:
    raise ValueError(f'num_crops must be in [1, 13], got {num_crops}')
  if pattern not in MULTICROP_PATTERNS:
    raise ValueError(f'pattern must be one of {MULTICROP_PATTERNS}, got '
                     f'{pattern!r}')
  my, mx = height - crop_size, width - crop_size
  if pattern == 'released':
    corners = [(my // 2, mx // 2)]
    for k in (1, 2, 3):
      for sy, sx in ((1, 1), (1, -1), (-1, 1), (-1, -1)):
        corners.append((_glimpse_corner(k * sy, height, crop_size),
                        _glimpse_corner(k * sx, width, crop_size)))
    return tuple(corners[:num_crops])
  fractions = ((2, 2), (0, 0), (0, 4), (4, 0), (4, 4), (0, 2), (2, 0),
               (2, 4), (4, 2), (1, 1), (1, 3), (3, 1), (3, 3))
  return tuple((fy * my // 4, fx * mx // 4)
               for fy, fx in fractions[:num_crops])


def smallnorb_multicrop(images: ArrayLike, num_crops: int = 13, *,
                        crop_size: int = CROP_SIZE, pattern: str = 'grid',
                        pixel_max: float = 1.0) -> jax.Array:
  """Standardised test-time crops (``multicrop_offsets``) for averaging.

  Args:
    images: uint8 ``[B, H, W, C]``.
    pattern: 'grid' or 'released' (see ``multicrop_offsets``).
    pixel_max: the pixel range standardised, as ``smallnorb_distort``.
  Returns:
    float32 ``[num_crops, B, crop_size, crop_size, C]``; entry 0 equals
    ``smallnorb_eval_preprocess(images, pixel_max=pixel_max)``.
  """
  images = jnp.asarray(images)
  _check_crop(images, crop_size)
  x = _to_pixel_range(images, pixel_max)
  offsets = multicrop_offsets(images.shape[1], images.shape[2], num_crops,
                              crop_size=crop_size, pattern=pattern)
  return jnp.stack([standardize(x[:, top:top + crop_size, left:left + crop_size])
                    for top, left in offsets])


def combine_crop_activations(activations: ArrayLike) -> jax.Array:
  """Class scores of several crops of each image: sum_n a_n / sum_k a_nk.

  ``experiment.eval_once`` of the released code: each crop's class
  activations are divided by their sum over the classes, then summed over
  the crops; the argmax is the prediction. A crop whose activations are all
  0 adds nothing (the released code would give NaN).

  Args:
    activations: ``[N, B, K]`` non-negative class activations of N crops.
  Returns:
    ``[B, K]``.
  """
  a = _at_least_float32(activations)
  total = jnp.sum(a, axis=-1, keepdims=True)
  return jnp.sum(a / jnp.maximum(total, jnp.finfo(a.dtype).tiny), axis=0)


def _at_least_float32(x: ArrayLike) -> jax.Array:
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))
