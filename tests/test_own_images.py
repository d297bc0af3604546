"""Tests of training on your own images: the readers (a folder, a .npz, a TFDS
dataset), the cache, the splits, the shapes taken from the data, the memory
check, the per-class evaluator, ``predict`` and the command line.

Every image is made here (tiny PNG, JPEG and BMP folders, grey and colour,
odd sizes, truncated files); the slow test writes the Fashion-MNIST test
split of ../shared/data as a folder of PNGs and trains on it through the
folder and through the built-in reader.
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from capsjax import data as data_lib
from capsjax import figures
from capsjax import models
from capsjax import training
from capsjax.data import images
from capsjax.evaluators import confusion
from capsjax.training import memory
from capsjax.training import own_images
from capsjax.training import state as state_lib
from capsjax.training import vector_capsules
from experiments.configs import own_images as own_images_config
from tests import conftest
from tests.conftest import REPO
from tests.conftest import unit_tier_keeps

DataError = data_lib.DataError
RNG = np.random.default_rng(0)


def _save(path, array, format=None):
  """A uint8 [H, W] (grey) or [H, W, 3] array as an image file."""
  path.parent.mkdir(parents=True, exist_ok=True)
  Image.fromarray(array).save(path, format=format)
  return path


def _random(height, width, channels=3):
  shape = (height, width) if channels == 1 else (height, width, channels)
  return RNG.integers(0, 256, shape, dtype=np.uint8)


def _folder(root, classes=('a', 'b'), per_class=3, size=(12, 10), grey=False):
  """``per_class`` PNGs of ``size`` (width, height) in each class folder."""
  for name in classes:
    for i in range(per_class):
      _save(root / name / f'{i}.png',
            _random(size[1], size[0], 1 if grey else 3))
  return root


def _options(**overrides):
  return images.ImageOptions(**({'image_size': 16} | overrides))


# ----------------------------------------------------------------------------
# One image.


def test_mixed_formats_sizes_and_modes_become_one_size_and_rgb(tmp_path):
  _save(tmp_path / 'cat' / 'wide.png', _random(23, 17))
  _save(tmp_path / 'cat' / 'grey.jpg', _random(31, 40, 1), 'JPEG')
  _save(tmp_path / 'dog' / 'colour.bmp', _random(9, 30))
  palette = Image.fromarray(_random(20, 20)).convert('P')
  palette.save(tmp_path / 'dog' / 'palette.gif')
  own = images.read_folder(tmp_path, _options())
  assert own.class_names == ('cat', 'dog')
  assert own.train.images.shape == (4, 16, 16, 3)
  assert own.train.images.dtype == np.uint8
  # Files sorted within each class: cat/grey.jpg, cat/wide.png, dog/...
  np.testing.assert_array_equal(own.train.labels, [0, 0, 1, 1])
  assert own.test is None
  assert own.report['channels_note'] == (
      '1 grey images converted to RGB, as 3 are in colour')
  grey = own.train.images[0]
  np.testing.assert_array_equal(grey[..., 0], grey[..., 2])


def test_grey_data_stays_one_channel_unless_asked(tmp_path):
  _folder(tmp_path, grey=True)
  assert images.read_folder(tmp_path, _options()).train.images.shape[-1] == 1
  rgb = images.read_folder(tmp_path, _options(channels=3))
  assert rgb.train.images.shape[-1] == 3
  assert 'converted to RGB' in rgb.report['channels_note']


def test_colour_to_grey_is_pillows_conversion():
  rgb = _random(7, 5)[None]
  expected = np.asarray(Image.fromarray(rgb[0]).convert('L'))
  np.testing.assert_array_equal(images.to_grey(rgb)[0, ..., 0], expected)


def test_an_image_of_the_target_size_is_kept_pixel_for_pixel(tmp_path):
  array = _random(16, 16)
  path = _save(tmp_path / 'x.png', array)
  decoded, grey, size, _ = images.decode_image(path, 16, 'center_crop')
  np.testing.assert_array_equal(decoded, array)
  assert not grey and size == (16, 16)


def test_center_crop_keeps_the_central_square_and_stretch_all():
  # 20 wide, 10 high: the central square is columns 5 .. 14.
  array = np.tile(np.arange(20, dtype=np.uint8) * 10, (10, 1))
  image = Image.fromarray(array)
  cropped = np.asarray(images.fit_image(image, 10, 'center_crop'))
  np.testing.assert_array_equal(cropped, array[:, 5:15])
  stretched = np.asarray(images.fit_image(image, 10, 'stretch'))
  assert stretched.shape == (10, 10)
  assert stretched[0, 0] < 20 and stretched[0, -1] > 170  # both ends kept


def test_sixteen_bit_grey_is_scaled_to_eight_bits(tmp_path):
  array = np.full((16, 16), 65535, np.uint16)
  array[:, :8] = 257 * 100
  path = tmp_path / 'deep.png'
  Image.fromarray(array).save(path)
  decoded, grey, _, _ = images.decode_image(path, 16, 'center_crop')
  assert grey
  assert decoded[0, 0, 0] == 100 and decoded[0, -1, 0] == 255


def _strokes_rgba(size=16):
  """Black strokes drawn in the alpha channel alone: RGB zero everywhere."""
  rgba = np.zeros((size, size, 4), np.uint8)
  rgba[4:12, 7:9, 3] = 255  # a vertical bar
  rgba[4:12, 6, 3] = 128  # its soft edge
  return rgba


def test_a_shape_in_the_alpha_channel_is_composited_onto_white(tmp_path):
  path = tmp_path / 'stroke.png'
  Image.fromarray(_strokes_rgba(), 'RGBA').save(path)
  decoded = images.decode_image(path, 16, 'center_crop')
  assert decoded.shape_in_alpha and not decoded.grey
  # Transparent -> white, opaque black -> black, half -> grey.
  assert (decoded.array[0, 0] == 255).all()
  assert (decoded.array[6, 7] == 0).all()
  assert (decoded.array[6, 6] == 127).all()
  grey = Image.fromarray(_strokes_rgba()[..., 3], 'L').convert('LA')
  grey.putalpha(Image.fromarray(_strokes_rgba()[..., 3]))
  grey.save(tmp_path / 'grey_alpha.png')
  decoded = images.decode_image(tmp_path / 'grey_alpha.png', 16,
                                'center_crop')
  assert decoded.grey and decoded.array[0, 0, 0] == 255


def test_a_coloured_transparent_image_is_not_warned_about(tmp_path):
  rgba = np.zeros((16, 16, 4), np.uint8)
  rgba[4:12, 4:12, :3] = _random(8, 8)  # colour where visible
  rgba[4:12, 4:12, 3] = 255
  path = tmp_path / 'icon.png'
  Image.fromarray(rgba, 'RGBA').save(path)
  decoded = images.decode_image(path, 16, 'center_crop')
  assert not decoded.shape_in_alpha
  np.testing.assert_array_equal(decoded.array[4:12, 4:12], rgba[4:12, 4:12,
                                                                :3])
  assert (decoded.array[0, 0] == 255).all()
  # An opaque RGBA file decodes as its RGB did.
  rgba[..., 3] = 255
  Image.fromarray(rgba, 'RGBA').save(path)
  decoded = images.decode_image(path, 16, 'center_crop')
  np.testing.assert_array_equal(decoded.array, rgba[..., :3])


def test_the_report_warns_about_shapes_in_the_alpha_channel(tmp_path):
  _folder(tmp_path)
  Image.fromarray(_strokes_rgba(), 'RGBA').save(tmp_path / 'a' / 'x.png')
  own = images.read_folder(tmp_path, _options())
  assert own.report['alpha_files'] == 1
  warning = [line for line in images.report_lines(own.report)
             if line.startswith('Warning:')]
  assert len(warning) == 1 and 'alpha channel' in warning[0]
  assert str(tmp_path / 'a' / 'x.png') in warning[0]
  assert 'composited onto white' in warning[0]


# ----------------------------------------------------------------------------
# Folders: layouts and bad input.


def test_train_and_test_folders(tmp_path):
  _folder(tmp_path / 'train', classes=('a', 'b', 'c'))
  _folder(tmp_path / 'test', classes=('a', 'c'), per_class=2)
  own = images.read_folder(tmp_path, _options())
  assert own.class_names == ('a', 'b', 'c')
  assert len(own.train.labels) == 9
  # The test folder lacks class b: its labels keep the training indices.
  np.testing.assert_array_equal(own.test.labels, [0, 0, 2, 2])
  assert own.report['layout'] == 'train/ and test/'


@pytest.mark.parametrize('name', ['val', 'valid', 'validation', 'Val'])
def test_a_validation_folder_is_the_validation_split(tmp_path, name):
  _folder(tmp_path / 'train', classes=('a', 'b'), per_class=6)
  _folder(tmp_path / name, classes=('b', 'a'), per_class=2)
  own = images.read_folder(tmp_path, _options())
  np.testing.assert_array_equal(own.validation.labels, [0, 0, 1, 1])
  assert own.report['layout'] == f'train/ and {name}/'
  dataset = images.to_dataset(own, test_fraction=0.5,
                              validation_fraction=0.1, seed=0, name='x')
  # Validation is the folder; only the test split is held out of train/.
  assert [len(s.labels) for s in (dataset.train, dataset.validation,
                                  dataset.test)] == [6, 4, 6]
  config = own_images_config.get_config('smoke')
  config.test_fraction = 0.5
  line = own_images.splits_line(config, dataset, own)
  assert line == (f'Splits: 6 train, 4 validation (the folder {name}/), 6 '
                  f'test (held out of the 12 training images: '
                  f'config.test_fraction=0.5, by config.split_seed).')


def test_validation_carved_from_train_is_said_with_its_count(tmp_path):
  _folder(tmp_path / 'train', classes=('a', 'b'), per_class=10)
  _folder(tmp_path / 'test', classes=('a', 'b'), per_class=2)
  own = images.read_folder(tmp_path, _options())
  assert own.validation is None
  dataset = images.to_dataset(own, test_fraction=0.2,
                              validation_fraction=0.2, seed=0, name='x')
  config = own_images_config.get_config('smoke')
  config.validation_fraction = 0.2
  assert own_images.splits_line(config, dataset, own) == (
      'Splits: 16 train, 4 validation (carved from the 20 training images: '
      'config.validation_fraction=0.2, by config.split_seed), 4 test (the '
      'folder test/).')


def test_two_validation_folders_are_refused(tmp_path):
  _folder(tmp_path / 'train')
  _folder(tmp_path / 'val')
  _folder(tmp_path / 'validation')
  with pytest.raises(DataError, match=r'val/ and validation/ are both'):
    images.read_folder(tmp_path, _options())


def test_a_validation_folder_is_cached_with_the_other_splits(tmp_path):
  _folder(tmp_path / 'data' / 'train', per_class=4)
  _folder(tmp_path / 'data' / 'valid', per_class=1)
  say = lambda _: None  # noqa: E731
  first = images.read_cached(str(tmp_path / 'data'), _options(),
                             tmp_path / 'cache', say=say)
  again = images.read_cached(str(tmp_path / 'data'), _options(),
                             tmp_path / 'cache', say=say)
  assert again.report['cached']
  np.testing.assert_array_equal(again.validation.images,
                                first.validation.images)


def test_few_images_of_a_class_are_warned_about_and_counted():
  labels = np.array([0] * 8 + [1] * 3 + [2], np.int32)
  split = data_lib.Split(np.zeros((len(labels), 8, 8, 1), np.uint8), labels)
  test = data_lib.Split(split.images[:3], np.array([0, 0, 1], np.int32))
  validation = data_lib.Split(split.images[:1], labels[:1])
  dataset = data_lib.Dataset(split, validation, test, 3, 'x')
  lines = own_images.class_count_lines(dataset, ('many', 'few', 'lone'))
  assert lines[:4] == ['Images per class (train / validation / test):',
                       '  many  8 / 1 / 2', '  few   3 / 0 / 1',
                       '  lone  1 / 0 / 0']
  assert lines[4:] == [
      f'Warning: class few has 4 images (fewer than {own_images.FEW_IMAGES}):'
      f' 3 train, 0 validation, 1 test; too few to learn it from. Add images '
      f'or remove the class.',
      f'Warning: class lone has 1 image (fewer than '
      f'{own_images.FEW_IMAGES}): 1 train, 0 validation, 0 test; too few to '
      f'learn it from. It is never tested (no test images). Add images or '
      f'remove the class.']


def test_a_test_class_unknown_to_training_is_named(tmp_path):
  _folder(tmp_path / 'train')
  _folder(tmp_path / 'test', classes=('a', 'zebra'))
  with pytest.raises(DataError, match=r'test/zebra: a test class that is not'):
    images.read_folder(tmp_path, _options())


def test_non_images_and_hidden_files_are_ignored_and_counted(tmp_path):
  _folder(tmp_path)
  (tmp_path / 'a' / 'notes.txt').write_text('not an image')
  (tmp_path / 'a' / '.DS_Store').write_bytes(b'\0')
  (tmp_path / '.ipynb_checkpoints').mkdir()  # not a class
  (tmp_path / 'README.md').write_text('outside the class folders')
  own = images.read_folder(tmp_path, _options())
  assert own.class_names == ('a', 'b')
  assert own.report['ignored_files'] == 2
  assert any('notes.txt' in line or 'README' in line
             for line in images.report_lines(own.report))


@pytest.mark.parametrize('layout, message', [
    ('empty', r'no class subfolders \(it is empty\)'),
    ('flat', r'3 images but no class subfolders'),
    ('one_class', r'only one class folder \(a\)'),
    ('empty_class', r'/b: no images .*1 other files, e\.g\. x\.txt'),
    ('missing', r'no such folder or file'),
])
def test_bad_folders_are_one_line_naming_the_folder(tmp_path, layout,
                                                    message):
  root = tmp_path / 'data'
  root.mkdir()
  if layout == 'flat':
    for i in range(3):
      _save(root / f'{i}.png', _random(8, 8))
  elif layout == 'one_class':
    _folder(root, classes=('a',))
  elif layout == 'empty_class':
    _folder(root, classes=('a',))
    (root / 'b').mkdir()
    (root / 'b' / 'x.txt').write_text('x')
  elif layout == 'missing':
    root = tmp_path / 'nowhere'
  with pytest.raises(DataError, match=message) as error:
    images.read_images(str(root), _options())
  assert '\n' not in str(error.value)
  assert str(root) in str(error.value)


@pytest.mark.parametrize('suffix', ['png', 'jpg'])
def test_a_truncated_image_is_named_or_skipped_and_counted(tmp_path, suffix):
  _folder(tmp_path, per_class=3, size=(40, 40))
  bad = _save(tmp_path / 'b' / f'broken.{suffix}', _random(40, 40))
  bad.write_bytes(bad.read_bytes()[:len(bad.read_bytes()) // 3])
  with pytest.raises(DataError, match=rf'broken\.{suffix}: cannot decode '
                     r'.*skip_bad_images=True'):
    images.read_folder(tmp_path, _options())
  own = images.read_folder(tmp_path, _options(skip_bad_images=True))
  assert len(own.train.labels) == 6
  assert own.report['bad_files'] == 1
  assert own.report['bad_messages'][0].startswith(f'{bad}: cannot decode')


def _labelled(root, classes, per_class):
  """16x16 grey PNGs whose value says their class and number."""
  for k, name in enumerate(classes):
    for i in range(per_class):
      _save(root / name / f'{i}.png', np.full((16, 16), 50 * k + i, np.uint8))


def _corrupt(path):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(b'\x89PNG\r\n\x1a\n not the rest of a PNG')
  return path


def test_every_bad_file_of_every_split_is_named_and_labels_stay(tmp_path):
  _labelled(tmp_path / 'train', ('a', 'b', 'c'), per_class=5)
  _labelled(tmp_path / 'val', ('a', 'b', 'c'), per_class=2)
  _labelled(tmp_path / 'test', ('a', 'b', 'c'), per_class=2)
  # In the middle of class b (sorted: 0, 1, 2, 2x, 3, 4), and one in each
  # of the other splits.
  bad = [_corrupt(tmp_path / 'train' / 'b' / '2x.png'),
         _corrupt(tmp_path / 'val' / 'c' / '0x.png'),
         _corrupt(tmp_path / 'test' / 'a' / '1x.png')]
  with pytest.raises(DataError) as error:
    images.read_folder(tmp_path, _options())
  lines = str(error.value).splitlines()
  assert lines[0].startswith('3 files cannot be decoded; replace or remove '
                             'them, or set --config.skip_bad_images=True')
  assert [line.split(': ')[0].strip() for line in lines[1:]] == list(
      map(str, bad))
  own = images.read_folder(tmp_path, _options(skip_bad_images=True))
  # Each image's value (50 * class + number) agrees with its label.
  for split, per_class in ((own.train, 5), (own.validation, 2),
                           (own.test, 2)):
    assert len(split.labels) == 3 * per_class
    values = split.images[:, 0, 0, 0].astype(int)
    np.testing.assert_array_equal(values // 50, split.labels)
    np.testing.assert_array_equal(values % 50, np.tile(np.arange(per_class),
                                                       3))
  report = own.report
  assert report['bad_files'] == 3 and report['num_files'] == 30
  assert report['num_decoded'] == 27
  lines = images.report_lines(report)
  assert lines[0].startswith('Decoded 27 images in ')
  assert lines[1] == 'Skipped 3 files that could not be decoded:'
  assert [line.split(': ')[0].strip() for line in lines[2:5]] == list(
      map(str, bad))


def test_a_class_left_without_decodable_images_is_an_error(tmp_path):
  _folder(tmp_path, classes=('a',))
  (tmp_path / 'b').mkdir()
  (tmp_path / 'b' / 'fake.png').write_bytes(b'not a png at all')
  with pytest.raises(DataError, match=r'/b: none of its images'):
    images.read_folder(tmp_path, _options(skip_bad_images=True))


def test_a_file_that_is_not_a_folder_or_npz(tmp_path):
  path = _save(tmp_path / 'one.png', _random(8, 8))
  with pytest.raises(DataError, match=r'one\.png: a file, not a folder'):
    images.read_images(str(path))


def test_bad_options_name_the_config_key():
  with pytest.raises(ValueError, match='config.image_size'):
    images.check_options(images.ImageOptions(image_size=4))
  with pytest.raises(ValueError, match='config.channels'):
    images.check_options(images.ImageOptions(channels=2))
  with pytest.raises(ValueError, match='config.resize_mode'):
    images.check_options(images.ImageOptions(resize_mode='pad'))


# ----------------------------------------------------------------------------
# .npz files.


def _npz(path, **arrays):
  np.savez(path, **arrays)
  return path


def test_npz_with_float_images_and_class_names(tmp_path):
  x = RNG.random((6, 20, 12)).astype(np.float32)
  path = _npz(tmp_path / 'd.npz', x_train=x, y_train=np.array([0, 1, 2] * 2),
              x_test=(x[:2] * 255).astype(np.uint8), y_test=np.array([2, 0]),
              class_names=np.array(['ant', 'bee', 'cow']))
  own = images.read_images(str(path), _options(resize_mode='stretch'))
  assert own.class_names == ('ant', 'bee', 'cow')
  assert own.train.images.shape == (6, 16, 16, 1)
  assert own.test.images.shape == (2, 16, 16, 1)
  expected = images.fit_image(Image.fromarray(np.rint(x[0] * 255).astype(
      np.uint8)), 16, 'stretch')
  np.testing.assert_array_equal(own.train.images[0, ..., 0], expected)


def test_npz_without_names_counts_the_classes_and_drops_alpha(tmp_path):
  x = _random(16, 16, 4)[None].repeat(3, axis=0)
  own = images.read_npz(_npz(tmp_path / 'd.npz', x_train=x,
                             y_train=np.array([0, 3, 1])), _options())
  assert own.class_names == ('0', '1', '2', '3')
  np.testing.assert_array_equal(own.train.images, x[..., :3])


@pytest.mark.parametrize('arrays, message', [
    (dict(x_train=np.zeros((3, 8, 8), np.uint8), y_train=np.array([0, 1, 5]),
          class_names=np.array(['a', 'b'])),
     r'y_train holds label 5, out of range for the 2 class_names'),
    (dict(x_train=np.zeros((3, 8, 8), np.uint8), y_train=np.array([0, -1, 1])),
     r'y_train holds the negative label -1'),
    (dict(x_train=np.zeros((3, 8, 8), np.uint8), y_train=np.array([0, 1])),
     r'y_train has 2 labels for the 3 images of x_train'),
    (dict(x_train=np.zeros((2, 8, 8), np.uint8), y_train=np.array([0, 1]),
          x_test=np.zeros((2, 8, 8), np.uint8)),
     r'x_test and y_test come together'),
    (dict(images=np.zeros((2, 8, 8), np.uint8)), r'no x_train or y_train'),
    (dict(x_train=np.zeros((2, 8, 8), np.uint8), y_train=np.eye(2)),
     r'y_train must be integer class indices'),
    (dict(x_train=np.full((2, 8, 8), 300.0), y_train=np.array([0, 1])),
     r'x_train values run from 300 to 300'),
    (dict(x_train=np.zeros((2, 8, 8), np.uint8), y_train=np.array([0, 0])),
     r'one class only'),
])
def test_bad_npz_is_one_line_naming_the_file(tmp_path, arrays, message):
  path = _npz(tmp_path / 'bad.npz', **arrays)
  with pytest.raises(DataError, match=message) as error:
    images.read_npz(path, _options())
  assert str(error.value).startswith(str(path)) and '\n' not in str(
      error.value)


def test_a_corrupt_npz_is_named(tmp_path):
  path = tmp_path / 'broken.npz'
  path.write_bytes(b'PK\x03\x04 not really a zip')
  with pytest.raises(DataError, match=r'broken\.npz: not a readable \.npz'):
    images.read_images(str(path), _options())


# ----------------------------------------------------------------------------
# TensorFlow Datasets (a stand-in module with the API the reader uses).


def _fake_tfds(tmp_path, features, splits, supervised=None):
  class Image_:
    pass

  class ClassLabel:
    def __init__(self, names):
      self.names = names

  class Text:
    pass

  kinds = {'image': Image_, 'text': Text}
  built = {k: ClassLabel(v[1]) if v[0] == 'label' else kinds[v[0]]()
           for k, v in features.items()}

  class Builder:
    data_dir = str(tmp_path)
    info = types.SimpleNamespace(
        features=built, supervised_keys=supervised,
        splits={s: types.SimpleNamespace(num_examples=len(rows))
                for s, rows in splits.items()})

    def as_dataset(self, split, shuffle_files):
      assert not shuffle_files
      return splits[split]

  def builder(name, data_dir=None):
    if name != 'known':
      raise ValueError(f'Dataset {name} not found.')
    return Builder()

  return types.SimpleNamespace(
      builder=builder, as_numpy=iter,
      features=types.SimpleNamespace(Image=Image_, ClassLabel=ClassLabel))


def _rows(n, shape=(10, 12, 3)):
  return [{'picture': _random(*shape[:2], shape[2]), 'kind': k % 2,
           'caption': b'x'} for k in range(n)]


def test_tfds_dataset_by_name(tmp_path, monkeypatch):
  fake = _fake_tfds(tmp_path, {'picture': ('image',),
                               'kind': ('label', ['cat', 'dog']),
                               'caption': ('text',)},
                    {'train': _rows(4), 'test': _rows(2)})
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', fake)
  own = images.read_images('tfds:known', _options())
  assert own.class_names == ('cat', 'dog')
  assert own.train.images.shape == (4, 16, 16, 3)
  np.testing.assert_array_equal(own.test.labels, [0, 1])


def test_tfds_errors(tmp_path, monkeypatch):
  fake = _fake_tfds(tmp_path, {'caption': ('text',),
                               'kind': ('label', ['a', 'b'])},
                    {'train': _rows(2)})
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', fake)
  with pytest.raises(DataError, match=r'tfds:nothing: no such TensorFlow '
                     r'Datasets dataset \(Dataset nothing not found\.\)'):
    images.read_images('tfds:nothing')
  with pytest.raises(DataError, match=r'tfds:known: no image feature \(its '
                     r'features: caption \(Text\), kind \(ClassLabel\)\)'):
    images.read_images('tfds:known')
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)
  with pytest.raises(DataError, match='needs tensorflow-datasets'):
    images.read_images('tfds:known')


# ----------------------------------------------------------------------------
# Splits and the cache.


def test_stratified_split_is_seeded_and_per_class():
  labels = np.repeat(np.arange(4), [10, 20, 1, 5])
  kept, held = images.stratified_split(labels, 0.2, seed=3)
  assert sorted(np.concatenate([kept, held])) == list(range(len(labels)))
  np.testing.assert_array_equal(np.bincount(labels[held], minlength=4),
                                [2, 4, 0, 1])  # a lone image stays
  again = images.stratified_split(labels, 0.2, seed=3)
  np.testing.assert_array_equal(again[1], held)
  assert not np.array_equal(images.stratified_split(labels, 0.2, 4)[1], held)


def test_to_dataset_holds_out_test_only_without_a_test_split():
  train = data_lib.Split(np.zeros((40, 8, 8, 1), np.uint8),
                         np.repeat(np.arange(2), 20).astype(np.int32))
  own = images.OwnImages(train, None, ('a', 'b'), {})
  dataset = images.to_dataset(own, test_fraction=0.25,
                              validation_fraction=0.1, seed=0, name='x')
  sizes = [len(s.labels) for s in (dataset.train, dataset.validation,
                                   dataset.test)]
  assert sizes == [26, 4, 10] and dataset.num_classes == 2
  given = own._replace(test=data_lib.Split(train.images[:3], train.labels[:3]))
  with_test = images.to_dataset(given, test_fraction=0.25,
                                validation_fraction=0.1, seed=0, name='x')
  assert len(with_test.test.labels) == 3 and len(with_test.train.labels) == 36


def test_the_cache_decodes_once_and_follows_changes(tmp_path, monkeypatch):
  root = _folder(tmp_path / 'data')
  cache = tmp_path / 'cache'
  first = images.read_cached(str(root), _options(), cache, say=lambda _: None)
  assert not first.report['cached']
  entries = os.listdir(cache)
  assert len(entries) == 1

  def no_decoding(*args):
    raise AssertionError('decoded again')

  with monkeypatch.context() as patch:
    patch.setattr(images, 'decode_image', no_decoding)
    second = images.read_cached(str(root), _options(), cache,
                                say=lambda _: None)
  assert second.report['cached']
  np.testing.assert_array_equal(second.train.images, first.train.images)
  assert second.class_names == first.class_names
  # A new file, or other options, is a new entry.
  _save(root / 'b' / 'new.png', _random(12, 10))
  third = images.read_cached(str(root), _options(), cache, say=lambda _: None)
  assert not third.report['cached'] and len(third.train.labels) == 7
  images.read_cached(str(root), _options(image_size=8), cache,
                     say=lambda _: None)
  assert len(os.listdir(cache)) == 3
  # A damaged entry is decoded again, not trusted.
  entry = cache / sorted(os.listdir(cache))[0]
  (entry / 'meta.json').write_text('{')
  assert images._load_entry(entry, 'any') is None


def test_a_workdir_inside_the_images_folder_is_refused(tmp_path):
  root = _folder(tmp_path / 'data')
  with pytest.raises(DataError, match=r'inside the images folder .*outside'):
    images.read_cached(str(root), _options(), root / 'run' / 'image_cache',
                       say=lambda _: None)
  assert sorted(os.listdir(root)) == ['a', 'b']


def test_a_failed_decode_writes_no_cache(tmp_path):
  root = _folder(tmp_path / 'data')
  (root / 'a' / 'bad.png').write_bytes(b'\x89PNG truncated')
  with pytest.raises(DataError, match='bad.png'):
    images.read_cached(str(root), _options(), tmp_path / 'cache',
                       say=lambda _: None)
  assert not (tmp_path / 'cache').exists()


# ----------------------------------------------------------------------------
# Shapes from the data, the model's size and memory.


def _small_config(variant, images_dir, **overrides):
  config = own_images_config.get_config(variant)
  config.images = str(images_dir)
  config.image_size = 24
  config.update(overrides)
  return config


def _dataset(shape=(24, 24, 3), num_classes=3, per_class=8):
  labels = np.repeat(np.arange(num_classes), per_class).astype(np.int32)
  split = data_lib.Split(RNG.integers(0, 256, (len(labels), *shape),
                                      dtype=np.uint8), labels)
  return data_lib.Dataset(split, split, split, num_classes, 'own_images:x')


@pytest.mark.parametrize('variant, key', [
    ('smoke', 'input_shape'), ('su,smoke', 'input_channels'),
    ('em,smoke', 'input_shape')])
def test_every_family_takes_its_shapes_from_the_data(variant, key):
  side = 24
  dataset = _dataset((side, side, 1))
  config = with_shapes = own_images.with_data_shapes(
      _small_config(variant, '/x'), dataset, ('a', 'b', 'c'),
      say=lambda _: None)
  assert with_shapes.model_options.num_classes == 3
  expected = (side, side, 1) if key == 'input_shape' else 1
  assert with_shapes.model_options[key] == expected
  assert with_shapes.class_names == ('a', 'b', 'c')
  # Fewer training images than the batch: one batch of all of them.
  assert with_shapes.batch_size == 24
  model = nnx.eval_shape(lambda: state_lib.create_model(config))
  graphdef, state = nnx.split(model)
  out = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state,
                       jnp.zeros((2, side, side, 1)))
  assert out['class_scores'].shape == (2, 3)


def test_model_size_counts_what_the_model_holds():
  dataset = _dataset()
  config = own_images.with_data_shapes(
      _small_config('smoke', '/x', batch_size=8), dataset, ('a', 'b', 'c'),
      say=lambda _: None)
  optimizer = state_lib.make_optimizer(config)
  steps = vector_capsules.make_steps(config, optimizer)
  size = own_images.model_size(config, steps, optimizer, dataset)
  model = state_lib.create_model(config)
  assert size.num_params == models.count_params(model)
  # 24x24 -> Conv1 9x9: 16x16 -> primary 9x9 stride 2: 4x4, 8 types.
  assert model.digit.weights.shape[:2] == (128, 3)
  assert size.capsules == ('128 primary capsules, 384 votes (16-D) per '
                           'image')
  params = sum(x.size * 4 for x in jax.tree.leaves(nnx.state(model,
                                                             nnx.Param)))
  assert size.state_bytes >= 3 * params  # parameters, Adam's mu and nu
  assert size.train_bytes > size.state_bytes
  assert size.data_bytes == 3 * dataset.train.images.nbytes + 3 * 24 * 4


def test_em_capsule_counts_follow_the_grids():
  config = own_images.with_data_shapes(
      _small_config('em,smoke', '/x'), _dataset((24, 24, 1)),
      ('a', 'b', 'c'), say=lambda _: None)
  model = nnx.eval_shape(lambda: state_lib.create_model(config))
  # 24 -> Conv1 5x5/2: 10 -> ConvCaps1 3x3/2: 4 -> ConvCaps2 3x3/1: 2.
  assert model.grid_sizes == ((10, 4, 2), (10, 4, 2))
  votes = 4 * 4 * 9 * 4 * 8 + 2 * 2 * 9 * 8 * 8 + 2 * 2 * 8 * 3
  assert own_images.capsule_counts(model, (24, 24, 1)) == (
      f'400 primary capsules (4x4 poses), {votes:,} votes (4x4) per image')


def test_peak_live_bytes_counts_what_is_held_at_once():
  def f(x):
    y = x * 2.0  # 4 kB, live until the last line
    z = jnp.sin(x)  # 4 kB
    return jnp.sum(y * z)

  jaxpr = jax.make_jaxpr(f)(jnp.zeros(1000))
  # y, z and y * z live together: 12 kB (the scalar: 4 bytes).
  assert memory.peak_live_bytes(jaxpr.jaxpr) == 12_000
  assert memory.format_bytes(26e9) == '26.0 GB'


def test_the_estimate_is_near_what_xla_compiles_the_step_to():
  """Within 0.8-2.5x of XLA's figure: it stops runs, and an overestimate
  refuses good ones (0.85-1.63x over the families' configs:
  results/own_images/memory_estimate.log)."""
  dataset = _dataset()
  config = own_images.with_data_shapes(
      _small_config('smoke', '/x', batch_size=16), dataset, ('a', 'b', 'c'),
      say=lambda _: None)
  optimizer = state_lib.make_optimizer(config)
  steps = vector_capsules.make_steps(config, optimizer)
  size = own_images.model_size(config, steps, optimizer, dataset)
  graphdef, state = state_lib.init_train_state(state_lib.create_model(config),
                                               optimizer)
  compiled = jax.jit(lambda s, x, y, k: steps.train_step(graphdef, s, x, y, k),
                     donate_argnums=0).lower(
      state, dataset.train.images[:16], dataset.train.labels[:16],
      jax.random.PRNGKey(0)).compile()
  analysis = compiled.memory_analysis()
  xla = analysis.argument_size_in_bytes + analysis.temp_size_in_bytes
  assert 0.8 * xla <= size.train_bytes <= 2.5 * xla, (xla, size.train_bytes)


def test_check_memory_refuses_warns_or_stays_quiet():
  config = own_images_config.get_config('smoke')
  config.class_names, config.image_size = ('a', 'b'), 32
  config.model_options.input_shape = (32, 32, 3)
  size = own_images.ModelSize(1, '', 10, 60, 20, 30, 1, True)
  said = []

  def check(available, **overrides):
    config.update(overrides)
    own_images.check_memory(config, size, available, lambda: ['--x'],
                            said.append)

  check(1000)
  assert not said
  check(100)  # 90 of 100 bytes
  assert said == ['Warning: that is close to the free memory; if the run is '
                  'killed for memory, lower one of --x.']
  with pytest.raises(own_images.ModelTooLarge, match='lower one of --x; or'):
    check(80)
  check(80, memory_check=False)
  check(None, memory_check=True)  # unknown: nothing to compare


def test_a_run_too_large_for_the_memory_stops_first_in_one_line(tmp_path):
  root = _folder(tmp_path / 'data', classes=('a', 'b'), per_class=6,
                 size=(30, 30))
  workdir = tmp_path / 'work'
  config = _small_config('smoke', root, image_size=48, memory_limit_gb=0.03)
  lines = []
  with pytest.raises(own_images.ModelTooLarge) as error:
    own_images.train_and_evaluate(config, str(workdir), vector_capsules,
                                  say=lines.append)
  message = str(error.value)
  assert '\n' not in message
  assert re.search(r'needs about [\d.]+ MB .* but 30\.0 MB is available; '
                   r'lower one of --config\.image_size \(32 fits: about '
                   r'[\d.]+ MB\), --config\.batch_size \(\d fits\), .*'
                   r'--config\.model_options\.primary_types', message), message
  assert any(line.startswith('Model capsnet: ') for line in lines)
  # Nothing of a run was written: only the decoded images' cache.
  assert sorted(os.listdir(workdir)) == ['image_cache']


# ----------------------------------------------------------------------------
# Training, the per-class evaluator and predict.


def test_confusion_matrix_and_per_class_accuracy():
  labels = np.array([0, 0, 1, 1, 1, 2])
  predictions = np.array([0, 1, 1, 1, 0, 2])
  matrix = confusion.confusion_matrix(labels, predictions, 4)
  expected = np.zeros((4, 4), int)
  for t, p in zip(labels, predictions, strict=True):
    expected[t, p] += 1
  np.testing.assert_array_equal(matrix, expected)
  accuracies = confusion.per_class_accuracy(matrix)
  np.testing.assert_allclose(accuracies[:3], [0.5, 2 / 3, 1.0])
  assert np.isnan(accuracies[3])  # no examples of class 3


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A tiny CapsNet trained a few steps on a folder of colour images."""
  root = tmp_path_factory.mktemp('own')
  data = root / 'data'
  for k, name in enumerate(('apple', 'kiwi', 'plum')):
    for i in range(10):
      image = np.full((20 + i, 18, 3), 40 * k, np.uint8)
      image[::2, :, k] = 250
      _save(data / name / f'{i}.png', image)
  (data / 'kiwi' / 'list.csv').write_text('a,b')
  config = _small_config('smoke', data, image_size=20, batch_size=8,
                         num_train_steps=4, eval_every_steps=2,
                         checkpoint_every_steps=2, log_every_steps=2)
  config.model_options.conv1_channels = 8
  config.model_options.primary_types = 2
  config.model_options.decoder_widths = (16, 16)
  workdir = root / 'work'
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    summary = training.train(config, str(workdir))
  return data, workdir, summary, printed.getvalue().splitlines()


