"""Shared pytest configuration for the capsjax tests."""

import os
import tempfile

# Unit tests spend most of their time in XLA compilation. The backend's
# lowest optimisation level roughly halves it; XLA:CPU's LLVM IR fusion
# emitters (rather than its MLIR ones) compile in about half the time again,
# and their cost per program grows less over the thousands of programs a
# worker compiles (a cold unit tier: 326 -> 224 s; results/ci). Set before
# JAX starts its backend (the emitters' flag below, where this jaxlib has
# it). Training subprocesses keep these flags too, unless a run long enough
# for execution to outweigh compilation asks for the caller's own flags back
# (``training_env(full_speed=True)``).
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
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from capsjax.kernels.conv import dispatch  # noqa: E402

# The LLVM IR emitters (above), only where this jaxlib's XLA has their flag
# (it aborts on an unknown one).
if dispatch.jaxlib_knows_flag('xla_cpu_use_fusion_emitters'):
  os.environ['XLA_FLAGS'] += ' --xla_cpu_use_fusion_emitters=false'

# XLA:CPU's Eigen convolutions, as the experiments run them (before JAX
# starts its backend).
dispatch.prefer_eigen_convolutions()

# As equinox does: implicit rank promotion ([B, O] + [O]) is how a batch axis
# silently lines up with the wrong one, so every test runs with it raising.
jax.config.update('jax_numpy_rank_promotion', 'raise')


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.join(REPO, '..', 'shared', 'data')
# The MNIST IDX files beside the repository (../shared/data/mnist).
MNIST = os.path.join(SHARED_DATA, 'mnist')
FASHION_MNIST = os.path.join(SHARED_DATA, 'fashion-mnist')
_IDX_FILES = tuple(f'{split}-{kind}-ubyte.gz' for split in ('train', 't10k')
                   for kind in ('images-idx3', 'labels-idx1'))


def unit_tier_keeps(values, *kept):
  """The ``values`` of a long parametrisation, each but ``kept`` marked
  slow: the unit tier runs the representatives, the slow tier all of them
  (the suite's time budget: tools/run_tests.py)."""
  missing = set(kept) - set(values)
  assert not missing, f'{missing} are not among the values'
  return [value if value in kept else pytest.param(value, marks=pytest.mark.slow)
          for value in values]


def missing_files(directory: str) -> list[str]:
  """The IDX files of a dataset directory that are not there."""
  return [name for name in _IDX_FILES
          if not os.path.isfile(os.path.join(directory, name))]


# The one gate of the tests that read a shared dataset. Without the files a
# test is skipped on a developer's machine, and fails under CI (CI=true), so
# that a missing dataset cannot turn the accuracy tests into silent skips.
needs_mnist = pytest.mark.needs_data(MNIST)
needs_fashion_mnist = pytest.mark.needs_data(FASHION_MNIST)


def pytest_configure(config):
  config.addinivalue_line(
      'markers', 'needs_data(directory): the test reads that dataset '
      'directory (skipped without it; a failure under CI=true)')


def pytest_collection_modifyitems(items):
  # The long tests first: on two workers a long test that starts last keeps
  # one worker busy while the other has nothing left to run.
  items.sort(key=lambda item: item.get_closest_marker('slow') is None)


def pytest_runtest_setup(item):
  for mark in item.iter_markers('needs_data'):
    directory = os.path.normpath(mark.args[0])
    missing = missing_files(directory)
    if missing:
      message = f'{directory} lacks {", ".join(missing)}'
      if os.environ.get('CI') == 'true':
        pytest.fail(f'{message}: CI must have the shared datasets.',
                    pytrace=False)
      pytest.skip(message)


def training_env(full_speed: bool = False) -> dict[str, str]:
  """Environment for a training subprocess, without a progress bar.

  full_speed: XLA's own flags, for runs long enough that execution
    outweighs compilation (accuracy claims). Runs of a few steps keep the
    suite's flags (above), which compile them faster.
  """
  flags = _CALLER_XLA_FLAGS if full_speed else os.environ['XLA_FLAGS']
  # Every compilation cached, not only those over a second: tests start the
  # same training again (killed, resumed, a second process), and the rerun
  # then compiles nothing (a SIGKILL-resume test: 78 -> 62 CPU s).
  return dict(os.environ, CAPSJAX_NO_PROGRESS='1', XLA_FLAGS=flags,
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')


def write_mnist_dir(directory, train, test) -> str:
  """The four MNIST IDX files of (images, labels) pairs, uncompressed."""
  from tests.helpers import idx_bytes
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


# ----------------------------------------------------------------------------
# NumPy references the tests of several files count with.


def np_margin_loss(lengths, labels):
  """Sabour et al. eq. 4 in float64, summed over the classes: [B, K]
  lengths, int [B] labels -> [B]."""
  one_hot = np.eye(lengths.shape[-1])[labels]
  lengths = np.asarray(lengths, np.float64)
  return np.sum(one_hot * np.maximum(0, 0.9 - lengths) ** 2 + 0.5 * (
      1 - one_hot) * np.maximum(0, lengths - 0.1) ** 2, axis=-1)


def np_both_in_top2(scores, labels):
  """bool [M]: the two highest of the scores [M, K] are the two classes of
  labels int [M, 2], in either order."""
  top2 = np.sort(np.argsort(-np.asarray(scores), axis=-1)[:, :2], axis=-1)
  return np.all(top2 == np.sort(labels, axis=-1), axis=-1)
