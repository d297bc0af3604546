"""CIFAR-10: the binary and python releases, fake releases, the official
input pipeline."""

import pickle
import pickletools
import sys

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from capsjax.data import DataError
from capsjax.data import cifar10
from capsjax.data import cifar10_eval_preprocess
from capsjax.data import cifar10_train_preprocess
from capsjax.data import load_dataset
from capsjax.data import read_cifar_binary
from capsjax.data import read_cifar_pickle
from capsjax.data import write_cifar_binary
from capsjax.data import write_cifar_pickle
from tests.helpers import make_cifar10_release


def record_bytes(label, red, green, blue):
  """One binary record written by hand: the label, then three planes."""
  planes = [bytes(int(v) for v in plane) for plane in (red, green, blue)]
  return bytes([label]) + b''.join(planes)


# ----------------------------------------------------------------------------
# The binary release.


def test_reads_hand_written_records():
  plane = np.arange(1024) % 256
  data = (record_bytes(7, plane, 255 - plane, np.full(1024, 9)) +
          record_bytes(0, np.zeros(1024, int), np.ones(1024, int),
                       np.full(1024, 2)))
  split = cifar10.parse_cifar_binary(data)
  assert split.images.shape == (2, 32, 32, 3) and split.images.dtype == np.uint8
  np.testing.assert_array_equal(split.labels, [7, 0])
  assert split.labels.dtype == np.int32
  # Plane entry 32 r + c is pixel (r, c); the planes are red, green, blue.
  np.testing.assert_array_equal(split.images[0, 1, 2], [34, 255 - 34, 9])
  np.testing.assert_array_equal(split.images[0, :, :, 0],
                                plane.reshape(32, 32))
  np.testing.assert_array_equal(split.images[1, 5, 5], [0, 1, 2])


@pytest.mark.parametrize('form', ['binary', 'python'])
def test_round_trip(tmp_path, form):
  rng = np.random.default_rng(1)
  images = rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
  labels = np.array([0, 9, 3, 3, 1])
  path = tmp_path / 'batch'
  write = write_cifar_binary if form == 'binary' else write_cifar_pickle
  read = read_cifar_binary if form == 'binary' else read_cifar_pickle
  write(path, images, labels)
  split = read(path)
  np.testing.assert_array_equal(split.images, images)
  np.testing.assert_array_equal(split.labels, labels)
  if form == 'binary':
    assert path.stat().st_size == 5 * 3073


def test_python_batch_is_pickled_as_the_release_was():
  """Protocol 2 from Python 2: str opcodes, no unicode, NumPy 1's path."""
  images = np.zeros((3, 32, 32, 3), np.uint8)
  images[1, 0, 1] = (10, 20, 30)
  data = cifar10.cifar_pickle_bytes(images, [4, 5, 6])
  ops = [(op.name, arg) for op, arg, _ in pickletools.genops(data)]
  assert ops[0] == ('PROTO', 2)
  names = {name for name, _ in ops}
  assert 'BINUNICODE' not in names and 'SHORT_BINSTRING' in names
  assert ('GLOBAL', 'numpy.core.multiarray _reconstruct') in ops
  batch = pickle.loads(data, encoding='bytes')
  assert set(batch) == {b'batch_label', b'labels', b'data', b'filenames'}
  assert batch[b'data'].shape == (3, 3072) and batch[b'labels'] == [4, 5, 6]
  # CHW rows: pixel (0, 1) of each plane.
  np.testing.assert_array_equal(batch[b'data'][1, [1, 1025, 2049]],
                                [10, 20, 30])


@pytest.mark.parametrize('data,problem', [
    (b'', 'empty file'),
    (bytes(3073 * 2 - 1), 'truncated'),
    (bytes(3073 + 5), 'trailing bytes'),
    (bytes([10]) + bytes(3072), 'label 10 of image 0'),
    (bytes(3073) + bytes([200]) + bytes(3072), 'label 200 of image 1'),
])
def test_corrupt_binary_files(tmp_path, data, problem):
  path = tmp_path / 'data_batch_1.bin'
  path.write_bytes(data)
  with pytest.raises(DataError, match=problem) as info:
    read_cifar_binary(path)
  message = str(info.value)
  assert str(path) in message and 'kriz/cifar.html' in message
  assert '\n' not in message


