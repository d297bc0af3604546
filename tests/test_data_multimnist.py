"""MultiMNIST: different classes, shifts, overlap, determinism."""

import itertools

import jax
import numpy as np
import pytest

from capsjax.data import multimnist_batch
from capsjax.data import multimnist_test_set
from capsjax.data import read_idx
from capsjax.data.idx import REPO_ROOT
from tests.conftest import needs_mnist

MNIST_DIR = REPO_ROOT.parent / 'shared' / 'data' / 'mnist'
NUM_IDS = 50
BATCH = 4000
make_batch = jax.jit(multimnist_batch, static_argnums=3)


@pytest.fixture(scope='module')
def blocks():
  """50 full 28x28 blocks; block j is filled with j + 1 and has class j % 10.

  The pixel value identifies the source image, the nonzero box its position.
  """
  ids = np.arange(NUM_IDS)
  images = np.broadcast_to((ids + 1)[:, None, None, None],
                           (NUM_IDS, 28, 28, 1)).astype(np.uint8)
  return images, (ids % 10).astype(np.int32)


@pytest.fixture(scope='module')
def block_batch(blocks):
  return jax.device_get(make_batch(jax.random.key(0), *blocks, BATCH))


def corners(digits):
  """Top-left (row, col) of each digit's nonzero box; digits [B, S, S, 1]."""
  rows = np.any(digits[..., 0] > 0, axis=2)
  cols = np.any(digits[..., 0] > 0, axis=1)
  return np.stack([rows.argmax(1), cols.argmax(1)], 1)


def test_shapes_and_image_is_clipped_sum(block_batch):
  b = block_batch
  for key in ('image', 'first', 'second'):
    assert b[key].shape == (BATCH, 36, 36, 1) and b[key].dtype == np.float32
  assert b['labels'].shape == (BATCH, 2) and b['labels'].dtype == np.int32
  np.testing.assert_array_equal(
      b['image'], np.clip(b['first'] + b['second'], 0, 1))
  assert b['image'].min() >= 0 and b['image'].max() <= 1


def test_labels_differ_and_match_the_source_images(block_batch, blocks):
  _, labels = blocks
  b = block_batch
  assert np.all(b['labels'][:, 0] != b['labels'][:, 1])
  for k, key in enumerate(('first', 'second')):
    ids = np.rint(b[key].reshape(BATCH, -1).max(1) * 255).astype(int) - 1
    np.testing.assert_array_equal(labels[ids], b['labels'][:, k])
    assert len(set(ids.tolist())) == NUM_IDS  # every image gets used
  # The partner class is uniform over the 9 others.
  offsets = (b['labels'][:, 1] - b['labels'][:, 0]) % 10
  counts = np.bincount(offsets, minlength=10)
  assert counts[0] == 0 and counts[1:].min() > BATCH / 9 * 0.8


def test_shifts_up_to_4_pixels_and_80_percent_overlap(block_batch):
  first = corners(block_batch['first']) - 4  # shift from the centre
  second = corners(block_batch['second']) - 4
  for shifts in (first, second):
    assert shifts.min() == -4 and shifts.max() == 4
    assert set(map(tuple, shifts)) == set(itertools.product(range(-4, 5),
                                                            repeat=2))
  # Each digit is whole: 28x28 nonzero pixels.
  assert np.all(np.sum(block_batch['first'] > 0, axis=(1, 2, 3)) == 784)
  # Overlap of the two 28x28 boxes: ((28 - |dy|)(28 - |dx|)) / 784, whose
  # mean over independent shifts is (1 - E|d| / 28)^2 = 0.7996: the paper's
  # "about 80%".
  d = np.abs(first - second)
  overlap = np.prod(28 - d, axis=1) / 784
  print(f'mean 28x28 box overlap: {overlap.mean():.4f}')
  assert 0.78 < overlap.mean() < 0.82


def test_determinism(blocks, block_batch):
  again = make_batch(jax.random.key(0), *blocks, BATCH)
  for key in block_batch:
    np.testing.assert_array_equal(again[key], block_batch[key])
  other = make_batch(jax.random.key(1), *blocks, BATCH)
  assert not np.array_equal(other['image'], block_batch['image'])


def test_every_class_needed(blocks):
  images, labels = blocks
  keep = labels != 3
  with pytest.raises(ValueError, match='every class'):
    multimnist_batch(jax.random.key(0), images[keep], labels[keep], 4)


@needs_mnist
def test_test_set_on_mnist_digits():
  images = read_idx(MNIST_DIR / 't10k-images-idx3-ubyte.gz')[..., None]
  labels = read_idx(MNIST_DIR / 't10k-labels-idx1-ubyte.gz').astype(np.int32)
  data = multimnist_test_set(images, labels, 1500, seed=0)
  assert all(isinstance(v, np.ndarray) for v in data.values())
  assert data['image'].shape == (1500, 36, 36, 1)
  assert data['labels'].shape == (1500, 2)
  assert np.all(data['labels'][:, 0] != data['labels'][:, 1])
  # Overlap of the two digits' ink boxes: intersection / smaller box.
  boxes = []
  for key in ('first', 'second'):
    ink = data[key][..., 0] > 0
    rows, cols = np.any(ink, axis=2), np.any(ink, axis=1)
    boxes.append((rows.argmax(1), 36 - rows[:, ::-1].argmax(1),
                  cols.argmax(1), 36 - cols[:, ::-1].argmax(1)))
  (t1, b1, l1, r1), (t2, b2, l2, r2) = boxes
  inter = (np.clip(np.minimum(b1, b2) - np.maximum(t1, t2), 0, None)
           * np.clip(np.minimum(r1, r2) - np.maximum(l1, l2), 0, None))
  smaller = np.minimum((b1 - t1) * (r1 - l1), (b2 - t2) * (r2 - l2))
  overlap = np.mean(inter / smaller)
  print(f'mean ink-box overlap on MNIST test digits: {overlap:.3f}')
  assert 0.6 < overlap < 0.95
  again = multimnist_test_set(images, labels, 1500, seed=0)
  for key in data:
    np.testing.assert_array_equal(data[key], again[key])
  other = multimnist_test_set(images, labels, 10, seed=1)
  assert not np.array_equal(other['image'], data['image'][:10])
