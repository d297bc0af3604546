"""IDX reader: the shared MNIST files, corrupt files, fuzzing."""

import gzip

import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from capsjax.data import DataError
from capsjax.data import read_idx
from capsjax.data.idx import REPO_ROOT
from capsjax.data.idx import parse_idx
from capsjax.data.mnist import read_idx_split
from tests.conftest import needs_mnist
from tests.helpers import idx_bytes

MNIST_DIR = REPO_ROOT.parent / 'shared' / 'data' / 'mnist'

# From shared/data/mnist/PROVENANCE.md.
TRAIN_HISTOGRAM = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_HISTOGRAM = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
TRAIN_PIXEL_SUM = 1_567_298_545


@pytest.fixture(scope='module')
def mnist_train():
  return (read_idx(MNIST_DIR / 'train-images-idx3-ubyte.gz'),
          read_idx(MNIST_DIR / 'train-labels-idx1-ubyte.gz'))


@needs_mnist
def test_mnist_train_file_values(mnist_train):
  images, labels = mnist_train
  assert images.shape == (60000, 28, 28) and images.dtype == np.uint8
  assert labels.shape == (60000,) and labels.dtype == np.uint8
  np.testing.assert_array_equal(labels[:10], [5, 0, 4, 1, 9, 2, 1, 3, 1, 4])
  np.testing.assert_array_equal(np.bincount(labels), TRAIN_HISTOGRAM)
  assert int(images.sum(dtype=np.int64)) == TRAIN_PIXEL_SUM


@needs_mnist
def test_mnist_test_file_values():
  images = read_idx(MNIST_DIR / 't10k-images-idx3-ubyte.gz')
  labels = read_idx(MNIST_DIR / 't10k-labels-idx1-ubyte.gz')
  assert images.shape == (10000, 28, 28)
  np.testing.assert_array_equal(labels[:10], [7, 2, 1, 0, 4, 1, 4, 9, 5, 9])
  np.testing.assert_array_equal(np.bincount(labels), TEST_HISTOGRAM)
  assert abs(images.mean() - 33.791) < 1e-3


@needs_mnist
def test_uncompressed_file_reads_the_same(tmp_path):
  raw = gzip.decompress((MNIST_DIR / 't10k-labels-idx1-ubyte.gz').read_bytes())
  (tmp_path / 't10k-labels-idx1-ubyte').write_bytes(raw)
  np.testing.assert_array_equal(
      read_idx(tmp_path / 't10k-labels-idx1-ubyte'),
      read_idx(MNIST_DIR / 't10k-labels-idx1-ubyte.gz'))


def test_hand_written_file_with_every_dtype(tmp_path):
  rng = np.random.default_rng(0)
  cases = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.int16, 0x0C: np.int32,
           0x0D: np.float32, 0x0E: np.float64}
  for code, dtype in cases.items():
    array = (rng.normal(size=(3, 4, 5)) * 100).astype(dtype)
    path = tmp_path / f'x{code}.gz'
    path.write_bytes(gzip.compress(idx_bytes(array, code)))
    out = read_idx(path)
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative
    np.testing.assert_array_equal(out, array)


@pytest.mark.parametrize('name,data,problem', [
    ('truncated', idx_bytes(np.zeros((4, 28, 28), np.uint8))[:-5],
     'truncated'),
    ('trailing', idx_bytes(np.zeros((4,), np.uint8)) + b'\0', 'trailing'),
    ('magic', b'\x00\x00\x07\x03' + bytes(12), 'bad IDX magic'),
    ('nonzero', b'\x01\x00\x08\x01' + bytes(8), 'bad IDX magic'),
    ('header', b'\x00\x00\x08\x03\x00\x00', 'truncated IDX header'),
    ('short', b'\x00\x00', 'shorter than an IDX header'),
])
def test_corrupt_files_raise_data_error_naming_file(tmp_path, name, data,
                                                    problem):
  path = tmp_path / f'{name}-idx3-ubyte'
  path.write_bytes(data)
  with pytest.raises(DataError, match=problem) as info:
    read_idx(path)
  assert str(path) in str(info.value)
  assert 'Re-download' in str(info.value)
  assert isinstance(info.value, ValueError)