_VALID = record_bytes(3, np.arange(1024) % 256, np.zeros(1024, int),
                      np.zeros(1024, int)) * 2


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=7000))
def test_fuzz_binary_random_bytes(data):
  try:
    split = cifar10.parse_cifar_binary(data)
  except DataError:
    return
  assert split.images.shape == (len(data) // 3073, 32, 32, 3)
  assert split.labels.max() <= 9


@settings(max_examples=60, deadline=None)
@given(st.integers(0, len(_VALID) - 1))
def test_fuzz_binary_truncations(cut):
  data = _VALID[:cut]
  if cut == 3073:  # one whole record
    assert len(cifar10.parse_cifar_binary(data).labels) == 1
    return
  with pytest.raises(DataError):
    cifar10.parse_cifar_binary(data)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 300))
def test_fuzz_truncated_gzip(tmp_path, cut):
  import gzip
  compressed = gzip.compress(_VALID)
  path = tmp_path / 'data_batch_1.bin'
  path.write_bytes(compressed[:min(cut, len(compressed) - 1)])
  with pytest.raises(DataError):
    read_cifar_binary(path)


# ----------------------------------------------------------------------------
# The python release.


_PICKLE = cifar10.cifar_pickle_bytes(np.full((2, 32, 32, 3), 7, np.uint8),
                                     [1, 2])


class _Exploit:
  def __reduce__(self):
    return (print, ('this must never run',))


@pytest.mark.parametrize('data,problem', [
    (b'', 'not a readable CIFAR-10 python batch'),
    (b'not a pickle', 'not a readable'),
    (pickle.dumps([1, 2], protocol=2), "expected a dict with b'data'"),
    (pickle.dumps({b'data': np.zeros((2, 3072), np.uint8)}, protocol=4),
     "expected a dict with b'data' and b'labels'"),
    (pickle.dumps({b'data': np.zeros((2, 3071), np.uint8),
                   b'labels': [0, 1]}, protocol=4), 'uint8 \\[N, 3072\\]'),
    (pickle.dumps({b'data': np.zeros((2, 3072), np.int16),
                   b'labels': [0, 1]}, protocol=4), 'uint8'),
    (pickle.dumps({b'data': np.zeros((2, 3072), np.uint8),
                   b'labels': [0]}, protocol=4), '1 labels for 2 images'),
    (pickle.dumps({b'data': np.zeros((1, 3072), np.uint8),
                   b'labels': [10]}, protocol=4), 'label 10 of image 0'),
    (pickle.dumps({b'data': np.zeros((1, 3072), np.uint8),
                   b'labels': [-1]}, protocol=4), 'label -1'),
    (pickle.dumps({b'data': np.zeros((1, 3072), np.uint8),
                   b'labels': ['a']}, protocol=4), 'not a list of ints'),
    (pickle.dumps(_Exploit(), protocol=4), 'refused to load builtins.print'),
], ids=['empty', 'text', 'list', 'no labels', 'short rows', 'int16', 'count',
        'label 10', 'label -1', 'label text', 'code'])
def test_corrupt_or_foreign_pickles(tmp_path, capsys, data, problem):
  path = tmp_path / 'data_batch_1'
  path.write_bytes(data)
  with pytest.raises(DataError, match=problem) as info:
    read_cifar_pickle(path)
  assert str(path) in str(info.value)
  assert 'must never run' not in capsys.readouterr().out


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=96))
def test_fuzz_pickle_random_bytes(data):
  try:
    split = cifar10.parse_cifar_pickle(data)
  except DataError:
    return
  assert split.images.shape[1:] == (32, 32, 3)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, len(_PICKLE) - 1))
def test_fuzz_pickle_truncations(cut):
  with pytest.raises(DataError):
    cifar10.parse_cifar_pickle(_PICKLE[:cut])


