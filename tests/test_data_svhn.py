"""SVHN: the cropped digits' .mat files, fake releases, load_dataset."""

import sys

import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from scipy import io as scipy_io

from capsjax.data import DataError
from capsjax.data import load_dataset
from capsjax.data import read_svhn_mat
from capsjax.data import write_svhn_mat
from tests.helpers import make_svhn_release


def test_reads_the_release_layout(tmp_path):
  """A file written with scipy directly, as the release lays it out: X
  [32, 32, 3, N] (row, column, colour, image), y [N, 1] with 10 for 0."""
  x = np.zeros((32, 32, 3, 3), np.uint8)
  x[1, 2, :, 0] = (10, 20, 30)  # image 0, row 1, column 2
  x[31, 0, 2, 2] = 255
  y = np.array([[10], [1], [9]], np.uint8)
  path = tmp_path / 'train_32x32.mat'
  scipy_io.savemat(path, {'X': x, 'y': y})
  split = read_svhn_mat(path)
  assert split.images.shape == (3, 32, 32, 3) and split.images.dtype == np.uint8
  np.testing.assert_array_equal(split.images[0, 1, 2], [10, 20, 30])
  assert split.images[2, 31, 0, 2] == 255 and split.images.sum() == 315
  np.testing.assert_array_equal(split.labels, [0, 1, 9])
  assert split.labels.dtype == np.int32
  # MATLAB's own double labels are read too.
  scipy_io.savemat(path, {'X': x, 'y': y.astype(np.float64)})
  np.testing.assert_array_equal(read_svhn_mat(path).labels, [0, 1, 9])


def test_writer_round_trip_and_layout(tmp_path):
  rng = np.random.default_rng(1)
  images = rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
  labels = np.array([0, 3, 9, 0])
  path = tmp_path / 'test_32x32.mat'
  write_svhn_mat(path, images, labels)
  mat = scipy_io.loadmat(path)
  assert mat['X'].shape == (32, 32, 3, 4) and mat['X'].dtype == np.uint8
  np.testing.assert_array_equal(mat['y'], [[10], [3], [9], [10]])
  assert path.read_bytes()[:10] == b'MATLAB 5.0'
  split = read_svhn_mat(path)
  np.testing.assert_array_equal(split.images, images)
  np.testing.assert_array_equal(split.labels, labels)


_X = np.zeros((32, 32, 3, 2), np.uint8)


@pytest.mark.parametrize('contents,problem', [
    ({'X': _X}, 'no variable y'),
    ({'images': _X, 'labels': [[1], [2]]}, 'no variable X or y'),
    ({'X': _X.astype(np.float32), 'y': [[1], [2]]}, 'expected X uint8'),
    ({'X': _X[:, :28], 'y': [[1], [2]]}, r'\[32, 32, 3, N\]'),
    ({'X': _X[..., :0], 'y': np.zeros((0, 1))}, 'N > 0'),
    ({'X': _X, 'y': [[1, 2]]}, r'expected y \[N, 1\]'),
    ({'X': _X, 'y': [[1], [2], [3]]}, '3 labels in y for 2 images'),
    ({'X': _X, 'y': [[1], [0]]}, 'label 0 of image 1 is not one of 1-10'),
    ({'X': _X, 'y': [[11], [1]]}, 'label 11 of image 0'),
    ({'X': _X, 'y': [[1.5], [1]]}, 'label 1.5'),
    ({'X': _X, 'y': [[np.nan], [1]]}, 'label nan'),
    ({'X': _X, 'y': [['a'], ['b']]}, 'of numbers'),
], ids=['no y', 'other names', 'float X', 'X 28 wide', 'no images', 'y row',
        'count', 'label 0', 'label 11', 'label 1.5', 'NaN', 'text y'])
def test_wrong_contents(tmp_path, contents, problem):
  path = tmp_path / 'train_32x32.mat'
  scipy_io.savemat(path, contents)
  with pytest.raises(DataError, match=problem) as info:
    read_svhn_mat(path)
  message = str(info.value)
  assert str(path) in message and 'ufldl.stanford.edu/housenumbers' in message
  assert '\n' not in message


