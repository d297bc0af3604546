"""Your own images: a folder, a ``.npz`` of arrays or a TFDS dataset, decoded
once into uint8 ``Split``s of one size and channel count, and cached.

Sources (``read_images``):
  - a folder with one subfolder per class (PNG, JPEG, BMP, GIF, TIFF, WebP;
    any sizes, grey or colour; subfolders of a class are read too),
    optionally split into ``train/`` and ``test/`` folders of that shape,
    and a validation folder beside them (``val/``, ``valid/`` or
    ``validation/``); the class names are the subfolder names, sorted;
  - a ``.npz`` file of arrays ``x_train`` [N, H, W(, C)], ``y_train`` [N],
    optionally ``x_test``, ``y_test`` and ``class_names``;
  - ``tfds:NAME``, an image-classification dataset of TensorFlow Datasets,
    read (never downloaded) from its data_dir.

Pillow decodes the files and TFDS its own records; Pillow then resizes every
image to ``image_size`` x ``image_size``: ``'center_crop'`` keeps the central
square (the aspect ratio) and ``'stretch'`` the whole image. ``channels`` 0
keeps grey data grey (1 channel) and makes everything RGB (3) as soon as one
image is in colour; 1 or 3 converts every image. An image with an alpha
channel (or a transparent palette colour) is composited onto white, as a
viewer shows it: dark shapes on a transparent background stay dark on
white; the report warns about images whose shape lies in the alpha channel
alone (their colour is the same wherever they are visible).

``read_cached`` decodes once into ``cache_dir`` (uncompressed ``.npy`` files
and ``meta.json``, published by one rename), keyed by the source's files
(paths, sizes, modification times) and the decoding options: a training run
then reads uint8 arrays and never waits for a decoder.

A source that cannot be used raises ``DataError``, one line naming the file
or folder, before anything is written; files that cannot be decoded are
all named, one line each, whichever split they are in.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import sys
import time
import zipfile
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import NamedTuple

import numpy as np

from capsjax.data.idx import TFDS_INSTALL
from capsjax.data.idx import DataError
from capsjax.data.idx import Dataset
from capsjax.data.idx import PathLike
from capsjax.data.idx import Split

IMAGE_EXTENSIONS = frozenset(
    {'.png', '.jpg', '.jpeg', '.bmp', '.gif', '.tif', '.tiff', '.webp'})
RESIZE_MODES = ('center_crop', 'stretch')
CHANNELS = (0, 1, 3)
TFDS_PREFIX = 'tfds:'
# Bumped when decoding changes, so that older caches are not read.
CACHE_VERSION = 2
# Pillow's modes of grey images (16-bit and float ones included).
_GREY_MODES = frozenset({'1', 'L', 'LA', 'La', 'I', 'I;16', 'I;16B', 'I;16L',
                         'I;16N', 'F'})
# Files named in a line of the report; the rest are counted.
_NAMED_FILES = 5
# The folders beside train/ read as the validation split.
VALIDATION_FOLDERS = ('val', 'valid', 'validation')
# Pillow's modes with an alpha channel.
_ALPHA_MODES = frozenset({'RGBA', 'RGBa', 'LA', 'La', 'PA'})


def _pil():
  """Pillow's Image module (a dependency of capsjax and of matplotlib)."""
  from PIL import Image
  return Image


class ImageOptions(NamedTuple):
  """How every image is decoded (part of the cache key).

  image_size: the side of the square images the model reads.
  channels: 0 (from the data), 1 (grey) or 3 (RGB).
  resize_mode: 'center_crop' or 'stretch'.
  skip_bad_images: skip (and count) files that cannot be decoded instead of
    stopping at the first one.
  """

  image_size: int = 32
  channels: int = 0
  resize_mode: str = 'center_crop'
  skip_bad_images: bool = False


DEFAULT_OPTIONS = ImageOptions()


def check_options(options: ImageOptions) -> None:
  """ValueError naming the config key of the first bad option."""
  size = options.image_size
  if isinstance(size, bool) or not isinstance(size, int) or size < 8:
    raise ValueError(f'config.image_size must be an int >= 8, got {size!r}.')
  if options.channels not in CHANNELS:
    raise ValueError(f'config.channels must be 0 (from the data), 1 or 3, got '
                     f'{options.channels!r}.')
  if options.resize_mode not in RESIZE_MODES:
    raise ValueError(f'config.resize_mode must be one of {RESIZE_MODES}, got '
                     f'{options.resize_mode!r}.')


class OwnImages(NamedTuple):
  """A source read at one size: uint8 ``[N, S, S, C]`` splits.

  test: None when the source has no test split (one is held out later).
  report: counts and notes for the user (``report_lines``).
  validation: None when the source has no validation split (one is carved
    from the training images later).
  """

  train: Split
  test: Split | None
  class_names: tuple[str, ...]
  report: dict[str, Any]
  validation: Split | None = None


# ----------------------------------------------------------------------------
# One image.


def _scaled_16bit(image):
  """A 16-bit or float grey image as 8-bit 'L'."""
  Image = _pil()
  array = np.asarray(image, np.float64)
  if image.mode == 'F':
    array = array * 255.0 if array.size and array.max() <= 1.0 else array
  elif image.mode != 'I' or (array.size and array.max() > 255):
    array = array / 257.0  # 0..65535 -> 0..255
  return Image.fromarray(np.clip(np.rint(array), 0, 255).astype(np.uint8))


def _has_alpha(image) -> bool:
  """Whether a Pillow image has an alpha channel or a transparent colour."""
  return image.mode in _ALPHA_MODES or (
      image.mode in ('1', 'L', 'P', 'RGB') and 'transparency' in image.info)


