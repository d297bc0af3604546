"""Su's digit pairs (stacked and side by side): halves, classes, coverage,
determinism; blank receptive fields against a direct count."""


import numpy as np
import pytest

from capsjax.data import blank_fields
from capsjax.data import digit_pairs
from capsjax.data import load_dataset
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


@pytest.mark.parametrize('layout', ['stacked', 'side_by_side'])
def test_halves_are_the_source_digits(blocks, layout):
  images, labels = blocks
  pairs = digit_pairs(images, labels, seed=3, layout=layout)
  m = len(pairs['labels'])
  stacked = layout == 'stacked'
  assert pairs['image'].shape == ((m, 16, 6, 1) if stacked else (m, 8, 12, 1))
  assert pairs['image'].dtype == np.uint8
  assert pairs['labels'].shape == (m, 2) and pairs['labels'].dtype == np.int32
  assert pairs['indices'].shape == (m, 2)
  first, second = pairs['indices'].T
  halves = ((pairs['image'][:, :8], pairs['image'][:, 8:]) if stacked else
            (pairs['image'][:, :, :6], pairs['image'][:, :, 6:]))
  np.testing.assert_array_equal(halves[0], images[first])
  np.testing.assert_array_equal(halves[1], images[second])
  np.testing.assert_array_equal(_source_ids(halves[0]), first)
  np.testing.assert_array_equal(_source_ids(halves[1]), second)
  np.testing.assert_array_equal(pairs['labels'][:, 0], labels[first])
  np.testing.assert_array_equal(pairs['labels'][:, 1], labels[second])


def test_both_layouts_pair_the_same_digits(blocks):
  stacked = digit_pairs(*blocks, seed=5)
  side = digit_pairs(*blocks, seed=5, layout='side_by_side')
  np.testing.assert_array_equal(stacked['indices'], side['indices'])
  np.testing.assert_array_equal(stacked['labels'], side['labels'])


def test_classes_differ_and_every_differing_pair_is_kept(blocks):
  images, labels = blocks
  pairs = digit_pairs(images, labels, seed=3)
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
  a = digit_pairs(*blocks, seed=0)
  b = digit_pairs(*blocks, seed=0)
  c = digit_pairs(*blocks, seed=1)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key])
  assert not np.array_equal(a['indices'][:20], c['indices'][:20])


def test_bad_shapes(blocks):
  images, labels = blocks
  with pytest.raises(ValueError, match=r'images must be \[N, H, W, C\]'):
    digit_pairs(images[..., 0], labels, 0)
  with pytest.raises(ValueError, match=r'labels must be \[N\]'):
    digit_pairs(images, labels[:-1], 0)
  with pytest.raises(ValueError, match='layout must be one of'):
    digit_pairs(images, labels, 0, layout='diagonal')
  with pytest.raises(ValueError, match='H, W >= 14'):
    blank_fields(images)


@needs_mnist
def test_mnist_test_split_gives_about_9000_pairs_of_56x28():
  test = load_dataset('mnist', data_dir=MNIST_DIR, validation_size=0).test
  pairs = digit_pairs(test.images, test.labels, seed=0)
  assert pairs['image'].shape[1:] == (56, 28, 1)
  # 1 - sum_k p_k^2 of MNIST's test classes: 0.900.
  p = np.bincount(test.labels) / len(test.labels)
  expected = (1 - np.sum(p ** 2)) * len(test.labels)
  assert abs(len(pairs['labels']) - expected) < 150, len(pairs['labels'])


def _np_blank_fields(images, field, stride):
  """Window by window."""
  m, h, w, _ = images.shape
  rows = range(0, h - field + 1, stride)
  cols = range(0, w - field + 1, stride)
  return np.array([[[not np.any(images[k, r:r + field, c:c + field] > 0)
                     for c in cols] for r in rows] for k in range(m)])


def test_blank_fields_match_a_window_by_window_count():
  rng = np.random.default_rng(0)
  # Sparse ink, so that both blank and inked windows occur.
  images = (rng.random((6, 31, 20, 2)) > 0.997).astype(np.uint8) * 200
  for field, stride in ((14, 2), (5, 3), (1, 1)):
    blank = blank_fields(images, field, stride)
    expected = _np_blank_fields(images, field, stride)
    assert blank.shape == expected.shape
    np.testing.assert_array_equal(blank, expected)
    if field > 1:
      assert 0 < blank.mean() < 1, (field, blank.mean())


@needs_mnist
def test_side_by_side_pairs_leave_far_more_blank_fields_than_stacked():
  """The reason side by side is harder: Su's trunk (14x14
  windows at stride 2) sees blank windows between the digits."""
  test = load_dataset('mnist', data_dir=MNIST_DIR, validation_size=0).test
  per_layout = {}
  for layout in ('stacked', 'side_by_side'):
    pairs = digit_pairs(test.images[:2000], test.labels[:2000], 0, layout)
    blank = blank_fields(pairs['image'])
    assert blank.shape[1:] == ((22, 8) if layout == 'stacked' else (8, 22))
    per_layout[layout] = blank.reshape(len(blank), -1)
  stacked, side = per_layout['stacked'], per_layout['side_by_side']
  assert side.sum(1).mean() > 5 * stacked.sum(1).mean()
  assert side.any(1).mean() > 0.6 > 0.3 > stacked.any(1).mean()
