"""affNIST: .mat release reader and the affine recipe on MNIST digits."""

import math
import sys
import zipfile

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from scipy import io as scipy_io

from capsjax.data import DataError
from capsjax.data import affine_mnist
from capsjax.data import affnist as aff
from capsjax.data import load_affnist
from capsjax.data import read_idx
from capsjax.data.idx import REPO_ROOT
from tests.conftest import needs_mnist
from tests.helpers import write_release_mat

MNIST_DIR = REPO_ROOT.parent / 'shared' / 'data' / 'mnist'


def letter_images(n, start=0):
  """Asymmetric 40x40 images: an 'L' whose size and place depend on i, so a
  transposed or flipped read cannot pass."""
  images = np.zeros((n, 40, 40), np.uint8)
  for k in range(n):
    i = start + k
    top, left = 3 + i % 7, 5 + i % 5
    images[k, top:top + 20, left] = 200  # vertical stroke
    images[k, top + 19, left:left + 9] = 100 + i  # foot to the right
  return images


def test_round_trip_keeps_orientation(tmp_path):
  images, labels = letter_images(7), np.arange(7) % 10
  write_release_mat(tmp_path / 'test.mat', images, labels)
  raw = scipy_io.loadmat(tmp_path / 'test.mat')['affNISTdata'][0, 0]['image']
  assert raw.shape == (1600, 7)  # as in the release
  split = load_affnist(tmp_path / 'test.mat')
  assert split.images.shape == (7, 40, 40, 1)
  assert split.images.dtype == np.uint8 and split.labels.dtype == np.int32
  np.testing.assert_array_equal(split.images[..., 0], images)
  np.testing.assert_array_equal(split.labels, labels)
  # The vertical stroke of image 0 is column 5, rows 3..22.
  assert np.all(split.images[0, 3:23, 5, 0] > 0)
  assert split.images[0, 22, 13, 0] == 100 and split.images[0, 2, 5, 0] == 0
  # A directory holding test.mat works too.
  np.testing.assert_array_equal(load_affnist(tmp_path).labels, labels)


def test_batches_are_concatenated_in_numeric_order(tmp_path):
  batches = tmp_path / 'test_batches'
  batches.mkdir()
  for number, start in ((1, 0), (2, 3), (10, 6)):
    write_release_mat(batches / f'{number}.mat', letter_images(3, start),
                      np.arange(start, start + 3) % 10)
  for where in (tmp_path, batches):
    split = load_affnist(where)
    np.testing.assert_array_equal(split.labels, np.arange(9) % 10)
    np.testing.assert_array_equal(split.images[..., 0], letter_images(9))


def test_zipped_file(tmp_path):
  write_release_mat(tmp_path / 'test.mat', letter_images(2), np.array([3, 4]))
  with zipfile.ZipFile(tmp_path / 'test.mat.zip', 'w') as archive:
    archive.write(tmp_path / 'test.mat', 'test.mat')
  (tmp_path / 'test.mat').unlink()
  np.testing.assert_array_equal(load_affnist(tmp_path).labels, [3, 4])


def test_bad_files(tmp_path):
  path = tmp_path / 'bad.mat'
  path.write_bytes(b'this is not a mat file' * 10)
  with pytest.raises(DataError, match='MATLAB') as info:
    load_affnist(path)
  assert str(path) in str(info.value)
  scipy_io.savemat(path, {'mnist': np.zeros((3, 3))})
  with pytest.raises(DataError, match="no 'affNISTdata'"):
    load_affnist(path)
  scipy_io.savemat(path, {'affNISTdata': {'image': np.zeros((784, 2)),
                                          'label_int': np.zeros((1, 2))}})
  with pytest.raises(DataError, match=r'\[1600, N\]'):
    load_affnist(path)
  scipy_io.savemat(path, {'affNISTdata': {'image': np.zeros((1600, 2)),
                                          'label_int': np.zeros((1, 3))}})
  with pytest.raises(DataError, match='3 labels for 2 images'):
    load_affnist(path)
  (tmp_path / 'empty').mkdir()
  with pytest.raises(FileNotFoundError, match='test_batches'):
    load_affnist(tmp_path / 'empty')


