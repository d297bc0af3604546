"""Su's side-by-side pairs: halves, classes, coverage, determinism."""


import numpy as np
import pytest

from capsjax.data import load_dataset
from capsjax.data import side_by_side_pairs
from capsjax.data.idx import REPO_ROOT
from tests.conftest import needs_mnist

MNIST_DIR = REPO_ROOT.parent / 'shared' / 'data' / 'mnist'


@pytest.fixture(scope='module')
def blocks():
  """300 8x6 'digits'; digit j is filled with j % 251 + 1, its class j % 7.

  The pixel values of a half identify its source digit.
  """
  ids = np.arange(300)
  images = np.broadcast_to((ids % 251 + 1)[:, None, None, None],
                           (300, 8, 6, 1)).astype(np.uint8).copy()
  images[:, 0, 0, 0] = ids // 251  # with the fill: a unique id per digit
  return images, (ids % 7).astype(np.int32)


def _source_ids(halves):
  return halves[:, 0, 0, 0].astype(int) * 251 + halves[:, 1, 1, 0] - 1


def test_halves_are_the_source_digits(blocks):
  images, labels = blocks
  pairs = side_by_side_pairs(images, labels, seed=3)
  m = len(pairs['labels'])
  assert pairs['image'].shape == (m, 8, 12, 1)
  assert pairs['image'].dtype == np.uint8
  assert pairs['labels'].shape == (m, 2) and pairs['labels'].dtype == np.int32
  assert pairs['indices'].shape == (m, 2)
  left, right = pairs['indices'].T
  np.testing.assert_array_equal(pairs['image'][:, :, :6], images[left])
  np.testing.assert_array_equal(pairs['image'][:, :, 6:], images[right])
  np.testing.assert_array_equal(_source_ids(pairs['image'][:, :, :6]), left)
  np.testing.assert_array_equal(_source_ids(pairs['image'][:, :, 6:]), right)
  np.testing.assert_array_equal(pairs['labels'][:, 0], labels[left])
  np.testing.assert_array_equal(pairs['labels'][:, 1], labels[right])


def test_classes_differ_and_every_differing_pair_is_kept(blocks):
  images, labels = blocks
  pairs = side_by_side_pairs(images, labels, seed=3)
  left, right = pairs['indices'].T
  assert np.all(pairs['labels'][:, 0] != pairs['labels'][:, 1])
  # Each digit on the left at most once and on the right at most once, left
  # in order: a permutation, filtered.
  assert np.all(np.diff(left) > 0)
  assert len(set(right.tolist())) == len(right)
  # The dropped left digits are exactly those whose partner has their class:
  # with 7 balanced classes about 1/7 of them.
  dropped = np.setdiff1d(np.arange(len(labels)), left)
  assert 0.05 < len(dropped) / len(labels) < 0.25
  # A dropped left digit was paired with a digit of its own class, and those
  # partners are exactly the digits missing on the right: the two sets have
  # the same classes.
  unused = np.setdiff1d(np.arange(len(labels)), right)
  np.testing.assert_array_equal(np.sort(labels[dropped]),
                                np.sort(labels[unused]))


def test_deterministic_by_seed(blocks):
  a = side_by_side_pairs(*blocks, seed=0)
  b = side_by_side_pairs(*blocks, seed=0)
  c = side_by_side_pairs(*blocks, seed=1)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key])
  assert not np.array_equal(a['indices'][:20], c['indices'][:20])


def test_bad_shapes(blocks):
  images, labels = blocks
  with pytest.raises(ValueError, match=r'images must be \[N, H, W, C\]'):
    side_by_side_pairs(images[..., 0], labels, 0)
  with pytest.raises(ValueError, match=r'labels must be \[N\]'):
    side_by_side_pairs(images, labels[:-1], 0)


@needs_mnist
def test_mnist_test_split_gives_about_9000_pairs_of_28x56():
  test = load_dataset('mnist', data_dir=MNIST_DIR, validation_size=0).test
  pairs = side_by_side_pairs(test.images, test.labels, seed=0)
  assert pairs['image'].shape[1:] == (28, 56, 1)
  # 1 - sum_k p_k^2 of MNIST's test classes: 0.900.
  p = np.bincount(test.labels) / len(test.labels)
  expected = (1 - np.sum(p ** 2)) * len(test.labels)
  assert abs(len(pairs['labels']) - expected) < 150, len(pairs['labels'])