def onto_white(image) -> tuple[Any, bool]:
  """A Pillow image with an alpha channel (or a transparent colour)
  composited onto white, as 'L' (grey) or 'RGB'; others as they are.

  Returns the image and whether its shape lies in the alpha channel alone:
  the alpha varies while the colour is the same wherever the image is
  visible (strokes drawn in one colour on a transparent background). Such a
  file decoded without its alpha would be one flat colour.
  """
  if not _has_alpha(image):
    return image, False
  Image = _pil()
  grey = image.mode in ('1', 'L', 'LA', 'La')
  array = np.asarray(image.convert('LA' if grey else 'RGBA'), np.uint32)
  colour, alpha = array[..., :-1], array[..., -1:]
  # Exact integer rounding of colour * a + white * (1 - a), a = alpha / 255.
  flat = (colour * alpha + 255 * (255 - alpha) + 127) // 255
  flat = flat.astype(np.uint8)
  visible = colour[alpha[..., 0] > 0]
  shape_in_alpha = bool(alpha.min() != alpha.max() and len(visible) and
                        (visible.min(axis=0) == visible.max(axis=0)).all())
  return Image.fromarray(flat[..., 0] if grey else flat), shape_in_alpha


def as_grey_or_rgb(image) -> tuple[Any, bool]:
  """A Pillow image as 'L' (grey modes) or 'RGB' (every other mode;
  palettes expanded; an alpha channel dropped: ``onto_white`` first keeps
  what it shows); and whether it was grey."""
  if image.mode in _GREY_MODES:
    if image.mode in ('I', 'F') or image.mode.startswith('I;16'):
      return _scaled_16bit(image), True
    return (image if image.mode == 'L' else image.convert('L')), True
  return (image if image.mode == 'RGB' else image.convert('RGB')), False


def crop_box(width: int, height: int, resize_mode: str
             ) -> tuple[int, int, int, int]:
  """The region of a ``width`` x ``height`` image that becomes the square:
  the central square ('center_crop') or all of it ('stretch')."""
  if resize_mode == 'stretch':
    return (0, 0, width, height)
  side = min(width, height)
  left, top = (width - side) // 2, (height - side) // 2
  return (left, top, left + side, top + side)


def fit_image(image, image_size: int, resize_mode: str):
  """A Pillow image resized to ``image_size`` squared (bilinear, with
  Pillow's antialiasing when it shrinks); an image already of that size is
  copied, pixel for pixel."""
  Image = _pil()
  box = crop_box(*image.size, resize_mode)
  # reducing_gap: large photos are first reduced by whole factors (box
  # filter), several times faster than one bilinear pass over all pixels.
  return image.resize((image_size, image_size), Image.Resampling.BILINEAR,
                      box=box, reducing_gap=3.0)


class Decoded(NamedTuple):
  """One image file decoded (``decode_image``)."""

  array: np.ndarray  # uint8 [S, S, 3], grey images replicated
  grey: bool
  size: tuple[int, int]  # the image's (width, height) as shown: EXIF rotation applied
  shape_in_alpha: bool  # composited onto white (``onto_white``)


_EXIF_ORIENTATION = 0x0112


def decode_image(path: PathLike, image_size: int, resize_mode: str
                 ) -> Decoded:
  """One image file, decoded by Pillow (an alpha channel composited onto
  white).

  Raises:
    DataError: Pillow cannot read it (not an image, truncated, corrupt).
  """
  Image = _pil()
  from PIL import ImageOps
  try:
    with Image.open(path) as image:
      size = image.size
      # EXIF orientations 5-8 turn the stored image a quarter: the shown
      # image's width is the stored height.
      if image.getexif().get(_EXIF_ORIENTATION, 1) in (5, 6, 7, 8):
        size = size[::-1]
      # JPEG only: decode at the smallest power-of-two scale that still
      # covers the target, a large saving on photos.
      image.draft(None, (image_size, image_size))
      image.load()  # a truncated file fails here, not later
      image = ImageOps.exif_transpose(image)  # phones store rotation in EXIF
      image, shape_in_alpha = onto_white(image)
      image, grey = as_grey_or_rgb(image)
      array = np.asarray(fit_image(image, image_size, resize_mode))
  except (OSError, SyntaxError, ValueError, Image.DecompressionBombError,
          EOFError) as e:
    raise DataError(f'{os.fspath(path)}: cannot decode this image '
                    f'({type(e).__name__}: {e})') from e
  if grey:
    array = np.repeat(array[..., None], 3, axis=-1)
  return Decoded(array, grey, size, shape_in_alpha)


# ----------------------------------------------------------------------------
# Many images.


def _progress(total: int, description: str):
  from tqdm import tqdm
  quiet = (os.environ.get('CAPSJAX_NO_PROGRESS') == '1' or
           not sys.stderr.isatty())
  return tqdm(total=total, desc=description, unit='img', disable=quiet,
              dynamic_ncols=True, mininterval=0.5)


def _decode_or_error(path: Path, image_size: int, resize_mode: str):
  try:
    return decode_image(path, image_size, resize_mode), None
  except DataError as e:
    return None, e