def test_a_run_reports_per_class_accuracy_with_the_class_names(trained):
  _, workdir, summary, _ = trained
  per_class = summary['evals']['per_class']
  assert per_class['class_names'] == ['apple', 'kiwi', 'plum']
  assert list(per_class['per_class_accuracy']) == ['apple', 'kiwi', 'plum']
  # The evaluator counts what fit tested: the same accuracy.
  assert per_class['accuracy'] == pytest.approx(summary['test']['accuracy'])
  assert np.sum(per_class['confusion']) == per_class['num_examples'] == 6
  assert os.path.exists(per_class['figure'])
  _, _, _, printed = trained
  start = printed.index('Images per class (train / validation / test):')
  assert printed[start - 1] == (
      'Splits: 21 train, 3 validation (carved from the 24 training images: '
      'config.validation_fraction=0.1, by config.split_seed), 6 test (held '
      'out of the 30 training images: config.test_fraction=0.2, by '
      'config.split_seed).')
  assert printed[start + 1:start + 4] == [
      '  apple  7 / 1 / 2', '  kiwi   7 / 1 / 2', '  plum   7 / 1 / 2']
  assert not [line for line in printed if line.startswith('Warning')]
  saved = json.load(open(workdir / 'config.json'))
  assert saved['class_names'] == ['apple', 'kiwi', 'plum']
  assert saved['model_options']['input_shape'] == [20, 20, 3]
  classes = json.load(open(workdir / 'classes.json'))
  assert classes['class_names'] == ['apple', 'kiwi', 'plum']
  assert classes['source_report']['ignored_files'] == 1


