"""Datasets -> host arrays -> batches: MNIST, Fashion-MNIST, smallNORB, affNIST,
CIFAR-10, SVHN and your own images (a folder of class subfolders, a .npz, a
TFDS dataset).

Loaders return uint8 ``[N, H, W, C]`` images and int32 labels in host memory
(``Dataset`` of ``Split``); augmentation and preprocessing are pure jit-able
JAX functions of a PRNG key and a batch.

``load_dataset`` (here, the one table of the datasets by name) loads any of
the named ones.
"""

import functools
from collections.abc import Callable

from capsjax.data import cifar10
from capsjax.data import mnist
from capsjax.data import smallnorb
from capsjax.data import svhn
from capsjax.data.affnist import affine_mnist
from capsjax.data.affnist import affnist_files
from capsjax.data.affnist import load_affnist
from capsjax.data.augment import center_crop
from capsjax.data.augment import dataset_on_canvas
from capsjax.data.augment import efficient_capsnet_augment
from capsjax.data.augment import on_canvas
from capsjax.data.augment import place_on_canvas
from capsjax.data.augment import random_shift
from capsjax.data.augment import shift
from capsjax.data.augment import to_float
from capsjax.data.cifar10 import cifar10_eval_preprocess
from capsjax.data.cifar10 import cifar10_train_preprocess
from capsjax.data.cifar10 import read_cifar_binary
from capsjax.data.cifar10 import read_cifar_pickle
from capsjax.data.cifar10 import write_cifar_binary
from capsjax.data.cifar10 import write_cifar_pickle
from capsjax.data.idx import DataError
from capsjax.data.idx import Dataset
from capsjax.data.idx import PathLike
from capsjax.data.idx import Split
from capsjax.data.idx import read_idx
from capsjax.data.images import ImageOptions
from capsjax.data.images import OwnImages
from capsjax.data.images import read_cached
from capsjax.data.images import read_images
from capsjax.data.images import stratified_split
from capsjax.data.multimnist import load_multimnist
from capsjax.data.multimnist import multimnist_batch
from capsjax.data.multimnist import multimnist_pairs
from capsjax.data.multimnist import multimnist_test_set
from capsjax.data.multimnist import pack_pairs
from capsjax.data.multimnist import unpack_pairs
from capsjax.data.smallnorb import combine_crop_activations
from capsjax.data.smallnorb import read_norb_matrix
from capsjax.data.smallnorb import smallnorb_distort
from capsjax.data.smallnorb import smallnorb_eval_preprocess
from capsjax.data.smallnorb import smallnorb_multicrop
from capsjax.data.smallnorb import smallnorb_train_draws
from capsjax.data.smallnorb import smallnorb_train_preprocess
from capsjax.data.smallnorb import write_norb_matrix
from capsjax.data.svhn import read_svhn_mat
from capsjax.data.svhn import write_svhn_mat
from capsjax.data.two_digit_transfer import PAIR_LAYOUTS
from capsjax.data.two_digit_transfer import blank_fields
from capsjax.data.two_digit_transfer import digit_pairs

# ----------------------------------------------------------------------------
# The datasets by name (``config.dataset``) -> their loaders. MultiMNIST and
# your own images have loaders of their own (``load_multimnist``,
# ``capsjax.data.images``): built from these or from a folder.

# The names an unknown name's error lists (LOADERS also takes the TFDS names
# cifar_10 and svhn_cropped).
DATASETS = ('mnist', 'fashion_mnist', 'smallnorb', 'cifar10', 'svhn')
# Name -> loader of (data_dir=, validation_size=, source=, **options).
LOADERS: dict[str, Callable[..., Dataset]] = {
    'mnist': functools.partial(mnist.load_mnist, 'mnist'),
    'fashion_mnist': functools.partial(mnist.load_mnist, 'fashion_mnist'),
    'smallnorb': smallnorb.load_smallnorb,
    'cifar10': cifar10.load_cifar10,
    'cifar_10': cifar10.load_cifar10,
    'svhn': svhn.load_svhn,
    'svhn_cropped': svhn.load_svhn,
}
# The only loader with options (stereo, viewpoint_split, downsample); the
# others reject any rather than ignore a misspelt one.
_TAKES_OPTIONS = frozenset({'smallnorb'})


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
  if key not in LOADERS:
    raise ValueError(f'unknown dataset {name!r}; one of {DATASETS}')
  if options and key not in _TAKES_OPTIONS:
    raise TypeError(f'{name!r} takes no options, got {sorted(options)}')
  return LOADERS[key](data_dir=data_dir, validation_size=validation_size,
                      source=source, **options)

__all__ = (
    'PAIR_LAYOUTS',
    'DataError',
    'Dataset',
    'ImageOptions',
    'OwnImages',
    'Split',
    'affine_mnist',
    'affnist_files',
    'blank_fields',
    'center_crop',
    'cifar10_eval_preprocess',
    'cifar10_train_preprocess',
    'combine_crop_activations',
    'dataset_on_canvas',
    'efficient_capsnet_augment',
    'digit_pairs',
    'load_affnist',
    'load_dataset',
    'load_multimnist',
    'multimnist_batch',
    'multimnist_pairs',
    'multimnist_test_set',
    'on_canvas',
    'pack_pairs',
    'place_on_canvas',
    'random_shift',
    'read_cifar_binary',
    'read_cifar_pickle',
    'read_cached',
    'read_idx',
    'read_images',
    'read_norb_matrix',
    'read_svhn_mat',
    'shift',
    'smallnorb_distort',
    'smallnorb_eval_preprocess',
    'smallnorb_multicrop',
    'smallnorb_train_draws',
    'smallnorb_train_preprocess',
    'stratified_split',
    'to_float',
    'unpack_pairs',
    'write_cifar_binary',
    'write_cifar_pickle',
    'write_norb_matrix',
    'write_svhn_mat',
)
