"""A user's models, outside capsjax, for tests/test_own_model.py: a small
capsule network from ``capsjax.layers``, a factory of a wider one, three
that break the contract, and the config file that trains them (as a user
writes one for the launcher).

  python -m experiments.train --workdir=W --config=tests/user_models.py \\
      --config.data_dir=MNIST_DIR
"""

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

import capsjax
from capsjax import layers

MODEL = 'tests.user_models:TinyCapsNet'


class TinyCapsNet(nnx.Module):
  """Conv (stride 2) -> primary capsules -> class capsules (2 routing
  iterations) -> a one-layer decoder.

  images [B, H, W, C] -> {'class_scores': [B, K] lengths, 'coupling': [B,
  I, K], 'reconstructions': [B, H*W*C]}.
  """

  FAMILY = 'capsnet'

  def __init__(self, *, input_shape=(28, 28, 1), num_classes=10, channels=8,
               primary_types=2, class_dim=8, rngs: nnx.Rngs):
    height, width, depth = input_shape
    self.num_classes = num_classes
    self.conv = layers.Conv2D(depth, channels, 5, 2, rngs=rngs)
    self.primary = layers.PrimaryCapsules(channels, primary_types, 4,
                                          kernel_size=5, stride=2, rngs=rngs)
    num_primary = self.primary.num_capsules(self.conv.output_size(height),
                                            self.conv.output_size(width))
    self.digit = layers.DenseCapsules(num_primary, 4, num_classes, class_dim,
                                      2, rngs=rngs)
    self.decoder = nnx.Linear(num_classes * class_dim, height * width * depth,
                              rngs=rngs)

  def __call__(self, images, labels=None, *, train=False):
    primary = self.primary(jax.nn.relu(self.conv(images)))
    capsules, coupling = self.digit(primary)
    lengths = capsjax.safe_norm(capsules, axis=-1)
    shown = (labels if train and labels is not None
             else jnp.argmax(lengths, axis=-1))
    mask = jax.nn.one_hot(shown, self.num_classes, dtype=capsules.dtype)
    masked = (capsules * mask[..., None]).reshape(capsules.shape[0], -1)
    return {'class_scores': lengths, 'coupling': coupling,
            'reconstructions': jax.nn.sigmoid(self.decoder(masked))}


def wide_tiny_capsnet(*, input_shape=(28, 28, 1), num_classes=10,
                      rngs: nnx.Rngs) -> TinyCapsNet:
  """A factory: TinyCapsNet with 16 channels (its family from the return
  annotation)."""
  return TinyCapsNet(input_shape=input_shape, num_classes=num_classes,
                     channels=16, rngs=rngs)


class NoFamilyCapsNet(nnx.Module):
  """TinyCapsNet's computation without a FAMILY."""

  def __init__(self, *, rngs: nnx.Rngs, **options):
    self.inner = TinyCapsNet(rngs=rngs, **options)

  def __call__(self, images, labels=None, *, train=False):
    return self.inner(images, labels, train=train)


class NoScoresCapsNet(TinyCapsNet):
  """Its class capsule lengths under another key than 'class_scores'."""

  def __call__(self, images, labels=None, *, train=False):
    outputs = super().__call__(images, labels, train=train)
    return {'lengths': outputs.pop('class_scores'), **outputs}


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  """'' : MNIST's IDX files from --config.data_dir, 40 validation images;
  'own_images': a folder of images (--config.images)."""
  from experiments.configs import common
  from experiments.configs import own_images
  if variant == 'own_images':
    config = own_images.get_config('smoke')
    config.model_options = ml_collections.ConfigDict(
        {'input_shape': (0, 0, 0), 'num_classes': 0})
    config.image_size = 20
  else:
    config = common.base_config()
    config.validation_size = 40
    config.evals.per_class = dict(type='confusion', split='test')
  config.model = MODEL
  config.loss_form = 'text'
  config.reconstruction_weight = 0.0005
  config.batch_size = 8
  config.eval_batch_size = 40
  config.learning_rate = 2e-3
  config.num_train_steps = 20
  config.eval_every_steps = 5
  config.checkpoint_every_steps = 5
  config.log_every_steps = 1
  config.max_train_seconds = 0.0
  return config