def test_predict_from_python_names_each_files_class(trained, tmp_path):
  data, workdir, _, _ = trained
  context = training.load_context(str(workdir))
  odd = _save(tmp_path / 'odd_size.jpg', _random(50, 33), 'JPEG')
  (tmp_path / 'readme.txt').write_text('ignored')
  said = []
  predictions = training.predict(context, [data / 'plum' / '3.png', tmp_path],
                                 say=said.append)
  assert [p.path for p in predictions] == [str(data / 'plum' / '3.png'),
                                           str(odd)]
  assert said == ['Ignored 1 files that are not images.']
  for p in predictions:
    assert p.class_name == ('apple', 'kiwi', 'plum')[p.class_index]
    assert p.score == pytest.approx(float(np.max(p.scores)))
    assert 0 <= p.score <= 1  # a capsule length
  # The same decoding as training: the cached image gives the same scores.
  dataset = context.dataset
  cached = own_images.load_own_images(context.config, str(workdir),
                                      say=lambda _: None)[1]
  index = [i for i, label in enumerate(cached.train.labels) if label == 2][3]
  scores = confusion.predict_scores(context, cached.train.images[index:
                                                                 index + 1])
  np.testing.assert_allclose(predictions[0].scores, scores[0], rtol=1e-5)
  assert len(dataset.test.labels) == 6