def test_gz_name_without_gzip_content(tmp_path):
  path = tmp_path / 'train-labels-idx1-ubyte.gz'
  path.write_bytes(idx_bytes(np.zeros(3, np.uint8)))
  with pytest.raises(DataError, match='not gzip') as info:
    read_idx(path)
  assert str(path) in str(info.value)


def test_truncated_gzip_stream(tmp_path):
  path = tmp_path / 'train-labels-idx1-ubyte.gz'
  data = gzip.compress(idx_bytes(np.arange(200, dtype=np.uint8)))
  path.write_bytes(data[:len(data) // 2])
  with pytest.raises(DataError, match='gzip') as info:
    read_idx(path)
  assert str(path) in str(info.value)


def test_label_count_mismatch_names_label_file(tmp_path):
  images, labels = tmp_path / 'images', tmp_path / 'labels'
  images.write_bytes(idx_bytes(np.zeros((5, 28, 28), np.uint8)))
  labels.write_bytes(idx_bytes(np.zeros(4, np.uint8)))
  with pytest.raises(DataError, match='4 labels for 5 images') as info:
    read_idx_split(images, labels)
  assert str(labels) in str(info.value)


def test_wrong_image_size_and_label_range(tmp_path):
  images, labels = tmp_path / 'images', tmp_path / 'labels'
  images.write_bytes(idx_bytes(np.zeros((2, 20, 20), np.uint8)))
  labels.write_bytes(idx_bytes(np.zeros(2, np.uint8)))
  with pytest.raises(DataError, match='28, 28'):
    read_idx_split(images, labels)
  images.write_bytes(idx_bytes(np.zeros((2, 28, 28), np.uint8)))
  labels.write_bytes(idx_bytes(np.array([1, 10], np.uint8)))
  with pytest.raises(DataError, match='outside 0-9'):
    read_idx_split(images, labels)
  labels.write_bytes(idx_bytes(np.zeros((2, 1), np.uint8)))
  with pytest.raises(DataError, match='0x00000801'):
    read_idx_split(images, labels)


_VALID = idx_bytes(np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4))
_FUZZ = settings(max_examples=80, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


@_FUZZ
@given(st.binary(max_size=64))
def test_fuzz_random_bytes_parse_or_raise_data_error(data):
  try:
    out = parse_idx(data)
  except DataError:
    return
  assert isinstance(out, np.ndarray)


@_FUZZ
@given(st.binary(min_size=4, max_size=4), st.binary(max_size=40))
def test_fuzz_random_headers_never_crash(magic, rest):
  # A valid-looking magic with random dims and payload: huge dims must not
  # allocate or hang.
  data = b'\x00\x00\x08' + magic[3:] + rest
  try:
    out = parse_idx(data)
  except DataError:
    return
  assert out.size * out.itemsize == len(data) - 4 - 4 * out.ndim


@_FUZZ
@given(st.integers(0, len(_VALID) - 1))
def test_fuzz_every_truncation_raises(cut):
  with pytest.raises(DataError):
    parse_idx(_VALID[:cut])


@_FUZZ
@given(st.binary(max_size=64), st.booleans())
def test_fuzz_files_gz_or_not(tmp_path, data, gz):
  path = tmp_path / ('f.gz' if gz else 'f')
  path.write_bytes(data)
  try:
    read_idx(path)
  except DataError:
    pass


@_FUZZ
@given(st.integers(1, 60))
def test_fuzz_truncated_gz_raises(tmp_path, cut):
  compressed = gzip.compress(_VALID)
  path = tmp_path / 'g.gz'
  path.write_bytes(compressed[:min(cut, len(compressed) - 1)])
  with pytest.raises(DataError):
    read_idx(path)
