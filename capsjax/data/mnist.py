"""MNIST and Fashion-MNIST from the original IDX files; ``load_dataset``.

Each dataset is the four files ``train-images-idx3-ubyte``,
``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte`` (optionally ``.gz``; the dotted names
``train-images.idx3-ubyte`` are accepted too). Validation is the LAST
``validation_size`` images of the training file; test is the t10k file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from capsjax.data import cifar10
from capsjax.data import smallnorb
from capsjax.data import svhn
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
DATASETS = ('mnist', 'fashion_mnist', 'smallnorb', 'cifar10', 'svhn')
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


# Names (and the TFDS names) of the colour datasets -> their loaders.
_COLOUR_LOADERS = {'cifar10': cifar10.load_cifar10,
                   'cifar_10': cifar10.load_cifar10,
                   'svhn': svhn.load_svhn, 'svhn_cropped': svhn.load_svhn}


def load_dataset(name: str, *, data_dir: PathLike | None = None,
                 validation_size: int = 5000, source: str = 'auto',
                 **options) -> Dataset:
  """Loads a dataset by name into host memory.

  Files are looked for in: ``data_dir`` if given (only there: the directory or
  its ``mnist/``, ``fashion-mnist/``, ``smallnorb/``, ``cifar10/`` (or
  ``cifar-10-batches-bin/``), ``svhn/`` subdirectory); else
  ``$CAPSJAX_DATA_DIR`` (same layout); else ``../shared/data/<name>``
  relative to the working directory and to the repository root. When none
  holds the files and ``source='auto'``, TensorFlow Datasets is used if
  installed (``pip install capsjax[tfds]``); otherwise FileNotFoundError
  lists every place looked at.

  Args:
    name: 'mnist', 'fashion_mnist', 'smallnorb', 'cifar10' (the binary or
      python release; ``cifar10.load_cifar10``) or 'svhn' (the cropped
      digits' .mat files; ``svhn.load_svhn``).
    data_dir: directory with the files (``--config.data_dir``).
    validation_size: the last ``validation_size`` training examples become
      the validation split (0: empty validation split).
    source: 'auto' (files, then TFDS), 'local' (files only) or 'tfds'.
    **options: smallnorb only: ``stereo=True``, ``viewpoint_split=None``,
      ``downsample='mean'`` (see ``smallnorb.load_smallnorb``).

  Returns:
    ``Dataset``: uint8 ``[N, H, W, C]`` images (28x28x1; smallnorb 48x48x2;
    cifar10 and svhn 32x32x3), int32 labels.
  """
  key = name.lower().replace('-', '_')
  if key == 'smallnorb':
    return smallnorb.load_smallnorb(data_dir=data_dir,
                                    validation_size=validation_size,
                                    source=source, **options)
  if key not in SUBDIRS and key not in _COLOUR_LOADERS:
    raise ValueError(f'unknown dataset {name!r}; one of {DATASETS}')
  if options:
    raise TypeError(f'{name!r} takes no options, got {sorted(options)}')
  if key in _COLOUR_LOADERS:
    return _COLOUR_LOADERS[key](data_dir=data_dir,
                                validation_size=validation_size, source=source)
  return load_mnist(key, data_dir=data_dir, validation_size=validation_size,
                    source=source)