def test_matlab_v73_and_non_mat_files(tmp_path):
  # A v7.3 file is HDF5 behind a 128-byte MATLAB header with version 0x0200.
  header = b'MATLAB 7.3 MAT-file, Platform: GLNXA64, HDF5 schema 1.00 .'
  path = tmp_path / 'train_32x32.mat'
  path.write_bytes(header.ljust(116) + bytes(8) + b'\x00\x02IM' +
                   b'\x89HDF\r\n\x1a\n' + bytes(64))
  with pytest.raises(DataError, match='v7.3'):
    read_svhn_mat(path)
  path.write_bytes(b'<html>404 Not Found</html>')
  with pytest.raises(DataError, match='not a readable MATLAB'):
    read_svhn_mat(path)


def _valid_file(directory):
  path = directory / 'valid.mat'
  write_svhn_mat(path, np.full((2, 32, 32, 3), 7, np.uint8), [1, 0])
  return path.read_bytes()


@pytest.fixture(scope='module')
def valid_bytes(tmp_path_factory):
  return _valid_file(tmp_path_factory.mktemp('svhn_valid'))


def _read_or_data_error(tmp_path, data):
  path = tmp_path / 'fuzz.mat'
  path.write_bytes(data)
  try:
    split = read_svhn_mat(path)
  except DataError as e:
    assert str(path) in str(e)
    return None
  assert split.images.shape[1:] == (32, 32, 3)
  assert split.labels.min() >= 0 and split.labels.max() <= 9
  return split


_FIXTURES = [HealthCheck.function_scoped_fixture]


@settings(max_examples=60, deadline=None, suppress_health_check=_FIXTURES)
@given(st.binary(max_size=400))
def test_fuzz_random_bytes(tmp_path, data):
  _read_or_data_error(tmp_path, data)


@settings(max_examples=60, deadline=None, suppress_health_check=_FIXTURES)
@given(st.data())
def test_fuzz_truncations(tmp_path, valid_bytes, data):
  cut = data.draw(st.integers(0, len(valid_bytes) - 1))
  assert _read_or_data_error(tmp_path, valid_bytes[:cut]) is None


@settings(max_examples=60, deadline=None, suppress_health_check=_FIXTURES)
@given(st.data())
def test_fuzz_bit_flips(tmp_path, valid_bytes, data):
  position = data.draw(st.integers(0, len(valid_bytes) - 1))
  flipped = bytearray(valid_bytes)
  flipped[position] ^= 1 << data.draw(st.integers(0, 7))
  _read_or_data_error(tmp_path, bytes(flipped))


def test_load_fake_release(tmp_path):
  train, test = make_svhn_release(tmp_path / 'svhn')
  data = load_dataset('svhn', data_dir=tmp_path, validation_size=4)
  assert data.name == 'svhn' and data.num_classes == 10
  assert data.train.images.shape == (8, 32, 32, 3)
  assert data.validation.images.shape == (4, 32, 32, 3)
  assert data.test.images.shape == (6, 32, 32, 3)
  # Validation is the end of train_32x32.mat.
  np.testing.assert_array_equal(data.train.images[:, 0, 0, 0], np.arange(8))
  np.testing.assert_array_equal(data.validation.images, train[0][8:])
  np.testing.assert_array_equal(data.validation.labels, train[1][8:])
  np.testing.assert_array_equal(data.test.labels, test[1])
  assert load_dataset('svhn_cropped', data_dir=tmp_path / 'svhn',
                      validation_size=0).train.images.shape[0] == 12


def test_missing_and_corrupt_files(tmp_path, monkeypatch):
  make_svhn_release(tmp_path)
  (tmp_path / 'test_32x32.mat').unlink()
  with pytest.raises(FileNotFoundError) as info:
    load_dataset('svhn', data_dir=tmp_path)
  message = str(info.value)
  for text in (str(tmp_path / 'svhn'), 'train_32x32.mat, test_32x32.mat',
               '--config.data_dir', 'capsjax[tfds]',
               'http://ufldl.stanford.edu/housenumbers/'):
    assert text in message
  make_svhn_release(tmp_path)
  bad = tmp_path / 'test_32x32.mat'
  bad.write_bytes(bad.read_bytes()[:-50])
  with pytest.raises(DataError) as info:
    load_dataset('svhn', data_dir=tmp_path)
  assert str(bad) in str(info.value)
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)
  with pytest.raises(ImportError, match=r'capsjax\[tfds\]'):
    load_dataset('svhn', source='tfds')
