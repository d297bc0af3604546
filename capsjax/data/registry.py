"""``load_dataset``: the datasets by name (``config.dataset``) -> their
loaders, the one table of them.

MultiMNIST and your own images have loaders of their own
(``load_multimnist``, ``capsjax.data.images``): they are built from these or
from a folder, not looked up by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from capsjax.data import cifar10
from capsjax.data import mnist
from capsjax.data import smallnorb
from capsjax.data import svhn
from capsjax.data.idx import Dataset
from capsjax.data.idx import PathLike

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