def _command(workdir, *flags, full_speed=False):
  return subprocess.run(
      [sys.executable, '-m', 'experiments.own_images',
       f'--workdir={workdir}', *flags], cwd=REPO, capture_output=True,
      text=True, timeout=300, env=conftest.training_env(full_speed))


def test_predict_from_the_command_line_skips_each_unreadable_file(
    trained, tmp_path):
  """One line per image read (folders and files), one 'skipped' line per
  file that cannot be read."""
  data, workdir, _, _ = trained
  bad = _corrupt(tmp_path / 'new' / 'broken.png')
  missing = tmp_path / 'not_there.png'
  out = _command(workdir, f'--predict={data / "apple"}',
                 f'--predict={data / "kiwi" / "0.png"}', f'--predict={bad}',
                 f'--predict={missing}')
  assert out.returncode == 0, out.stderr
  lines = out.stdout.strip().splitlines()
  assert lines[0] == '# file\tclass\tcapsule length'
  assert len(lines) == 1 + 11
  for line in lines[1:]:
    path, name, length = line.split('\t')
    assert os.path.exists(path) and name in ('apple', 'kiwi', 'plum')
    assert 0 <= float(length) <= 1
  said = [line for line in out.stderr.splitlines() if 'skipped' in line]
  assert said == [f'{missing}: no such file or folder; skipped.',
                  said[1]]
  assert said[1].startswith(f'{bad}: cannot decode this image (')
  assert said[1].endswith('; skipped.')
  # The run's skip_bad_images (False) does not stop predict; nothing
  # readable is an error.
  out = _command(workdir, f'--predict={bad}', f'--predict={missing}')
  assert out.returncode == 2
  assert out.stderr.strip().splitlines()[-1].startswith(
      'error: DataError: none of the 2 image files given could be read')
  assert out.stdout == ''