def test_missing_scipy_message(tmp_path, monkeypatch):
  write_release_mat(tmp_path / 'test.mat', letter_images(1), np.array([1]))
  monkeypatch.setitem(sys.modules, 'scipy', None)
  with pytest.raises(ImportError, match='pip install scipy'):
    load_affnist(tmp_path / 'test.mat')


# ----------------------------------------------------------------------------
# The affine recipe.


def test_warp_geometry():
  image = np.zeros((40, 40), np.float32)
  image[10:20, 12] = 1.0
  image[19, 12:18] = 2.0
  identity = aff.affine_matrix(0.0, 0.0, np.ones(2))
  np.testing.assert_allclose(aff.warp(image, identity, np.zeros(2)), image,
                             atol=1e-6)
  # Integer translation t = (tx, ty) = (3, -2): 3 right, 2 up.
  moved = aff.warp(image, identity, np.array([3.0, -2.0]))
  np.testing.assert_allclose(moved, np.roll(image, (-2, 3), axis=(0, 1)),
                             atol=1e-6)
  # +90 degrees with y pointing down is a clockwise turn.
  quarter = aff.affine_matrix(math.pi / 2, 0.0, np.ones(2))
  np.testing.assert_allclose(aff.warp(image, quarter, np.zeros(2)),
                             np.rot90(image, -1), atol=1e-4)
  # Scale 2 in x about the centre doubles the horizontal extent.
  wide = aff.warp(image, aff.affine_matrix(0.0, 0.0, np.array([2.0, 1.0])),
                  np.zeros(2))
  cols = np.flatnonzero(np.asarray(wide).sum(0) > 0.5)
  assert cols[-1] - cols[0] + 1 == pytest.approx(2 * 6, abs=2)


def test_sampled_parameters_are_in_range():
  params = jax.device_get(aff.sample_affine(jax.random.key(0), 5000))
  assert np.abs(params['rotation']).max() <= math.radians(20)
  assert np.abs(params['rotation']).max() > math.radians(19.9)
  assert np.abs(params['shear']).max() <= 0.2
  assert params['scale'].min() >= 0.8 and params['scale'].max() <= 1.2
  assert params['position'].min() >= 0 and params['position'].max() < 1


@needs_mnist
def test_affine_mnist_on_test_digits():
  digits = read_idx(MNIST_DIR / 't10k-images-idx3-ubyte.gz')[:256, ..., None]
  out = affine_mnist(digits, 0)
  assert out.shape == (256, 40, 40, 1) and out.dtype == np.uint8
  np.testing.assert_array_equal(out, affine_mnist(digits, jax.random.key(0)))
  assert not np.array_equal(out, affine_mnist(digits, 1))
  # No ink is lost off the canvas: the mass scales with det(A).
  params = aff.sample_affine(jax.random.key(0), 256)
  det = np.linalg.det(np.asarray(aff.affine_matrix(
      params['rotation'], params['shear'], params['scale'])))
  ratio = out.reshape(256, -1).sum(1) / digits.reshape(256, -1).sum(1)
  np.testing.assert_allclose(ratio / det, 1, atol=0.06)
  # The digits land all over the canvas, not just in the centre.
  rows = np.any(out[..., 0] > 0, axis=2)
  tops = rows.argmax(1)
  assert tops.min() <= 2 and tops.max() >= 12


# ----------------------------------------------------------------------------
# Fuzzing: whatever the bytes, a Split of the file's own values or DataError.