@settings(max_examples=80, deadline=None)
@given(st.integers(0, len(_PICKLE) - 1), st.integers(0, 7))
def test_fuzz_pickle_bit_flips(position, bit):
  data = bytearray(_PICKLE)
  data[position] ^= 1 << bit
  try:
    split = cifar10.parse_cifar_pickle(bytes(data))
  except DataError:
    return
  assert split.images.dtype == np.uint8 and split.labels.max() <= 9


# ----------------------------------------------------------------------------
# Releases and load_dataset.


@pytest.mark.parametrize('form,subdir', [('binary', 'cifar-10-batches-bin'),
                                         ('python', 'cifar-10-batches-py')])
def test_load_fake_release(tmp_path, form, subdir):
  (images, labels), test = make_cifar10_release(tmp_path / subdir, form=form)
  # The directory above the extracted one, as the official experiment.py
  # takes it.
  data = load_dataset('cifar10', data_dir=tmp_path, validation_size=4)
  assert data.name == 'cifar10' and data.num_classes == 10
  assert data.train.images.shape == (26, 32, 32, 3)
  assert data.validation.images.shape == (4, 32, 32, 3)
  assert data.test.images.shape == (8, 32, 32, 3)
  assert data.train.images.dtype == np.uint8
  assert data.train.labels.dtype == np.int32
  # Training files in order; validation is the end of data_batch_5.
  np.testing.assert_array_equal(data.train.images[:, 0, 0, 0], np.arange(26))
  np.testing.assert_array_equal(data.validation.images, images[26:])
  np.testing.assert_array_equal(data.validation.labels, labels[26:])
  np.testing.assert_array_equal(data.test.images, test[0])
  np.testing.assert_array_equal(data.test.labels, test[1])
  same = load_dataset('CIFAR-10', data_dir=tmp_path / subdir,
                      validation_size=0)
  assert len(same.train.labels) == 30 and len(same.validation.labels) == 0


def test_binary_release_is_preferred(tmp_path):
  make_cifar10_release(tmp_path, form='python', seed=1)
  _, test = make_cifar10_release(tmp_path, form='binary', seed=2)
  data = load_dataset('cifar10', data_dir=tmp_path, validation_size=0)
  np.testing.assert_array_equal(data.test.images, test[0])


def test_corrupt_file_of_a_release_names_it(tmp_path):
  make_cifar10_release(tmp_path)
  bad = tmp_path / 'data_batch_3.bin'
  bad.write_bytes(bad.read_bytes()[:-1])
  with pytest.raises(DataError, match='truncated') as info:
    load_dataset('cifar10', data_dir=tmp_path)
  assert str(bad) in str(info.value)


def test_missing_files_are_named(tmp_path, monkeypatch):
  make_cifar10_release(tmp_path / 'cifar10')
  (tmp_path / 'cifar10' / 'data_batch_4.bin').unlink()
  with pytest.raises(FileNotFoundError) as info:
    load_dataset('cifar10', data_dir=tmp_path)
  message = str(info.value)
  assert f'{tmp_path / "cifar10"} has data_batch_1.bin' in message
  assert 'lacks data_batch_4.bin' in message
  for way in ('--config.data_dir', 'CAPSJAX_DATA_DIR', 'capsjax[tfds]',
              'https://www.cs.toronto.edu/~kriz/cifar.html'):
    assert way in message
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)
  with pytest.raises(ImportError, match=r'capsjax\[tfds\]'):
    load_dataset('cifar10', source='tfds')
  with pytest.raises(ValueError, match='source'):
    load_dataset('cifar10', data_dir=tmp_path, source='web')
  with pytest.raises(TypeError, match='no options'):
    load_dataset('cifar10', data_dir=tmp_path, stereo=True)


# ----------------------------------------------------------------------------
# The official input pipeline.


def standardize_ref(x):
  x = np.asarray(x, np.float64)
  return (x - x.mean()) / max(x.std(), 1 / np.sqrt(x.size))


