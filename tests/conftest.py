"""Shared pytest configuration for the capsjax tests."""

import os
import tempfile

# Unit tests spend most of their time in XLA compilation; the backend's
# lowest optimisation level roughly halves it. Set before jax is imported.
# Training subprocesses started by the tests get the caller's flags removed
# (see ``training_env``) so that they run at full speed.
_CALLER_XLA_FLAGS = os.environ.get('XLA_FLAGS', '')
os.environ['XLA_FLAGS'] = (_CALLER_XLA_FLAGS +
                           ' --xla_backend_optimization_level=0').strip()

# One persistent XLA compilation cache for the whole session, shared with the
# training subprocesses: runs that resume or repeat a computation reuse it.
os.environ.setdefault(
    'JAX_COMPILATION_CACHE_DIR',
    os.path.join(tempfile.gettempdir(), f'capsjax-test-xla-cache-{os.getuid()}'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '1')

import jax  # noqa: E402
import pytest  # noqa: E402

# As equinox does: implicit rank promotion ([B, O] + [O]) is how a batch axis
# silently lines up with the wrong one, so every test runs with it raising.
jax.config.update('jax_numpy_rank_promotion', 'raise')


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The MNIST IDX files beside the repository (../shared/data/mnist).
MNIST = os.path.join(REPO, '..', 'shared', 'data', 'mnist')
needs_mnist = pytest.mark.skipif(
    not all(os.path.exists(os.path.join(MNIST, f'{split}-images-idx3-ubyte.gz'))
            for split in ('train', 't10k')),
    reason='../shared/data/mnist not present')


def training_env() -> dict[str, str]:
  """Environment for a training subprocess: full XLA optimisation, no bar."""
  env = dict(os.environ, CAPSJAX_NO_PROGRESS='1', XLA_FLAGS=_CALLER_XLA_FLAGS)
  return env


def write_mnist_dir(directory, train, test) -> str:
  """The four MNIST IDX files of (images, labels) pairs, uncompressed."""
  from tests.test_data_idx import idx_bytes
  os.makedirs(directory, exist_ok=True)
  for split, arrays in (('train', train), ('t10k', test)):
    for kind, array in zip(('images-idx3', 'labels-idx1'), arrays,
                           strict=True):
      with open(os.path.join(directory, f'{split}-{kind}-ubyte'), 'wb') as f:
        f.write(idx_bytes(array))
  return str(directory)


def write_mnist_subset(directory, num_train: int, num_test: int) -> str:
  """The first images of the shared MNIST as an IDX directory of its own.

  Integration tests that check an experiment's plumbing, not its accuracy,
  train and evaluate on it: the full 10,000-image test set is most of their
  time on a slow CI machine.
  """
  from capsjax.data import read_idx

  def first(split, num):
    return tuple(read_idx(os.path.join(MNIST, f'{split}-{kind}-ubyte.gz'))[:num]
                 for kind in ('images-idx3', 'labels-idx1'))

  return write_mnist_dir(directory, first('train', num_train),
                         first('t10k', num_test))
