"""smallNORB: matrix format, fake releases, viewpoint splits, preprocessing."""

import gzip
import struct
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from capsjax.data import DataError
from capsjax.data import load_dataset
from capsjax.data import read_norb_matrix
from capsjax.data import smallnorb as norb
from capsjax.data import smallnorb_eval_preprocess
from capsjax.data import smallnorb_multicrop
from capsjax.data import smallnorb_train_preprocess
from capsjax.data import write_norb_matrix
from tests.helpers import make_norb_release


def norb_bytes(magic, dims, payload, ndim=None):
  """Release bytes written by hand (independent of the writer)."""
  ndim = len(dims) if ndim is None else ndim
  slots = list(dims) + [1] * (3 - len(dims))
  return struct.pack(f'<ii{len(slots)}i', magic, ndim, *slots) + payload


# ----------------------------------------------------------------------------
# The matrix format.


def test_reads_hand_written_headers():
  cat = norb.parse_norb_matrix(
      norb_bytes(0x1E3D4C54, [3], struct.pack('<3i', 4, 0, 2)))
  np.testing.assert_array_equal(cat, [4, 0, 2])
  assert cat.dtype == np.int32
  info = norb.parse_norb_matrix(
      norb_bytes(0x1E3D4C54, [2, 4], struct.pack('<8i', *range(8))))
  np.testing.assert_array_equal(info, np.arange(8).reshape(2, 4))
  dat = norb.parse_norb_matrix(
      norb_bytes(0x1E3D4C55, [1, 2, 2, 3], bytes(range(12))))
  np.testing.assert_array_equal(dat, np.arange(12).reshape(1, 2, 2, 3))


def test_writer_produces_the_release_header():
  data = norb.norb_matrix_bytes(np.array([1, 2], np.int32))
  # magic 0x1E3D4C54 little-endian, ndim 1, dims [2, 1, 1].
  assert data[:20] == bytes.fromhex('544c3d1e 01000000 02000000 01000000 '
                                    '01000000')
  dat = norb.norb_matrix_bytes(np.zeros((5, 2, 4, 4), np.uint8))
  assert dat[:24] == struct.pack('<6i', 0x1E3D4C55, 4, 5, 2, 4, 4)
  assert len(dat) == 24 + 5 * 2 * 4 * 4


@pytest.mark.parametrize('dtype', [np.uint8, np.int16, np.int32, np.float32,
                                   np.float64])
@pytest.mark.parametrize('shape', [(7,), (3, 4), (2, 3, 4), (2, 2, 3, 5)])
@pytest.mark.parametrize('gz', [False, True])
def test_round_trip(tmp_path, dtype, shape, gz):
  array = (np.random.default_rng(0).normal(size=shape) * 50).astype(dtype)
  path = tmp_path / ('m.mat.gz' if gz else 'm.mat')
  write_norb_matrix(path, array)
  assert (path.read_bytes()[:2] == b'\x1f\x8b') == gz
  out = read_norb_matrix(path)
  assert out.dtype == np.dtype(dtype) and out.shape == shape
  np.testing.assert_array_equal(out, array)


@pytest.mark.parametrize('data,problem', [
    (norb_bytes(0x1E3D4C55, [2, 3], bytes(5)), 'truncated'),
    (norb_bytes(0x1E3D4C55, [2, 3], bytes(7)), 'trailing'),
    (norb_bytes(0x1E3D4C52, [2], bytes(2)), 'bad magic'),
    (norb_bytes(0x1E3D4C55, [2, -3], b''), 'negative'),
    (norb_bytes(0x1E3D4C55, [], b'', ndim=0), '0 dimensions'),
    (norb_bytes(0x1E3D4C55, [1], b'', ndim=1000), '1000 dimensions'),
    (struct.pack('<ii', 0x1E3D4C55, 4) + bytes(8), 'truncated header'),
    (b'\x55\x4c', 'shorter than'),
])
def test_corrupt_files(tmp_path, data, problem):
  path = tmp_path / 'smallnorb-training-dat.mat'
  path.write_bytes(data)
  with pytest.raises(DataError, match=problem) as info:
    read_norb_matrix(path)
  assert str(path) in str(info.value)


def test_writer_rejects_unsupported_dtypes(tmp_path):
  with pytest.raises(ValueError, match='dtype'):
    write_norb_matrix(tmp_path / 'x.mat', np.zeros(3, np.int64))


_VALID = norb_bytes(0x1E3D4C54, [2, 3], struct.pack('<6i', *range(6)))


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=64))
def test_fuzz_random_bytes(data):
  try:
    out = norb.parse_norb_matrix(data)
  except DataError:
    return
  assert isinstance(out, np.ndarray)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(sorted(norb.MAGIC_TO_DTYPE)), st.integers(-5, 20),
       st.binary(max_size=48))