_FUZZ = settings(max_examples=40, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


def _release_bytes(tmp_path, images, labels):
  write_release_mat(tmp_path / 'valid.mat', images, labels)
  return (tmp_path / 'valid.mat').read_bytes()


def _read_or_data_error(path):
  try:
    split = aff.read_affnist_mat(path)
  except DataError as e:
    assert str(path) in str(e)
    return None
  assert split.images.dtype == np.uint8 and split.labels.dtype == np.int32
  assert split.images.shape == (len(split.labels), 40, 40, 1)
  assert np.all((split.labels >= 0) & (split.labels <= 9))
  return split


@_FUZZ
@given(data=st.binary(max_size=400), suffix=st.sampled_from(['.mat', '.zip']))
def test_fuzz_random_bytes(tmp_path, data, suffix):
  path = tmp_path / f'random{suffix}'
  path.write_bytes(data)
  _read_or_data_error(path)


@_FUZZ
@given(fraction=st.floats(0.0, 1.0, exclude_max=True),
       zipped=st.booleans())
def test_fuzz_truncated_release_file(tmp_path, fraction, zipped):
  """A cut anywhere is a DataError, except in the final alignment padding
  (the last 2 bytes here), where every value is still read correctly."""
  images, labels = letter_images(3), np.array([1, 2, 3])
  data = _release_bytes(tmp_path, images, labels)
  cut = int(fraction * len(data))
  path = tmp_path / 'test.mat'
  path.write_bytes(data[:cut])
  if zipped:
    with zipfile.ZipFile(tmp_path / 'test.mat.zip', 'w') as archive:
      archive.write(path, 'test.mat')
    path = tmp_path / 'test.mat.zip'
  split = _read_or_data_error(path)
  if split is not None:
    assert cut >= len(data) - 7, cut  # MATLAB v5 pads to 8 bytes
    np.testing.assert_array_equal(split.images[..., 0], images)
    np.testing.assert_array_equal(split.labels, labels)


@_FUZZ
@given(data=st.data())
def test_fuzz_truncated_zip_archive(tmp_path, data):
  write_release_mat(tmp_path / 'test.mat', letter_images(2), np.array([3, 4]))
  with zipfile.ZipFile(tmp_path / 'test.mat.zip', 'w') as archive:
    archive.write(tmp_path / 'test.mat', 'test.mat')
  whole = (tmp_path / 'test.mat.zip').read_bytes()
  cut = data.draw(st.integers(0, len(whole) - 1))
  path = tmp_path / 'cut.mat.zip'
  path.write_bytes(whole[:cut])
  with pytest.raises(DataError):
    aff.read_affnist_mat(path)


_DTYPES = st.sampled_from([np.uint8, np.int16, np.int32, np.float64,
                           np.float32, np.bool_])


@_FUZZ
@given(rows=st.sampled_from([1600, 1599, 784, 0, 1]),
       count=st.integers(0, 3), extra_labels=st.integers(-1, 1),
       image_dtype=_DTYPES, label_dtype=_DTYPES,
       values=st.sampled_from(['pixels', 'negative', 'large', 'fractional',
                               'nan']),
       label_values=st.sampled_from(['digits', 'ten', 'negative',
                                     'fractional', 'nan']),
       seed=st.integers(0, 2**16))
def test_fuzz_struct_contents(tmp_path, rows, count, extra_labels,
                              image_dtype, label_dtype, values, label_values,
                              seed):
  """Images of any shape, dtype and values; labels of any count and values:
  either exactly the file's values or a DataError naming the file."""
  rng = np.random.default_rng(seed)
  image = rng.integers(0, 256, (rows, count)).astype(np.float64)
  image += {'pixels': 0, 'negative': -300, 'large': 300, 'fractional': 0.5,
            'nan': np.nan}[values]
  with np.errstate(invalid='ignore'):
    image = image.astype(image_dtype)
  label = rng.integers(0, 10, max(count + extra_labels, 0)).astype(np.float64)
  label += {'digits': 0, 'ten': 10, 'negative': -11, 'fractional': 0.25,
            'nan': np.nan}[label_values]
  with np.errstate(invalid='ignore'):
    label = label.astype(label_dtype)
  path = tmp_path / 'fuzz.mat'
  scipy_io.savemat(path, {'affNISTdata': {'image': image,
                                          'label_int': label[None]}})
  split = _read_or_data_error(path)
  if split is not None:
    # Only a faithful reading is accepted: no wrapped or rounded values.
    np.testing.assert_array_equal(
        split.images.reshape(len(split.labels), 1600).T.astype(np.float64),
        image.astype(np.float64))
    np.testing.assert_array_equal(split.labels.astype(np.float64),
                                  label.astype(np.float64))