def test_predict_never_creates_a_workdir(tmp_path):
  image = _save(tmp_path / 'x.png', _random(8, 8))
  workdir = tmp_path / 'never_trained'
  out = _command(workdir, f'--predict={image}')
  assert out.returncode == 2
  assert out.stderr.strip() == (
      f'error: FileNotFoundError: {workdir}: no such folder. Train a model '
      f'there first (python -m experiments.own_images --workdir={workdir} '
      f'--config=experiments/configs/own_images.py --config.images=FOLDER), '
      f'then predict with the same --workdir.')
  assert not workdir.exists()


@pytest.mark.parametrize('images_flag', unit_tier_keeps(['missing_folder', 'none'],
                                                       'missing_folder'))
def test_a_failed_start_leaves_no_lock_nor_workdir(tmp_path, images_flag):
  new, existing = tmp_path / 'new' / 'work', tmp_path / 'existing'
  existing.mkdir()
  flags = [f'--config={REPO}/experiments/configs/own_images.py:smoke']
  if images_flag == 'missing_folder':
    flags.append(f'--config.images={tmp_path / "nowhere"}')
  for workdir in (new, existing):
    out = _command(workdir, *flags)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith('error: DataError: '), out.stderr
  assert not (tmp_path / 'new').exists()
  assert os.listdir(existing) == []


