"""capsjax.data.read_images('tfds:NAME') against the real TensorFlow Datasets.

  PYTHONPATH=. python tools/tfds_own_images_check.py /tmp/tfds_data

Builds a tiny image-classification dataset (three classes, colour images of
random sizes, train and test splits, plus a text feature) and one without an
image feature with TFDS's own GeneratorBasedBuilder, prepares the first in
the given data_dir, then reads it through capsjax and shows the errors for a
name TFDS does not know, a dataset without images and a data_dir where the
dataset is not prepared.
"""

import os
import sys

import numpy as np
import tensorflow_datasets as tfds

os.environ.setdefault('CAPSJAX_NO_PROGRESS', '1')


class TinyShapes(tfds.core.GeneratorBasedBuilder):
  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self, supervised_keys=('image', 'label'),
        features=tfds.features.FeaturesDict({
            'image': tfds.features.Image(shape=(None, None, 3)),
            'label': tfds.features.ClassLabel(
                names=['circle', 'square', 'stripes']),
            'id': tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples(30, 0),
            'test': self._generate_examples(9, 1)}

  def _generate_examples(self, num, seed):
    rng = np.random.default_rng(seed)
    for i in range(num):
      height, width = rng.integers(20, 50, 2)
      image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
      yield str(i), {'image': image, 'label': i % 3, 'id': str(i)}


class NoImages(tfds.core.GeneratorBasedBuilder):
  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {'text': tfds.features.Text(),
         'label': tfds.features.ClassLabel(names=['a', 'b'])}))

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples()}

  def _generate_examples(self):
    yield '0', {'text': 'x', 'label': 0}


def main(data_dir: str) -> None:
  from capsjax.data import images
  tfds.builder('tiny_shapes', data_dir=data_dir).download_and_prepare()
  own = images.read_images('tfds:tiny_shapes', images.ImageOptions(16),
                           data_dir=data_dir)
  print('OK', own.class_names, own.train.images.shape, own.test.images.shape,
        np.bincount(own.train.labels), own.report['kind'])
  for name, where in (('tfds:no_such_dataset_xyz', data_dir),
                      ('tfds:no_images', data_dir),
                      ('tfds:tiny_shapes', data_dir + '_empty')):
    try:
      images.read_images(name, data_dir=where)
    except images.DataError as e:
      print('ERR', e)


if __name__ == '__main__':
  main(sys.argv[1])