def distort_ref(image, offset, flip, delta, factor):
  """The official _distort_resize and per_image_standardization in float64:
  crop, flip, + delta * 255, contrast about each channel's mean, then
  standardise."""
  top, left = offset
  x = np.asarray(image, np.float64)[top:top + 24, left:left + 24]
  if flip:
    x = x[:, ::-1]
  x = x + 255 * delta
  mean = x.mean(axis=(0, 1), keepdims=True)
  return standardize_ref((x - mean) * factor + mean)


@pytest.fixture(scope='module')
def images():
  return np.random.default_rng(3).integers(0, 256, (16, 32, 32, 3),
                                           dtype=np.uint8)


# Jitted, each a single compilation (eagerly, one per operation).
_draws = jax.jit(cifar10.cifar10_train_draws, static_argnums=(1, 2, 3))
_distort = jax.jit(cifar10.cifar10_distort)
_train_preprocess = jax.jit(cifar10_train_preprocess,
                            static_argnames='flip')


def test_distort_matches_float64_reference(images):
  key = jax.random.key(0)
  draws = _draws(key, 16, 32, 32)
  out = np.asarray(_distort(images, *draws))
  assert out.shape == (16, 24, 24, 3) and out.dtype == np.float32
  offsets, flips, delta, factor = (np.asarray(d) for d in draws)
  for b in range(16):
    np.testing.assert_allclose(
        out[b], distort_ref(images[b], offsets[b], flips[b], delta[b],
                            factor[b]), atol=2e-5)
  # The official pipeline's statistics; all its draws in range.
  np.testing.assert_allclose(out.mean(axis=(1, 2, 3)), 0, atol=1e-5)
  assert offsets.min() >= 0 and offsets.max() <= 8
  assert np.all(np.abs(delta) <= 63 / 255)
  assert np.all((factor >= 0.2) & (factor <= 1.8))
  # Two programs: their fused code may round the standardisation a few
  # ulps apart (a wrong draw differs by whole pixels).
  np.testing.assert_allclose(np.asarray(_train_preprocess(key, images)), out,
                             rtol=0, atol=1e-5)


def test_draws_cover_crops_and_flips():
  offsets, flips, _, _ = _draws(jax.random.key(5), 2000, 32, 32)
  offsets, flips = np.asarray(offsets), np.asarray(flips)
  # All 9 positions per axis (tf.random_crop's); flips with probability 1/2.
  assert set(offsets.ravel().tolist()) == set(range(9))
  assert 0.45 < flips.mean() < 0.55


def test_no_flip_and_flip_left_right(images):
  key = jax.random.key(1)
  plain = _train_preprocess(key, images, flip=False)
  offsets, flips, delta, factor = _draws(key, 16, 32, 32)
  np.testing.assert_allclose(  # two programs, as above
      plain, _distort(images, offsets, np.zeros(16, bool), delta, factor),
      rtol=0, atol=1e-5)
  x = np.arange(2 * 2 * 3 * 1, dtype=np.int32).reshape(2, 2, 3, 1)
  flipped = jax.jit(cifar10.flip_left_right)(x, np.array([True, False]))
  np.testing.assert_array_equal(flipped[0], x[0, :, ::-1])
  np.testing.assert_array_equal(flipped[1], x[1])


def test_eval_preprocess_is_the_standardised_centre(images):
  out = np.asarray(jax.jit(cifar10_eval_preprocess)(images[:4]))
  assert out.shape == (4, 24, 24, 3)
  for b in range(4):
    np.testing.assert_allclose(out[b], standardize_ref(images[b, 4:28, 4:28]),
                               atol=2e-5)
  # A constant image: zeros (the std floor), not NaN.
  flat = jax.jit(cifar10_eval_preprocess)(np.full((2, 32, 32, 3), 9,
                                                  np.uint8))
  np.testing.assert_allclose(flat, 0, atol=1e-4)
  with pytest.raises(ValueError, match='H, W >= 24'):
    cifar10_train_preprocess(jax.random.key(0), images[:, :20])