def test_a_hold_removes_only_the_lock_of_a_workdir_left_empty(tmp_path):
  from capsjax.training import checkpoints
  workdir = tmp_path / 'a' / 'work'
  with checkpoints.hold_workdir(str(workdir)):
    assert (workdir / 'capsjax.lock').exists()
  assert not (tmp_path / 'a').exists()
  with checkpoints.hold_workdir(str(workdir)):
    (workdir / 'config.json').write_text('{}')
  assert (workdir / 'capsjax.lock').exists()  # a run that started: kept
  with checkpoints.hold_workdir(str(tmp_path / 'gone'), shared=True):
    pass
  assert not (tmp_path / 'gone').exists()  # a reader never creates it


def test_bad_images_on_the_command_line_are_one_line_and_no_run(tmp_path):
  _folder(tmp_path / 'data', classes=('only',))
  workdir = tmp_path / 'work'
  out = _command(workdir, f'--config={REPO}/experiments/configs/'
                 f'own_images.py:smoke', f'--config.images={tmp_path / "data"}')
  assert out.returncode == 2
  errors = [line for line in out.stderr.splitlines() if line.strip()]
  assert errors[-1] == (f'error: DataError: {tmp_path / "data"}: only one '
                        f'class folder (only); a classifier needs at least 2 '
                        f'(one subfolder per class).')
  assert 'Traceback' not in out.stderr
  assert not os.path.exists(workdir)