def test_fuzz_valid_magic_random_rest(magic, ndim, rest):
  data = struct.pack('<ii', magic, ndim) + rest
  try:
    norb.parse_norb_matrix(data)
  except DataError:
    pass


@settings(max_examples=60, deadline=None)
@given(st.integers(0, len(_VALID) - 1))
def test_fuzz_truncations(cut):
  with pytest.raises(DataError):
    norb.parse_norb_matrix(_VALID[:cut])


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 200))
def test_fuzz_truncated_gz(tmp_path, cut):
  compressed = gzip.compress(_VALID)
  path = tmp_path / 'x-cat.mat.gz'
  path.write_bytes(compressed[:min(cut, len(compressed) - 1)])
  with pytest.raises(DataError):
    read_norb_matrix(path)


# ----------------------------------------------------------------------------
# Releases and load_dataset.


@pytest.mark.parametrize('gz', [False, True])
def test_load_fake_release(tmp_path, gz):
  arrays = make_norb_release(tmp_path / 'smallnorb', gz=gz)
  data = load_dataset('smallnorb', data_dir=tmp_path, validation_size=6)
  assert data.name == 'smallnorb' and data.num_classes == 5
  assert data.train.images.shape == (30, 48, 48, 2)
  assert data.validation.images.shape == (6, 48, 48, 2)
  assert data.test.images.shape == (36, 48, 48, 2)
  assert data.train.images.dtype == np.uint8
  assert data.train.labels.dtype == np.int32
  np.testing.assert_array_equal(data.train.labels, arrays['training'][1][:30])
  np.testing.assert_array_equal(data.validation.labels,
                                arrays['training'][1][30:])
  # Image i is filled with i (left) and i + 100 (right).
  np.testing.assert_array_equal(data.validation.images[:, 0, 0],
                                np.stack([np.arange(30, 36),
                                          np.arange(130, 136)], 1))
  mono = load_dataset('smallnorb', data_dir=tmp_path / 'smallnorb',
                      validation_size=0, stereo=False)
  assert mono.train.images.shape == (36, 48, 48, 1)
  np.testing.assert_array_equal(mono.train.images[:, 5, 7, 0], np.arange(36))


def test_downsample_is_rounded_2x2_mean():
  rng = np.random.default_rng(1)
  dat = rng.integers(0, 256, (3, 2, 6, 8)).astype(np.uint8)
  out = norb.downsample(dat)
  assert out.shape == (3, 3, 4, 2) and out.dtype == np.uint8
  mean = dat.astype(np.float64).reshape(3, 2, 3, 2, 4, 2).mean(axis=(3, 5))
  np.testing.assert_array_equal(out, np.floor(mean + 0.5).transpose(0, 2, 3, 1))
  block = np.array([[[[0, 1], [2, 3]], [[255, 255], [255, 254]]]], np.uint8)
  np.testing.assert_array_equal(norb.downsample(block)[0, 0, 0], [2, 255])


@pytest.mark.parametrize('split,train_values,key', [
    ('azimuth', {30, 32, 34, 0, 2, 4}, 2),
    ('elevation', {0, 1, 2}, 1),
])
def test_viewpoint_splits(tmp_path, split, train_values, key):
  arrays = make_norb_release(tmp_path, n_train=72, n_test=54)
  data = load_dataset('smallnorb', data_dir=tmp_path, validation_size=3,
                      viewpoint_split=split)
  assert data.name == f'smallnorb_{split}'
  train_ids = np.concatenate([data.train.images[:, 0, 0, 0],
                              data.validation.images[:, 0, 0, 0]])
  test_ids = data.test.images[:, 0, 0, 0]
  train_info, test_info = arrays['training'][2], arrays['testing'][2]
  expect_train = [i for i in range(72) if train_info[i, key] in train_values]
  expect_test = [i for i in range(54) if test_info[i, key] not in train_values]
  np.testing.assert_array_equal(train_ids, expect_train)
  np.testing.assert_array_equal(test_ids, expect_test)
  # Validation is carved from the end of the filtered training set.
  np.testing.assert_array_equal(data.validation.images[:, 0, 0, 0],
                                expect_train[-3:])
  if split == 'azimuth':
    degrees = set((train_info[train_ids, 2] * 10).tolist())
    assert degrees == {300, 320, 340, 0, 20, 40}
    assert not set((test_info[test_ids, 2] * 10).tolist()) & degrees
    assert len(set((test_info[test_ids, 2]).tolist())) == 12


def test_release_consistency_errors(tmp_path):
  make_norb_release(tmp_path, n_train=10, n_test=10)
  name = f'{norb.SPLIT_FILES["testing"]}-cat.mat'
  write_norb_matrix(tmp_path / name, np.zeros(9, np.int32))
  with pytest.raises(DataError, match='one per image') as info:
    load_dataset('smallnorb', data_dir=tmp_path)
  assert name in str(info.value)
  write_norb_matrix(tmp_path / name, np.full(10, 5, np.int32))
  with pytest.raises(DataError, match='categories outside'):
    load_dataset('smallnorb', data_dir=tmp_path)