def decode_files(paths: Sequence[Path], options: ImageOptions, *,
                 description: str = 'decoding', threads: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray, list[int], dict[str, Any]]:
  """Decodes ``paths`` in threads (Pillow releases the GIL), in order; a file
  that cannot be decoded is passed over, never stopped at
  (``check_bad_files`` then says whether that is allowed).

  Returns:
    uint8 ``[M, S, S, 3]``, bool ``[M]`` (grey files), the indices into
    ``paths`` of the M decoded files, and counts for the report:
    'bad_files' and 'bad_messages' (every file passed over, with why),
    'alpha_files' and 'alpha_examples' (``onto_white``), 'median_size'.
  """
  size, mode = options.image_size, options.resize_mode
  images = np.empty((len(paths), size, size, 3), np.uint8)
  grey = np.zeros(len(paths), bool)
  kept, bad, alpha, sides = [], [], [], []
  threads = threads or min(8, os.cpu_count() or 1)
  with concurrent.futures.ThreadPoolExecutor(threads) as pool, _progress(
      len(paths), description) as bar:
    results = pool.map(lambda p: _decode_or_error(p, size, mode), paths)
    for i, (result, error) in enumerate(results):
      bar.update()
      if error is not None:
        bad.append(str(error))
        continue
      images[len(kept)] = result.array
      grey[len(kept)] = result.grey
      kept.append(i)
      sides.append(result.size)
      if result.shape_in_alpha:
        alpha.append(os.fspath(paths[i]))
  counts = {'bad_files': len(bad), 'bad_messages': bad,
            'alpha_files': len(alpha), 'alpha_examples': alpha[:_NAMED_FILES]}
  if sides:
    counts['median_size'] = [int(np.median([s[0] for s in sides])),
                             int(np.median([s[1] for s in sides]))]
  return images[:len(kept)], grey[:len(kept)], kept, counts


def check_bad_files(messages: Sequence[str], options: ImageOptions) -> None:
  """DataError naming every file that could not be decoded (one line each
  after the first when there are several), unless
  ``options.skip_bad_images``."""
  if not messages or options.skip_bad_images:
    return
  fix = ('set --config.skip_bad_images=True to skip (and count) files that '
         'cannot be decoded')
  if len(messages) == 1:
    raise DataError(f'{messages[0]}. Replace or remove it, or {fix}.')
  listed = ''.join(f'\n  {m}' for m in messages)
  raise DataError(f'{len(messages)} files cannot be decoded; replace or '
                  f'remove them, or {fix}:{listed}')


def to_rgb(images: np.ndarray) -> np.ndarray:
  """uint8 [N, S, S, 1] -> [N, S, S, 3], the grey value in each channel."""
  return np.repeat(images, 3, axis=-1) if images.shape[-1] == 1 else images


def to_grey(images: np.ndarray) -> np.ndarray:
  """uint8 [N, S, S, 3] -> [N, S, S, 1]: Pillow's 'L' conversion (ITU-R
  601-2 luma, L = (19595 R + 38470 G + 7471 B + 2^15) >> 16)."""
  if images.shape[-1] == 1:
    return images
  weights = np.array([19595, 38470, 7471], np.uint32)
  luma = (images.astype(np.uint32) @ weights + 0x8000) >> 16
  return luma.astype(np.uint8)[..., None]


def channel_count(grey: np.ndarray, channels: int) -> int:
  """``channels``, or for 0 what the data asks: 1 when every image of grey
  flags [N] is grey, else 3."""
  return channels or (1 if grey.all() else 3)


def channels_note(grey: np.ndarray, channels: int) -> str:
  """What ``unify_channels`` converts, said to the user; '' for nothing."""
  num_grey = int(grey.sum())
  num_colour = len(grey) - num_grey
  if channel_count(grey, channels) == 1:
    return (f'{num_colour} colour images converted to grey (config.channels=1)'
            if num_colour else '')
  if num_grey and num_colour:
    return (f'{num_grey} grey images converted to RGB, as {num_colour} are in '
            f'colour')
  return (f'{num_grey} grey images converted to RGB (config.channels=3)'
          if num_grey else '')


def unify_channels(images: np.ndarray, grey: np.ndarray, channels: int
                   ) -> np.ndarray:
  """RGB-replicated images [N, S, S, 3] with their grey flags [N] ->
  [N, S, S, C], C = ``channel_count(grey, channels)``."""
  if channel_count(grey, channels) == 3:
    return images
  return to_grey(images) if (~grey).any() else images[..., :1]


# ----------------------------------------------------------------------------
# A folder of class subfolders.


def _visible(entries: Iterable[os.DirEntry]) -> list[os.DirEntry]:
  return [e for e in entries if not e.name.startswith('.')]


def _subdirs(folder: Path) -> list[Path]:
  with os.scandir(folder) as entries:
    return sorted(Path(e.path) for e in _visible(entries) if e.is_dir())


def _top_files(folder: Path) -> list[Path]:
  with os.scandir(folder) as entries:
    return sorted(Path(e.path) for e in _visible(entries) if e.is_file())


def is_image_file(path: PathLike) -> bool:
  return Path(path).suffix.lower() in IMAGE_EXTENSIONS


def files_under(folder: Path) -> list[Path]:
  """Every visible file under ``folder`` (subfolders too), sorted."""
  found = []
  for root, dirs, files in os.walk(folder, followlinks=True):
    dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
    found += [Path(root) / f for f in sorted(files) if not f.startswith('.')]
  return found


class FolderSplit(NamedTuple):
  """The image files of one split folder and their class indices."""

  files: list[Path]
  labels: np.ndarray  # int32 [N]
  ignored: list[Path]  # non-image files (and files outside class folders)


def split_folders(root: Path) -> dict[str, Path]:
  """{'train': folder[, 'validation': folder][, 'test': folder]}: ``root``
  itself, or its ``train/`` (with ``test/`` and one of
  ``VALIDATION_FOLDERS`` beside it, when there) when ``train/`` holds class
  folders."""
  named = {p.name.lower(): p for p in _subdirs(root)}
  train = named.get('train')
  if train is None or not _subdirs(train):
    return {'train': root}
  folders = {'train': train}
  validation = [named[n] for n in VALIDATION_FOLDERS if n in named]
  if len(validation) > 1:
    raise DataError(
        f'{root}: {" and ".join(f"{v.name}/" for v in validation)} are both '
        f'validation folders; keep one (or merge them).')
  if validation:
    folders['validation'] = validation[0]
  if 'test' in named:
    folders['test'] = named['test']
  return folders