# ----------------------------------------------------------------------------
# The config and the README's command.


def test_variants_pick_the_family():
  models_ = {v: own_images_config.get_config(v).model
             for v in ('', 'capsnet', 'su', 'em', 'em,smoke')}
  assert models_ == {'': 'capsnet', 'capsnet': 'capsnet',
                     'su': 'two_digit_capsnet', 'em': 'matrix_capsnet',
                     'em,smoke': 'matrix_capsnet'}
  with pytest.raises(ValueError, match="unknown variant 'resnet'"):
    own_images_config.get_config('resnet')
  with pytest.raises(ValueError, match='one family'):
    own_images_config.get_config('su,em')


def readme_command() -> str:
  """The README's bash block after ``<!-- own-images-command -->``."""
  text = open(os.path.join(REPO, 'README.md')).read()
  match = re.search(r'<!-- own-images-command -->\n```bash\n(.*?)```', text,
                    re.S)
  assert match, 'README.md lacks the own-images command block'
  return match.group(1)


def test_the_readme_command_trains_the_smoke_config_on_images():
  command = readme_command()
  assert '$IMAGES' in command and '$WORKDIR' in command
  assert 'python -m experiments.own_images' in command
  spec = re.search(r'--config=(\S+)', command).group(1)
  file, variant = spec.split(':')
  assert os.path.exists(os.path.join(REPO, file))
  config = own_images_config.get_config(variant)
  assert config.max_train_seconds and config.num_train_steps <= 1000


