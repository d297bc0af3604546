"""load_dataset for MNIST and Fashion-MNIST: splits, directory resolution."""

import gzip
import shutil
import sys

import numpy as np
import pytest

import capsjax.data
from capsjax.data import DataError
from capsjax.data import Dataset
from capsjax.data import Split
from capsjax.data import idx as idx_lib
from capsjax.data import load_dataset
from capsjax.data import read_idx
from tests.conftest import needs_fashion_mnist
from tests.conftest import needs_mnist

SHARED = idx_lib.REPO_ROOT.parent / 'shared' / 'data'
MNIST_DIR = SHARED / 'mnist'
FASHION_DIR = SHARED / 'fashion-mnist'
pytestmark = [needs_mnist, needs_fashion_mnist]
FILES = ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte',
         't10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte')


@pytest.fixture(scope='module')
def mnist():
  return load_dataset('mnist', data_dir=MNIST_DIR)


@pytest.fixture
def no_tfds(monkeypatch):
  # A None entry in sys.modules makes `import tensorflow_datasets` fail.
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)


def test_public_api_imports():
  for name in capsjax.data.__all__:
    assert getattr(capsjax.data, name) is not None


def test_mnist_splits(mnist):
  assert isinstance(mnist, Dataset) and mnist.name == 'mnist'
  assert mnist.num_classes == 10
  for split, n in zip(mnist[:3], (55000, 5000, 10000), strict=True):
    assert isinstance(split, Split)
    assert split.images.shape == (n, 28, 28, 1)
    assert split.images.dtype == np.uint8
    assert split.labels.shape == (n,) and split.labels.dtype == np.int32
  np.testing.assert_array_equal(mnist.train.labels[:10],
                                [5, 0, 4, 1, 9, 2, 1, 3, 1, 4])
  np.testing.assert_array_equal(mnist.test.labels[:10],
                                [7, 2, 1, 0, 4, 1, 4, 9, 5, 9])


def test_validation_is_the_last_5000_of_the_training_file(mnist):
  labels = read_idx(MNIST_DIR / 'train-labels-idx1-ubyte.gz')
  images = read_idx(MNIST_DIR / 'train-images-idx3-ubyte.gz')
  np.testing.assert_array_equal(mnist.validation.labels, labels[55000:])
  np.testing.assert_array_equal(mnist.validation.images[..., 0],
                                images[55000:])
  np.testing.assert_array_equal(mnist.train.images[..., 0], images[:55000])
  histogram = (np.bincount(mnist.train.labels, minlength=10)
               + np.bincount(mnist.validation.labels, minlength=10))
  np.testing.assert_array_equal(
      histogram, [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949])


def test_validation_size_options():
  empty = load_dataset('mnist', data_dir=MNIST_DIR, validation_size=0)
  assert empty.train.images.shape == (60000, 28, 28, 1)
  assert empty.validation.images.shape == (0, 28, 28, 1)
  assert empty.validation.labels.shape == (0,)
  big = load_dataset('mnist', data_dir=MNIST_DIR, validation_size=10000)
  assert len(big.train.labels) == 50000 and len(big.validation.labels) == 10000
  for bad in (-1, 60000):
    with pytest.raises(ValueError, match='validation_size'):
      load_dataset('mnist', data_dir=MNIST_DIR, validation_size=bad)


def test_fashion_mnist():
  fashion = load_dataset('fashion_mnist', data_dir=FASHION_DIR)
  assert fashion.name == 'fashion_mnist'
  assert fashion.train.images.shape == (55000, 28, 28, 1)
  assert fashion.validation.images.shape == (5000, 28, 28, 1)
  assert fashion.test.images.shape == (10000, 28, 28, 1)
  np.testing.assert_array_equal(fashion.train.labels[:10],
                                [9, 0, 0, 3, 0, 2, 7, 2, 5, 5])
  np.testing.assert_array_equal(np.bincount(fashion.test.labels), [1000] * 10)
  assert abs(fashion.test.images.mean() - 73.15) < 0.01


def test_default_resolution_finds_shared_dir_from_anywhere(tmp_path,
                                                           monkeypatch):
  # Not from the working directory (tmp_path has no ../shared): from the
  # repository root.
  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv(idx_lib.DATA_DIR_ENV, raising=False)
  data = load_dataset('fashion-mnist', validation_size=0)
  assert data.train.labels[0] == 9


def test_env_var_with_subdirectory(tmp_path, monkeypatch):
  (tmp_path / 'mnist').mkdir()
  for name in FILES:
    # Uncompressed, with the dotted names of some copies.
    (tmp_path / 'mnist' / name.replace('-idx', '.idx')).write_bytes(
        gzip.decompress((MNIST_DIR / f'{name}.gz').read_bytes()))
  monkeypatch.setenv(idx_lib.DATA_DIR_ENV, str(tmp_path))
  monkeypatch.setattr(idx_lib, 'REPO_ROOT', tmp_path / 'nowhere')
  data = load_dataset('mnist', validation_size=0, source='local')
  assert data.train.images.shape == (60000, 28, 28, 1)
  np.testing.assert_array_equal(data.test.labels[:3], [7, 2, 1])


def test_corrupt_file_in_data_dir_names_it(tmp_path):
  for name in FILES:
    shutil.copy(MNIST_DIR / f'{name}.gz', tmp_path)
  bad = tmp_path / 't10k-labels-idx1-ubyte.gz'
  bad.write_bytes(gzip.compress(
      gzip.decompress(bad.read_bytes())[:-10]))
  with pytest.raises(DataError, match='truncated') as info:
    load_dataset('mnist', data_dir=tmp_path)
  assert str(bad) in str(info.value)


def test_missing_explicit_dir_lists_places(tmp_path):
  missing = tmp_path / 'nothing'
  with pytest.raises(FileNotFoundError) as info:
    load_dataset('mnist', data_dir=missing)
  message = str(info.value)
  assert str(missing) in message and str(missing / 'mnist') in message
  assert 'train-images-idx3-ubyte[.gz]' in message
  for way in ('--config.data_dir', idx_lib.DATA_DIR_ENV,
              "pip install 'capsjax[tfds]'", "pip install -e '.[tfds]'",
              'published at http://yann.lecun.com/exdb/mnist/'):
    assert way in message


def test_nothing_found_and_no_tfds(tmp_path, monkeypatch, no_tfds):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv(idx_lib.DATA_DIR_ENV, str(tmp_path / 'env'))
  monkeypatch.setattr(idx_lib, 'REPO_ROOT', tmp_path / 'repo')
  with pytest.raises(FileNotFoundError) as info:
    load_dataset('fashion_mnist')
  message = str(info.value)
  for place in (tmp_path / 'env', tmp_path / 'env' / 'fashion-mnist',
                tmp_path.parent / 'shared' / 'data' / 'fashion-mnist',
                tmp_path / 'shared' / 'data' / 'fashion-mnist'):
    assert str(place) in message, place
  assert 'tensorflow-datasets is not installed' in message
  assert "pip install -e '.[tfds]'" in message
  assert 'https://github.com/zalandoresearch/fashion-mnist' in message


def test_tfds_source_without_tfds(no_tfds):
  with pytest.raises(ImportError, match=r"pip install -e '\.\[tfds\]'"):
    load_dataset('mnist', source='tfds')


def test_bad_arguments():
  with pytest.raises(ValueError, match='unknown dataset'):
    load_dataset('imagenet')
  with pytest.raises(TypeError, match='no options'):
    load_dataset('mnist', data_dir=MNIST_DIR, stereo=True)
  with pytest.raises(ValueError, match='source'):
    load_dataset('mnist', source='web')