def _no_classes_error(folder: Path) -> DataError:
  images = [f for f in _top_files(folder) if is_image_file(f)]
  example = f'{folder}/cat/1.png, {folder}/dog/1.png'
  if images:
    return DataError(
        f'{folder}: {len(images)} images but no class subfolders; put each '
        f"class's images in a subfolder named after it ({example}).")
  return DataError(f'{folder}: no class subfolders (it is empty); a folder of '
                   f'your own images holds one subfolder per class '
                   f'({example}).')


def scan_split(folder: Path, class_names: Sequence[str] | None = None,
               split: str = 'test') -> tuple[tuple[str, ...], FolderSplit]:
  """The class folders of ``folder`` and their image files.

  ``class_names``: the training classes, for a test or validation folder
  (``split``; its classes must be among them; it may lack some).
  """
  classes = _subdirs(folder)
  if not classes:
    raise _no_classes_error(folder)
  names = tuple(c.name for c in classes)
  if class_names is None:
    if len(classes) < 2:
      raise DataError(
          f'{folder}: only one class folder ({names[0]}); a classifier needs '
          f'at least 2 (one subfolder per class).')
    class_names = names
  else:
    unknown = [c for c in classes if c.name not in class_names]
    if unknown:
      raise DataError(
          f'{unknown[0]}: a {split} class that is not among the training '
          f'classes ({", ".join(class_names)}); rename or remove it.')
  index = {name: i for i, name in enumerate(class_names)}
  files, labels = [], []
  ignored = list(_top_files(folder))
  for folder_of_class in classes:
    everything = files_under(folder_of_class)
    images = [f for f in everything if is_image_file(f)]
    others = [f for f in everything if not is_image_file(f)]
    if not images:
      note = (f' ({len(others)} other files, e.g. {others[0].name})'
              if others else '')
      raise DataError(
          f'{folder_of_class}: no images (PNG, JPEG, BMP, GIF, TIFF, WebP) in '
          f'this class folder{note}; add images or remove the folder.')
    files += images
    labels += [index[folder_of_class.name]] * len(images)
    ignored += others
  return tuple(class_names), FolderSplit(files, np.asarray(labels, np.int32),
                                         ignored)


def _decoded_split(scan: FolderSplit, options: ImageOptions, description: str
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
  images, grey, kept, counts = decode_files(scan.files, options,
                                            description=description)
  return images, grey, scan.labels[kept], counts


def _check_classes_left(labels: np.ndarray, class_names: Sequence[str],
                        folder: Path) -> None:
  """After skipping bad files, every training class keeps an image."""
  present = np.bincount(labels, minlength=len(class_names))
  if not present.all():
    empty = class_names[int(np.argmin(present))]
    raise DataError(f'{folder / empty}: none of its images could be decoded '
                    f'(all skipped as bad files); fix or remove them.')


def _layout(folders: dict[str, Path]) -> str:
  """The report's layout: 'class folders', or e.g. 'train/, val/ and
  test/'."""
  if len(folders) == 1:
    return 'class folders'
  names = [f'{folders[k].name}/' for k in ('train', 'validation', 'test')
           if k in folders]
  return ', '.join(names[:-1]) + f' and {names[-1]}'


def read_folder(root: PathLike, options: ImageOptions = DEFAULT_OPTIONS
                ) -> OwnImages:
  """A folder of class subfolders (optionally in ``train/``, ``test/`` and a
  validation folder)."""
  check_options(options)
  root = Path(root).expanduser()
  if not root.is_dir():
    raise DataError(f'{root}: no such folder.')
  folders = split_folders(root)
  class_names, train_scan = scan_split(folders['train'])
  scans = {'train': train_scan}
  for split in ('validation', 'test'):
    if split in folders:
      scans[split] = scan_split(folders[split], class_names, split)[1]
  decoded, counts = {}, {'bad_files': 0, 'bad_messages': [], 'alpha_files': 0,
                         'alpha_examples': []}
  start = time.perf_counter()
  for split, scan in scans.items():
    images, grey, labels, split_counts = _decoded_split(
        scan, options, f'decoding {split}')
    decoded[split] = (images, grey, labels)
    for key in ('bad_files', 'bad_messages', 'alpha_files', 'alpha_examples'):
      counts[key] += split_counts[key]
    counts.setdefault('median_size', split_counts.get('median_size'))
  seconds = time.perf_counter() - start
  # Every split decoded first: one run names all the bad files.
  check_bad_files(counts['bad_messages'], options)
  counts['alpha_examples'] = counts['alpha_examples'][:_NAMED_FILES]
  _check_classes_left(decoded['train'][2], class_names, folders['train'])
  all_grey = np.concatenate([d[1] for d in decoded.values()])
  channels = channel_count(all_grey, options.channels)
  splits = {k: Split(unify_channels(images, grey, channels), labels)
            for k, (images, grey, labels) in decoded.items()}
  ignored = [f for s in scans.values() for f in s.ignored]
  report = {
      'source': os.fspath(root), 'kind': 'folder', 'layout': _layout(folders),
      'split_sources': {k: f'the folder {folders[k].name}/' for k in folders
                        if k != 'train'},
      'num_files': sum(len(s.files) for s in scans.values()),
      'num_decoded': sum(len(d[2]) for d in decoded.values()),
      'ignored_files': len(ignored),
      'ignored_examples': [os.fspath(f) for f in ignored[:_NAMED_FILES]],
      'channels_note': channels_note(all_grey, options.channels),
      'decode_seconds': seconds, **counts}
  return OwnImages(splits['train'], splits.get('test'), class_names, report,
                   splits.get('validation'))


# ----------------------------------------------------------------------------
# Arrays in a .npz file.


def _npz_images(array: np.ndarray, key: str, path: Path) -> np.ndarray:
  """Images of a .npz as uint8 [N, H, W, C] (C = 1 or 3), or DataError."""
  if array.ndim == 3:
    array = array[..., None]
  if array.ndim != 4 or array.shape[-1] not in (1, 3, 4):
    raise DataError(f'{path}: {key} must be [N, H, W] or [N, H, W, C] with C '
                    f'1, 3 or 4, got shape {array.shape}.')
  if array.shape[-1] == 4:
    array = array[..., :3]  # RGBA: the alpha channel is dropped
  if array.dtype == np.uint8:
    return array
  if array.dtype == bool or not np.issubdtype(array.dtype, np.number):
    raise DataError(f'{path}: {key} must hold numbers, got {array.dtype}.')
  if array.size and not np.isfinite(array).all():
    raise DataError(f'{path}: {key} holds NaN or infinite values.')
  low, high = (float(array.min()), float(array.max())) if array.size else (0, 0)
  if np.issubdtype(array.dtype, np.floating) and high <= 1.0 and low >= 0:
    return np.rint(array * 255.0).astype(np.uint8)  # floats in [0, 1]
  if low < 0 or high > 255:
    raise DataError(f'{path}: {key} values run from {low:g} to {high:g}; '
                    f'images must be uint8 0-255 or floats in [0, 1].')
  return np.rint(array).astype(np.uint8)


def _npz_labels(array: np.ndarray, key: str, path: Path, num_images: int,
                num_classes: int | None) -> np.ndarray:
  if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or (
      np.issubdtype(array.dtype, np.floating) and
      np.array_equal(array, np.round(array)))):
    raise DataError(f'{path}: {key} must be integer class indices [N], got '
                    f'{array.dtype} {array.shape} (one-hot labels: use '
                    f'argmax).')
  if len(array) != num_images:
    x_key = key.replace('y_', 'x_')
    raise DataError(f'{path}: {key} has {len(array)} labels for the '
                    f'{num_images} images of {x_key}; they must match.')
  labels = array.astype(np.int64)
  if labels.size and labels.min() < 0:
    raise DataError(f'{path}: {key} holds the negative label '
                    f'{labels.min()}; labels are 0 .. K-1.')
  if num_classes is not None and labels.size and labels.max() >= num_classes:
    raise DataError(f'{path}: {key} holds label {labels.max()}, out of range '
                    f'for the {num_classes} class_names (0 .. '
                    f'{num_classes - 1}).')
  return labels.astype(np.int32)