def test_missing_release_and_tfds(tmp_path, monkeypatch):
  with pytest.raises(FileNotFoundError) as info:
    load_dataset('smallnorb', data_dir=tmp_path)
  assert str(tmp_path / 'smallnorb') in str(info.value)
  assert 'training-{dat,cat,info}.mat' in str(info.value)
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)
  with pytest.raises(ImportError, match=r'capsjax\[tfds\]'):
    load_dataset('smallnorb', source='tfds')
  with pytest.raises(ValueError, match='viewpoint_split'):
    load_dataset('smallnorb', data_dir=tmp_path, viewpoint_split='lighting')


# ----------------------------------------------------------------------------
# Preprocessing.


def standardize_ref(x):
  x = np.asarray(x, np.float64)
  return (x - x.mean()) / max(x.std(), 1 / np.sqrt(x.size))


@pytest.fixture(scope='module')
def images():
  return np.random.default_rng(2).integers(0, 256, (64, 48, 48, 2),
                                           dtype=np.uint8)


def test_train_preprocess_statistics(images):
  out = jax.jit(smallnorb_train_preprocess)(jax.random.key(0), images)
  assert out.shape == (64, 32, 32, 2) and out.dtype == jnp.float32
  out = np.asarray(out, np.float64)
  np.testing.assert_allclose(out.mean(axis=(1, 2, 3)), 0, atol=1e-5)
  np.testing.assert_allclose(out.std(axis=(1, 2, 3)), 1, atol=1e-4)


def test_train_preprocess_crop_positions(images):
  images = images[..., :1]
  out = np.asarray(jax.jit(smallnorb_train_preprocess)(jax.random.key(1),
                                                       images))
  # For one channel the standardisation undoes brightness and contrast, so
  # each output is the standardised crop at some offset in [0, 16]^2.
  windows = np.lib.stride_tricks.sliding_window_view(
      images[..., 0] / 255, (32, 32), axis=(1, 2))  # [B, 17, 17, 32, 32]
  mean = windows.mean(axis=(3, 4), keepdims=True)
  std = np.maximum(windows.std(axis=(3, 4), keepdims=True), 1 / 32)
  error = np.abs((windows - mean) / std - out[:, None, None, :, :, 0])
  matches = error.max(axis=(3, 4)) < 1e-3  # [B, 17, 17]
  assert np.all(matches.sum(axis=(1, 2)) == 1)
  found = np.argwhere(matches)[:, 1:]
  found = np.array(found)
  # All 17 positions per axis are reachable (an off-by-one would lose 16).
  assert found.min() == 0 and found.max() == 16
  assert len(set(map(tuple, found))) > 40  # 64 draws from 289 positions


def test_train_preprocess_determinism_and_constant_images(images):
  preprocess = jax.jit(smallnorb_train_preprocess)
  a = preprocess(jax.random.key(3), images[:8])
  b = preprocess(jax.random.key(3), images[:8])
  c = preprocess(jax.random.key(4), images[:8])
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  flat = preprocess(jax.random.key(0), np.full((8, 48, 48, 2), 7, np.uint8))
  # The std floor: zeros up to float rounding (times 32), not NaN.
  np.testing.assert_allclose(flat, 0, atol=1e-3)


def test_eval_preprocess_is_standardised_centre_crop(images):
  out = np.asarray(jax.jit(smallnorb_eval_preprocess)(images[:4]))
  assert out.shape == (4, 32, 32, 2)
  for b in range(4):
    np.testing.assert_allclose(
        out[b], standardize_ref(images[b, 8:40, 8:40] / 255), atol=1e-5)


def test_multicrop(images):
  crops = np.asarray(smallnorb_multicrop(images[:3]))
  assert crops.shape == (13, 3, 32, 32, 2)
  np.testing.assert_allclose(crops[0], smallnorb_eval_preprocess(images[:3]),
                             atol=1e-6)
  offsets = norb.multicrop_offsets(48, 48)
  assert len(set(offsets)) == 13 and offsets[0] == (8, 8)
  assert {(0, 0), (0, 16), (16, 0), (16, 16), (4, 4), (12, 12)} <= set(offsets)
  for k, (t, left) in enumerate(offsets):
    np.testing.assert_allclose(
        crops[k, 1], standardize_ref(images[1, t:t + 32, left:left + 32] / 255),
        atol=1e-5)
  assert smallnorb_multicrop(images[:2], 5).shape == (5, 2, 32, 32, 2)
  with pytest.raises(ValueError):
    smallnorb_multicrop(images[:2], 14)