# ----------------------------------------------------------------------------
# End to end: Fashion-MNIST's test split as a folder of PNGs, and through the
# built-in reader.


def _write_png_folder(split, names, root):
  for name in names:
    (root / name).mkdir(parents=True)
  for i, (image, label) in enumerate(zip(split.images, split.labels,
                                         strict=True)):
    Image.fromarray(image[..., 0]).save(root / names[label] / f'{i:05d}.png')
  return root


def _pixel_sums(own):
  """class name -> (images, pixel sum) over every split of a source."""
  splits = [own.train] + ([own.test] if own.test is not None else [])
  sums = {}
  for split in splits:
    for k, name in enumerate(own.class_names):
      chosen = split.images[split.labels == k]
      count, total = sums.get(name, (0, 0))
      sums[name] = (count + len(chosen),
                    total + int(chosen.astype(np.int64).sum()))
  return sums


@pytest.mark.slow
@conftest.needs_fashion_mnist
def test_fashion_mnist_as_a_folder_matches_the_built_in_reader(tmp_path):
  test = data_lib.load_dataset('fashion_mnist',
                               data_dir=conftest.FASHION_MNIST,
                               validation_size=0).test
  names = figures.CLASS_NAMES['fashion_mnist']
  folder = _write_png_folder(test, names, tmp_path / 'fashion')
  arrays = tmp_path / 'fashion_test.npz'
  np.savez(arrays, x_train=test.images, y_train=test.labels,
           class_names=np.array(names))
  # 100 steps of the smoke config on the folder (its 600 would take most of
  # CI's budget) reach 76.6% test accuracy (200 steps: 79.0%), far from
  # the 10% of labels that did not come with their images.
  workdir = tmp_path / 'folder'
  out = _command(workdir, '--config=experiments/configs/own_images.py:smoke',
                 '--config.image_size=28', '--config.num_train_steps=100',
                 '--config.eval_every_steps=100', f'--config.images={folder}',
                 full_speed=True)
  assert out.returncode == 0, out.stdout + out.stderr
  summary = json.load(open(workdir / 'summary.json'))
  sources = {}
  for source, path in (('folder', folder), ('built-in', arrays)):
    config = own_images_config.get_config('smoke')
    config.images, config.image_size = str(path), 28
    sources[source] = own_images.load_own_images(
        config, str(tmp_path / source), say=lambda _: None)[1]
  assert sources['folder'].report['cached']  # the run's cache, read back
  # The same images: per class, the same count and the same pixel sum.
  folder_sums, builtin_sums = (_pixel_sums(sources[s]) for s in
                               ('folder', 'built-in'))
  assert folder_sums == builtin_sums
  assert sum(n for n, _ in folder_sums.values()) == 10_000
  assert sources['folder'].class_names == tuple(sorted(names))
  assert sources['built-in'].class_names == names
  # The run learned from the folder: on its 2,000 held-out test images a
  # label that did not come with its image would leave chance, 10%.
  print(json.dumps(summary['test'], indent=1))
  assert summary['test']['accuracy'] > 0.6, summary['test']