def resize_arrays(images: np.ndarray, options: ImageOptions) -> np.ndarray:
  """uint8 [N, H, W, C] -> [N, S, S, C] through Pillow (a copy when H = W =
  S)."""
  size = options.image_size
  if images.shape[1:3] == (size, size):
    return images
  Image = _pil()
  out = np.empty((len(images), size, size, images.shape[-1]), np.uint8)
  for i, image in enumerate(images):
    pil = Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)
    fitted = np.asarray(fit_image(pil, size, options.resize_mode))
    out[i] = fitted.reshape(size, size, -1)
  return out


def _arrays_to_splits(splits: dict[str, tuple[np.ndarray, np.ndarray]],
                      options: ImageOptions) -> tuple[dict[str, Split], str]:
  """uint8 images of any size and 1 or 3 channels -> Splits at the options'
  size and channels; and the channel conversion note."""
  colour = {k: x.shape[-1] == 3 for k, (x, _) in splits.items()}
  grey = np.concatenate([np.full(len(x), not colour[k])
                         for k, (x, _) in splits.items()])
  channels = channel_count(grey, options.channels)
  out = {}
  for k, (images, labels) in splits.items():
    images = resize_arrays(images, options)
    images = to_grey(images) if channels == 1 else to_rgb(images)
    out[k] = Split(np.ascontiguousarray(images), labels)
  return out, channels_note(grey, options.channels)


def read_npz(path: PathLike, options: ImageOptions = DEFAULT_OPTIONS
             ) -> OwnImages:
  """A ``.npz`` with ``x_train``, ``y_train`` [, ``x_test``, ``y_test``,
  ``class_names``]; images uint8 0-255 or floats in [0, 1]."""
  check_options(options)
  path = Path(path).expanduser()
  start = time.perf_counter()
  try:
    with np.load(path, allow_pickle=False) as npz:
      arrays = {k: npz[k] for k in npz.files}
  except FileNotFoundError as e:
    raise DataError(f'{path}: no such file.') from e
  except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
    raise DataError(f'{path}: not a readable .npz file ({type(e).__name__}: '
                    f'{e}); write it with numpy.savez (no pickled objects).'
                    ) from e
  missing = [k for k in ('x_train', 'y_train') if k not in arrays]
  if missing:
    raise DataError(f'{path}: no {" or ".join(missing)} (it holds '
                    f'{", ".join(sorted(arrays)) or "nothing"}); the arrays '
                    f'are x_train, y_train, optionally x_test, y_test and '
                    f'class_names.')
  if ('x_test' in arrays) != ('y_test' in arrays):
    raise DataError(f'{path}: x_test and y_test come together; it holds only '
                    f'{"x_test" if "x_test" in arrays else "y_test"}.')
  names = None
  if 'class_names' in arrays:
    names = arrays['class_names']
    if names.ndim != 1 or names.dtype.kind not in 'US' or len(names) < 2:
      raise DataError(f'{path}: class_names must be a 1-D array of at least '
                      f'2 strings, got {names.dtype} {names.shape}.')
    names = tuple(str(n) for n in names)
  splits = {}
  for split in ('train', 'test'):
    if f'x_{split}' not in arrays:
      continue
    images = _npz_images(arrays[f'x_{split}'], f'x_{split}', path)
    labels = _npz_labels(arrays[f'y_{split}'], f'y_{split}', path,
                         len(images), None if names is None else len(names))
    splits[split] = (images, labels)
  if not len(splits['train'][1]):
    raise DataError(f'{path}: x_train holds no images.')
  if names is None:
    top = max(int(labels.max()) for _, labels in splits.values()
              if labels.size)
    if top < 1:
      raise DataError(f'{path}: y_train holds one class only (label 0); a '
                      f'classifier needs at least 2.')
    names = tuple(str(k) for k in range(top + 1))
  out, note = _arrays_to_splits(splits, options)
  report = {'source': os.fspath(path), 'kind': 'npz',
            'split_sources': {'test': 'x_test'} if 'test' in splits else {},
            'num_files': 1, 'ignored_files': 0, 'bad_files': 0,
            'channels_note': note,
            'median_size': list(splits['train'][0].shape[2:0:-1]),
            'decode_seconds': time.perf_counter() - start}
  return OwnImages(out['train'], out.get('test'), names, report)


