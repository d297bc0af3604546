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


def downsample(dat: np.ndarray, *, chunk: int = 2048) -> np.ndarray:
  """2x2 mean pooling (area resize to half size), rounded half up.

  Args:
    dat: uint8 ``[N, 2, H, W]`` as stored.
  Returns:
    uint8 ``[N, H/2, W/2, 2]`` (channels last).
  """
  n, c, h, w = dat.shape
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


def to_split(arrays: NorbArrays, *, stereo: bool = True) -> Split:
  """Downsampled 48x48 images (2 channels, or the left image) and categories."""
  dat = arrays.dat if stereo else arrays.dat[:, :1]
  return Split(downsample(dat), arrays.cat.astype(np.int32))


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
                   viewpoint_split: str | None = None) -> Dataset:
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

  Returns:
    ``Dataset`` with uint8 ``[N, 48, 48, C]`` images.
  """
  if viewpoint_split not in VIEWPOINT_SPLITS:
    raise ValueError(f'viewpoint_split must be one of {VIEWPOINT_SPLITS}, got '
                     f'{viewpoint_split!r}')
  release = load_release(data_dir=data_dir, source=source)
  train, test = release['training'], release['testing']
  if viewpoint_split is not None:
    train = NorbArrays(*(a[viewpoint_mask(train.info, viewpoint_split)]
                         for a in train))
    test = NorbArrays(*(a[~viewpoint_mask(test.info, viewpoint_split)]
                        for a in test))
  train_split = to_split(train, stereo=stereo)
  train_split, validation = carve_validation(*train_split, validation_size)
  name = 'smallnorb' + (f'_{viewpoint_split}' if viewpoint_split else '')
  return Dataset(train_split, validation, to_split(test, stereo=stereo),
                 NUM_CLASSES, name)


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


def smallnorb_train_preprocess(
    key: jax.Array, images: ArrayLike, *, crop_size: int = CROP_SIZE,
    max_brightness_delta: float = MAX_BRIGHTNESS_DELTA,
    contrast_range: tuple[float, float] = CONTRAST_RANGE) -> jax.Array:
  """Training distortions of the authors' code, per image.

  Scale to [0, 1]; a random ``crop_size`` crop (top-left uniform over all
  ``(H - crop_size + 1)^2`` positions); add a brightness delta uniform in
  ``[-max_brightness_delta, max_brightness_delta)`` (one per image, no
  clipping, as tf.image.random_brightness on float images); scale the
  deviation from each channel's mean by a contrast factor uniform in
  ``contrast_range`` (tf.image.random_contrast); ``standardize``.

  Note: the final standardisation removes the brightness delta exactly, and
  the contrast factor too for one channel (apart from near-constant crops,
  where the std floor binds). With two channels the contrast step survives
  only as a rescaling of the difference between the channels' means. Both
  are kept for fidelity to the authors' pipeline.

  Args:
    key: PRNG key; split into (crop, brightness, contrast) keys.
    images: uint8 ``[B, H, W, C]`` (48x48 smallNORB).
  Returns:
    float32 ``[B, crop_size, crop_size, C]``.
  """
  images = jnp.asarray(images)
  _check_crop(images, crop_size)
  b, h, w, _ = images.shape
  crop_key, brightness_key, contrast_key = jax.random.split(key, 3)
  offsets = jax.random.randint(crop_key, (b, 2), 0,
                               jnp.array([[h - crop_size + 1,
                                           w - crop_size + 1]]))
  x = crop(images, offsets, crop_size=crop_size).astype(jnp.float32) / 255.0
  delta = jax.random.uniform(brightness_key, (b, 1, 1, 1),
                             minval=-max_brightness_delta,
                             maxval=max_brightness_delta)
  x = x + delta
  factor = jax.random.uniform(contrast_key, (b, 1, 1, 1),
                              minval=contrast_range[0],
                              maxval=contrast_range[1])
  channel_mean = jnp.mean(x, axis=(1, 2), keepdims=True)
  x = (x - channel_mean) * factor + channel_mean
  return standardize(x)


def smallnorb_eval_preprocess(images: ArrayLike, *,
                              crop_size: int = CROP_SIZE) -> jax.Array:
  """Centre crop (top-left ``((H - crop_size) // 2, ..)``) then ``standardize``.

  Args:
    images: uint8 ``[B, H, W, C]``.
  Returns:
    float32 ``[B, crop_size, crop_size, C]``.
  """
  images = jnp.asarray(images)
  _check_crop(images, crop_size)
  x = center_crop(images, crop_size)
  return standardize(x.astype(jnp.float32) / 255.0)


def multicrop_offsets(height: int, width: int, num_crops: int = 13, *,
                      crop_size: int = CROP_SIZE) -> tuple[tuple[int, int], ...]:
  """Top-left corners of the test-time crops, the centre first.

  With ``m = H - crop_size`` (16 for 48x48 images) the 13 corners are, in
  order: the centre (m/2, m/2); the 4 corners (0, 0), (0, m), (m, 0), (m, m);
  the 4 edge midpoints (0, m/2), (m/2, 0), (m/2, m), (m, m/2); the 4 inner
  points (m/4, m/4), (m/4, 3m/4), (3m/4, m/4), (3m/4, 3m/4) (fractions
  rounded down). ``num_crops < 13`` takes the first ``num_crops``.
  """
  if not 1 <= num_crops <= 13:
    raise ValueError(f'num_crops must be in [1, 13], got {num_crops}')
  my, mx = height - crop_size, width - crop_size
  fractions = ((2, 2), (0, 0), (0, 4), (4, 0), (4, 4), (0, 2), (2, 0),
               (2, 4), (4, 2), (1, 1), (1, 3), (3, 1), (3, 3))
  return tuple((fy * my // 4, fx * mx // 4)
               for fy, fx in fractions[:num_crops])


def smallnorb_multicrop(images: ArrayLike, num_crops: int = 13, *,
                        crop_size: int = CROP_SIZE) -> jax.Array:
  """Standardised test-time crops (``multicrop_offsets``) for averaging.

  Args:
    images: uint8 ``[B, H, W, C]``.
  Returns:
    float32 ``[num_crops, B, crop_size, crop_size, C]``; entry 0 equals
    ``smallnorb_eval_preprocess(images)``.
  """
  images = jnp.asarray(images)
  _check_crop(images, crop_size)
  x = images.astype(jnp.float32) / 255.0
  offsets = multicrop_offsets(images.shape[1], images.shape[2], num_crops,
                              crop_size=crop_size)
  return jnp.stack([standardize(x[:, top:top + crop_size, left:left + crop_size])
                    for top, left in offsets])
