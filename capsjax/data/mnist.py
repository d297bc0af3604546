"""MNIST and Fashion-MNIST from the original IDX files.

Each dataset is the four files ``train-images-idx3-ubyte``,
``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte`` (optionally ``.gz``; the dotted names
``train-images.idx3-ubyte`` are accepted too). Validation is the LAST
``validation_size`` images of the training file; test is the t10k file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from capsjax.data.idx import Dataset
from capsjax.data.idx import PathLike
from capsjax.data.idx import Split
from capsjax.data.idx import candidate_dirs
from capsjax.data.idx import carve_validation
from capsjax.data.idx import data_error
from capsjax.data.idx import import_tfds
from capsjax.data.idx import load_tfds_supervised
from capsjax.data.idx import not_found_message
from capsjax.data.idx import read_idx
from capsjax.data.idx import search_dirs

IMAGE_SIZE = 28
NUM_CLASSES = 10
# Dataset name -> names of its directory (the first is the canonical one).
SUBDIRS = {'mnist': ('mnist',),
           'fashion_mnist': ('fashion-mnist', 'fashion_mnist')}
FILES = {'train_images': 'train-images-idx3-ubyte',
         'train_labels': 'train-labels-idx1-ubyte',
         'test_images': 't10k-images-idx3-ubyte',
         'test_labels': 't10k-labels-idx1-ubyte'}
SOURCES = ('auto', 'local', 'tfds')


def _find_file(directory: Path, stem: str) -> Path | None:
  dotted = stem.replace('-idx', '.idx')
  for name in (stem, f'{stem}.gz', dotted, f'{dotted}.gz'):
    if (directory / name).is_file():
      return directory / name
  return None


def find_idx_files(directory: Path) -> dict[str, Path] | None:
  """``{'train_images': path, ...}`` when all four files are in ``directory``."""
  found = {k: _find_file(directory, stem) for k, stem in FILES.items()}
  return None if None in found.values() else found


def _read_images(path: PathLike) -> np.ndarray:
  images = read_idx(path)
  if images.dtype != np.uint8 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
    raise data_error(path, f'expected uint8 [N, 28, 28] images (IDX magic '
                     f'0x00000803), got {images.dtype} {images.shape}')
  return images[..., None]


def _read_labels(path: PathLike, num_images: int, images_path: PathLike
                 ) -> np.ndarray:
  labels = read_idx(path)
  if labels.dtype != np.uint8 or labels.ndim != 1:
    raise data_error(path, f'expected uint8 [N] labels (IDX magic '
                     f'0x00000801), got {labels.dtype} {labels.shape}')
  if len(labels) != num_images:
    raise data_error(path, f'{len(labels)} labels for {num_images} images in '
                     f'{images_path}', 'Use the label file that belongs to '
                     'these images (re-download both).')
  if len(labels) and labels.max() >= NUM_CLASSES:
    raise data_error(path, f'label {labels.max()} outside 0-9')
  return labels.astype(np.int32)


def read_idx_split(images_path: PathLike, labels_path: PathLike) -> Split:
  """Reads and checks an images/labels pair of IDX files.

  Returns:
    ``Split`` with uint8 ``[N, 28, 28, 1]`` images and int32 ``[N]`` labels.
  """
  images = _read_images(images_path)
  return Split(images, _read_labels(labels_path, len(images), images_path))


def load_mnist(name: str = 'mnist', *, data_dir: PathLike | None = None,
               validation_size: int = 5000, source: str = 'auto') -> Dataset:
  """MNIST or Fashion-MNIST; see ``load_dataset``."""
  if name not in SUBDIRS:
    raise ValueError(f'name must be one of {tuple(SUBDIRS)}, got {name!r}')
  if source not in SOURCES:
    raise ValueError(f'source must be one of {SOURCES}, got {source!r}')
  if source == 'tfds':
    train, test = load_tfds_supervised(name)
  else:
    places = candidate_dirs(SUBDIRS[name], data_dir)
    found = search_dirs(places, find_idx_files)
    if found is not None:
      files = found[1]
      train = read_idx_split(files['train_images'], files['train_labels'])
      test = read_idx_split(files['test_images'], files['test_labels'])
    else:
      what = {'mnist': 'MNIST', 'fashion_mnist': 'Fashion-MNIST'}[name]
      names = ', '.join(f'{s}[.gz]' for s in FILES.values())
      explicit = source == 'local' or data_dir is not None
      message = lambda tried: not_found_message(
          what, places, names, SUBDIRS[name][0], tfds_tried=tried)
      if explicit:
        raise FileNotFoundError(message(False))
      try:
        import_tfds(name)
      except ImportError as e:
        raise FileNotFoundError(message(True)) from e
      train, test = load_tfds_supervised(name)
  train, validation = carve_validation(*train, validation_size)
  return Dataset(train, validation, test, NUM_CLASSES, name)