# ----------------------------------------------------------------------------
# TensorFlow Datasets.


def _import_tfds(name: str):
  """tensorflow_datasets, or DataError (a user's fix, one line) without it."""
  try:
    import tensorflow_datasets as tfds
  except ImportError as e:
    raise DataError(f'{TFDS_PREFIX}{name} needs tensorflow-datasets, which is '
                    f'not installed: {TFDS_INSTALL}.') from e
  return tfds


def _first_line(error: BaseException) -> str:
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  return lines[0] if lines else type(error).__name__


def tfds_features(tfds, builder, name: str) -> tuple[str, str]:
  """The (image, label) feature keys of a TFDS builder, or DataError."""
  features = builder.info.features
  items = dict(features.items())
  supervised = builder.info.supervised_keys
  if (isinstance(supervised, tuple) and len(supervised) == 2 and
      all(isinstance(k, str) for k in supervised) and
      isinstance(items.get(supervised[0]), tfds.features.Image) and
      isinstance(items.get(supervised[1]), tfds.features.ClassLabel)):
    return supervised
  image = next((k for k, f in items.items()
                if isinstance(f, tfds.features.Image)), None)
  label = next((k for k, f in items.items()
                if isinstance(f, tfds.features.ClassLabel)), None)
  described = ', '.join(f'{k} ({type(f).__name__})' for k, f in items.items())
  if image is None:
    raise DataError(f'{TFDS_PREFIX}{name}: no image feature (its features: '
                    f'{described}); training on your own images needs an '
                    f'image-classification dataset.')
  if label is None:
    raise DataError(f'{TFDS_PREFIX}{name}: no class-label feature (its '
                    f'features: {described}); training on your own images '
                    f'needs an image-classification dataset.')
  return image, label


def _tfds_split(tfds, builder, split: str, keys: tuple[str, str],
                options: ImageOptions, name: str
                ) -> tuple[np.ndarray, np.ndarray]:
  image_key, label_key = keys
  total = builder.info.splits[split].num_examples
  images, labels = [], []
  with _progress(total, f'reading {split}') as bar:
    for example in tfds.as_numpy(builder.as_dataset(split=split,
                                                    shuffle_files=False)):
      image = np.asarray(example[image_key])
      image = image[..., None] if image.ndim == 2 else image
      images.append(resize_arrays(_npz_images(
          image[None], image_key, Path(f'{TFDS_PREFIX}{name}')), options)[0])
      labels.append(int(example[label_key]))
      bar.update()
  if not images:
    raise DataError(f'{TFDS_PREFIX}{name}: its {split} split is empty.')
  return np.stack(images), np.asarray(labels, np.int32)


def read_tfds(name: str, options: ImageOptions = DEFAULT_OPTIONS, *,
              data_dir: PathLike | None = None) -> OwnImages:
  """An image-classification dataset of TFDS, read from ``data_dir`` (TFDS's
  default ~/tensorflow_datasets when None); decoded by TFDS, resized by
  Pillow. Its 'train' split is the training data; its 'test' split, when
  it has one, the test data."""
  check_options(options)
  tfds = _import_tfds(name)
  start = time.perf_counter()
  data_dir = os.fspath(Path(data_dir).expanduser()) if data_dir else None
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # noqa: BLE001  (tfds raises many kinds)
    raise DataError(
        f'{TFDS_PREFIX}{name}: no such TensorFlow Datasets dataset '
        f'({_first_line(e)}); see tfds.list_builders() or '
        f'https://www.tensorflow.org/datasets/catalog.') from e
  keys = tfds_features(tfds, builder, name)
  splits = dict(builder.info.splits)
  where = data_dir or '~/tensorflow_datasets'
  local = os.fspath(getattr(builder, 'data_dir', '') or '')
  # Its metadata may come with the code: the files decide.
  prepared = '://' in local or not local or os.path.isdir(local)
  if not prepared or 'train' not in splits:
    problem = (f'not prepared in {where}' if not prepared or not splits else
               f'has no train split (splits: {", ".join(splits)})')
    raise DataError(
        f'{TFDS_PREFIX}{name}: {problem}; prepare it first: python -c "import '
        f"tensorflow_datasets as tfds; tfds.builder('{name}', data_dir="
        f"'{where}').download_and_prepare()\"")
  arrays = {split: _tfds_split(tfds, builder, split, keys, options, name)
            for split in ('train', 'test') if split in splits}
  class_names = tuple(builder.info.features[keys[1]].names)
  out, note = _arrays_to_splits(arrays, options)
  report = {'source': f'{TFDS_PREFIX}{name}', 'kind': 'tfds',
            'split_sources': ({'test': 'its test split'} if 'test' in out
                              else {}),
            'num_files': sum(len(y) for _, y in arrays.values()),
            'ignored_files': 0, 'bad_files': 0, 'channels_note': note,
            'decode_seconds': time.perf_counter() - start}
  return OwnImages(out['train'], out.get('test'), class_names, report)


# ----------------------------------------------------------------------------
# Any source, and the cache.


def source_kind(source: str) -> str:
  """'tfds', 'npz' or 'folder', or DataError for a path that is none."""
  if not source:
    raise DataError('no images given: set --config.images to a folder of '
                    'class subfolders, a .npz file or tfds:NAME.')
  if source.startswith(TFDS_PREFIX):
    return 'tfds'
  path = Path(source).expanduser()
  if path.is_dir():
    return 'folder'
  if path.is_file():
    if path.suffix.lower() == '.npz':
      return 'npz'
    raise DataError(f'{path}: a file, not a folder or a .npz; --config.images '
                    f'takes a folder of class subfolders, a .npz file or '
                    f'tfds:NAME.')
  raise DataError(f'{path}: no such folder or file.')


def absolute_source(source: str) -> str:
  """A folder or file source as an absolute path (tfds:NAME as it is), so
  that a run's config finds it from any working directory."""
  if source.startswith(TFDS_PREFIX) or not source:
    return source
  return os.path.abspath(os.path.expanduser(source))


def read_images(source: str, options: ImageOptions = DEFAULT_OPTIONS, *,
                data_dir: PathLike | None = None) -> OwnImages:
  """A folder, a ``.npz`` file or ``tfds:NAME`` (see the module)."""
  kind = source_kind(source)
  if kind == 'tfds':
    return read_tfds(source[len(TFDS_PREFIX):], options, data_dir=data_dir)
  if kind == 'npz':
    return read_npz(source, options)
  return read_folder(source, options)


def _file_entries(paths: Iterable[Path], root: Path) -> list[list[Any]]:
  entries = []
  for path in paths:
    stat = path.stat()
    entries.append([os.path.relpath(path, root), stat.st_size,
                    stat.st_mtime_ns])
  return entries


def cache_key(source: str, options: ImageOptions,
              data_dir: PathLike | None = None) -> str:
  """SHA-256 of the source's files (relative paths, sizes, modification
  times) and the decoding options: any change of either is a new key."""
  kind = source_kind(source)
  if kind == 'tfds':
    content: Any = [source, os.fspath(data_dir or '')]
  else:
    path = Path(source).expanduser().resolve()
    files = files_under(path) if kind == 'folder' else [path]
    content = [os.fspath(path), _file_entries(files, path.parent)]
  record = {'version': CACHE_VERSION, 'options': list(options),
            'content': content}
  return hashlib.sha256(json.dumps(record).encode()).hexdigest()


def _cache_name(source: str, key: str) -> str:
  stem = Path(source.rstrip('/')).name or 'images'
  stem = ''.join(c if c.isalnum() or c in '-_.' else '_' for c in stem)
  return f'{stem[:40]}-{key[:16]}'


def _save_entry(directory: Path, own: OwnImages, key: str) -> None:
  """Writes ``own`` into ``directory`` through a temporary sibling and one
  rename, so that a killed write leaves no half entry behind."""
  temp = directory.with_name(f'.{directory.name}.tmp-{os.getpid()}')
  shutil.rmtree(temp, ignore_errors=True)
  temp.mkdir(parents=True)
  splits = {k: v for k, v in (('train', own.train), ('test', own.test),
                               ('validation', own.validation)) if v}
  for split, data in splits.items():
    np.save(temp / f'{split}_images.npy', data.images)
    np.save(temp / f'{split}_labels.npy', data.labels)
  meta = {'key': key, 'class_names': list(own.class_names),
          'splits': sorted(splits), 'report': own.report}
  (temp / 'meta.json').write_text(json.dumps(meta, indent=1))
  try:
    os.replace(temp, directory)
  except OSError:  # another process published the same entry first
    shutil.rmtree(temp, ignore_errors=True)
    if not (directory / 'meta.json').exists():
      raise


def _load_entry(directory: Path, key: str) -> OwnImages | None:
  """The cached entry, or None when absent or unreadable."""
  try:
    meta = json.loads((directory / 'meta.json').read_text())
    if meta.get('key') != key:
      return None
    splits = {s: Split(np.load(directory / f'{s}_images.npy'),
                       np.load(directory / f'{s}_labels.npy'))
              for s in meta['splits']}
  except (OSError, ValueError, KeyError):
    return None
  return OwnImages(splits['train'], splits.get('test'),
                   tuple(meta['class_names']), meta['report'],
                   splits.get('validation'))


def read_cached(source: str, options: ImageOptions, cache_dir: PathLike, *,
                data_dir: PathLike | None = None,
                say: Callable[[str], None] = print) -> OwnImages:
  """``read_images`` through the cache in ``cache_dir``: decoded on the
  first call, read back as arrays after (``report['cached']`` True)."""
  key = cache_key(source, options, data_dir)
  if source_kind(source) == 'folder':
    root = Path(source).expanduser().resolve()
    inside = Path(cache_dir).expanduser().resolve()
    if inside == root or root in inside.parents:
      raise DataError(
          f'{inside}: inside the images folder {root}, where it would be read '
          f'as a class; choose a --workdir (or --config.cache_dir) outside '
          f'it.')
  directory = Path(cache_dir).expanduser() / _cache_name(source, key)
  cached = _load_entry(directory, key)
  if cached is not None:
    return cached._replace(report=cached.report | {'cached': True,
                                                    'cache': str(directory)})
  say(f'Decoding {source} at {options.image_size}x{options.image_size} into '
      f'{directory} (once; later runs read the cache).')
  own = read_images(source, options, data_dir=data_dir)
  own = own._replace(report=own.report | {'cached': False,
                                          'cache': str(directory)})
  directory.parent.mkdir(parents=True, exist_ok=True)
  _save_entry(directory, own, key)
  return own


# ----------------------------------------------------------------------------
# Splits, reports, files to predict.


def stratified_split(labels: np.ndarray, fraction: float, seed: int
                     ) -> tuple[np.ndarray, np.ndarray]:
  """Indices (kept, held out) of ``labels`` [N], ``fraction`` of each class
  held out (rounded, one image of a class always kept), chosen by ``seed``.

  Returns two sorted int64 arrays partitioning ``range(N)``.
  """
  if not 0 <= fraction < 1:
    raise ValueError(f'fraction must be in [0, 1), got {fraction!r}.')
  rng = np.random.default_rng(seed)
  held = []
  for k in np.unique(labels):
    members = np.flatnonzero(labels == k)
    count = min(int(round(fraction * len(members))), len(members) - 1)
    held.append(rng.permutation(members)[:count])
  held = np.sort(np.concatenate(held)) if held else np.zeros(0, np.int64)
  kept = np.setdiff1d(np.arange(len(labels)), held)
  return kept, held


def _take(split: Split, indices: np.ndarray) -> Split:
  return Split(split.images[indices], split.labels[indices])


def to_dataset(own: OwnImages, *, test_fraction: float,
               validation_fraction: float, seed: int, name: str) -> Dataset:
  """Validation carved from the training images by ``seed`` (stratified)
  when the source has none, and a test split held out the same way when
  the source has none."""
  for key, value in (('test_fraction', test_fraction),
                     ('validation_fraction', validation_fraction)):
    if isinstance(value, bool) or not (isinstance(value, int | float) and
                                       0 <= value < 1):
      raise ValueError(f'config.{key} must be in [0, 1), got {value!r}.')
  train, test = own.train, own.test
  if test is None:
    kept, held = stratified_split(train.labels, test_fraction, seed)
    train, test = _take(train, kept), _take(train, held)
  if own.validation is not None:
    return Dataset(train, own.validation, test, len(own.class_names), name)
  # Another stream of the same seed: the validation images do not depend on
  # whether the test split was held out.
  kept, held = stratified_split(train.labels, validation_fraction, seed + 1)
  return Dataset(_take(train, kept), _take(train, held), test,
                 len(own.class_names), name)


def report_lines(report: dict[str, Any]) -> list[str]:
  """What the user is told about a source, beyond the split sizes."""
  lines = []
  if report.get('cached'):
    lines.append(f'Read the decoded images from the cache {report["cache"]}.')
  elif report.get('decode_seconds') is not None and report.get('num_files'):
    seconds = report['decode_seconds']
    # A folder's skipped files are not among the images decoded.
    count = report.get('num_decoded', report['num_files'])
    lines.append(f'Decoded {count} images in {seconds:.1f} s '
                 f'({count / max(seconds, 1e-9):.0f} img/s).')
  if report.get('ignored_files'):
    lines.append(f'Ignored {report["ignored_files"]} files that are not '
                 f'images or lie outside the class folders (e.g. '
                 f'{report["ignored_examples"][0]}).')
  if report.get('bad_files'):
    lines.append(f'Skipped {report["bad_files"]} files that could not be '
                 f'decoded:')
    lines += [f'  {message}' for message in report['bad_messages']]
  if report.get('alpha_files'):
    lines.append(
        f'Warning: {report["alpha_files"]} images hold their shape in the '
        f'alpha channel alone (one colour wherever they are visible, e.g. '
        f'{report["alpha_examples"][0]}); they are composited onto white, '
        f'as every transparent image is. Check that this is what the model '
        f'should see.')
  if report.get('channels_note'):
    lines.append(f'Channels: {report["channels_note"]}.')
  return lines


def size_advice(report: dict[str, Any], image_size: int) -> str:
  """A line when the source's images are much larger than ``image_size``
  (a folder of photos): what is done to them and why."""
  width, height = report.get('median_size') or (0, 0)
  if min(width, height) < max(3 * image_size, 96):
    return ''
  return (f'The images are about {width}x{height}; they are resized to '
          f'{image_size}x{image_size}: the votes of capsule layers (and the '
          f'weights of CapsNet\'s class capsules) grow with the square of the '
          f'side, and 224x224 would need tens of GB. Raise '
          f'--config.image_size step by step (48, 64) if the classes need '
          f'more detail; the memory line below says what a run takes.')


class FoundFiles(NamedTuple):
  """What ``find_image_files`` found."""

  files: list[Path]  # the image files, in order
  ignored: int  # other files in the folders searched
  missing: list[Path]  # paths that are neither a file nor a folder


def find_image_files(paths: Sequence[PathLike]) -> FoundFiles:
  """The image files among ``paths`` (files, or folders searched
  recursively), in order; a file named outright is taken whatever its
  name."""
  files, ignored, missing = [], 0, []
  for path in map(lambda p: Path(p).expanduser(), paths):
    if path.is_dir():
      found = files_under(path)
      files += [f for f in found if is_image_file(f)]
      ignored += sum(not is_image_file(f) for f in found)
    elif path.is_file():
      files.append(path)
    else:
      missing.append(path)
  return FoundFiles(files, ignored, missing)


def no_images_error(paths: Sequence[PathLike]) -> DataError:
  """The error for ``paths`` that hold no image files."""
  return DataError(f'{", ".join(map(os.fspath, paths))}: no images (PNG, '
                   f'JPEG, BMP, GIF, TIFF, WebP) found.')


def read_image_files(files: Sequence[Path], options: ImageOptions
                     ) -> tuple[np.ndarray, list[Path], dict[str, Any]]:
  """Image files decoded as a model trained on ``options`` reads them.

  ``options.channels`` must be 1 or 3 (the model's). Returns uint8
  ``[M, S, S, C]``, the M files decoded and the counts (``decode_files``:
  the files that could not be decoded are passed over, and named there).
  """
  if options.channels not in (1, 3):
    raise ValueError(f'channels must be 1 or 3 here, got {options.channels}.')
  images, grey, kept, counts = decode_files(list(files), options,
                                            description='reading')
  images = unify_channels(images, grey, options.channels)
  return images, [files[i] for i in kept], counts
