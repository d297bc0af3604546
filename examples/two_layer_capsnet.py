"""Your own capsule network, trained by capsjax: two routed capsule layers.

A model written outside the library, from ``capsjax.layers`` and a routing
function, and its config. From the repository's root (``config.model``
names this file's module, ``examples.two_layer_capsnet``, which Python
imports from there):

  python -m experiments.train --workdir=/tmp/two_layer \\
      --config=examples/two_layer_capsnet.py
  python -m experiments.own_images --workdir=/tmp/mine \\
      --config=examples/two_layer_capsnet.py:own_images \\
      --config.images=/path/to/folder
  python -m experiments.own_images --workdir=/tmp/mine --predict=photos/

The first trains on Fashion-MNIST: 85.11% test accuracy after 1,500 steps,
4 min 19 s on a shared 2-core CPU (docs/own_model.md); the others train
on your own images, and predict with that model. The contract a model
meets: docs/own_model.md.
"""

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

import capsjax
from capsjax import layers
from capsjax import nn

# What config.model holds: 'module:Class', imported by capsjax.
MODEL = 'examples.two_layer_capsnet:TwoLayerCapsNet'


class TwoLayerCapsNet(nnx.Module):
  """Conv -> primary capsules -> hidden capsules -> class capsules, each
  capsule layer routed by agreement (3 iterations), and a decoder.

  images [B, H, W, C] in [0, 1] -> {'class_scores': [B, K] class capsule
  lengths, 'capsules': [B, K, class_dim], 'coupling': [B, hidden_caps, K],
  'reconstructions': [B, H*W*C] in [0, 1]}. The decoder sees the capsule of
  the label in training (labels int [B]), else the longest.
  """

  # The CapsNet family: the margin loss on 'class_scores' plus the
  # reconstruction error of 'reconstructions'.
  FAMILY = 'capsnet'

  def __init__(self, *, input_shape=(28, 28, 1), num_classes=10,
               conv_channels=64, primary_types=8, primary_dim=8,
               hidden_caps=16, hidden_dim=12, class_dim=16,
               num_iterations=3, decoder_width=256, rngs: nnx.Rngs):
    height, width, channels = input_shape
    self.num_classes, self.num_iterations = num_classes, num_iterations
    self.conv = layers.Conv2D(channels, conv_channels, 9, rngs=rngs)
    self.primary = layers.PrimaryCapsules(conv_channels, primary_types,
                                          primary_dim, rngs=rngs)
    num_primary = self.primary.num_capsules(self.conv.output_size(height),
                                            self.conv.output_size(width))
    # A capsule layer from capsjax.layers: votes, routing and its bias.
    self.hidden = layers.DenseCapsules(num_primary, primary_dim, hidden_caps,
                                       hidden_dim, num_iterations, rngs=rngs)
    # The class layer by hand: one transform per (hidden, class) pair,
    # routed by capsjax.dynamic_routing in __call__.
    self.class_weights = nnx.Param(nn.truncated_normal_init(0.1)(
        rngs.params(), (hidden_caps, num_classes, hidden_dim, class_dim)))
    self.decoder = nnx.Sequential(
        nnx.Linear(num_classes * class_dim, decoder_width, rngs=rngs),
        jax.nn.relu,
        nnx.Linear(decoder_width, height * width * channels, rngs=rngs),
        jax.nn.sigmoid)

  def __call__(self, images, labels=None, *, train=False):
    primary = self.primary(jax.nn.relu(self.conv(images)))  # [B, I, 8]
    hidden, _ = self.hidden(primary)  # [B, hidden_caps, hidden_dim]
    votes = capsjax.vector_votes(hidden, self.class_weights[...])
    capsules, coupling = capsjax.dynamic_routing(votes, self.num_iterations)
    lengths = capsjax.safe_norm(capsules, axis=-1)  # [B, K]
    shown = (labels if train and labels is not None
             else jnp.argmax(lengths, axis=-1))
    mask = jax.nn.one_hot(shown, self.num_classes, dtype=capsules.dtype)
    masked = (capsules * mask[..., None]).reshape(capsules.shape[0], -1)
    return {'class_scores': lengths, 'capsules': capsules,
            'coupling': coupling, 'reconstructions': self.decoder(masked)}


def _training(config: ml_collections.ConfigDict) -> None:
  """A short run for a CPU: 1,500 steps of 64 images (1.7 epochs)."""
  config.model = MODEL
  # The margin loss summed over the classes (the paper's text).
  config.loss_form = 'text'
  # The squared reconstruction error is added times this (the paper's).
  config.reconstruction_weight = 0.0005
  config.batch_size = 64
  config.num_train_steps = 1500
  config.learning_rate = 2e-3
  config.lr_decay_steps = 200
  config.lr_decay_rate = 0.8
  # A guard for slower machines: stop (and test) after 6 minutes of steps.
  config.max_train_seconds = 360.0
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  config.log_every_steps = 100


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  """'' : Fashion-MNIST; 'own_images': your own images
  (experiments.own_images, the data setting input_shape and num_classes)."""
  from experiments.configs import common
  from experiments.configs import own_images
  if variant == 'own_images':
    config = own_images.get_config('smoke')
    config.model_options = ml_collections.ConfigDict(
        {'input_shape': (0, 0, 0), 'num_classes': 0})
  elif not variant:
    config = common.base_config()
    config.dataset = 'fashion_mnist'
  else:
    raise ValueError(f"unknown variant {variant!r}; '' or 'own_images'.")
  _training(config)
  config.model_options.conv_channels = 64
  config.model_options.num_iterations = 3
  return config
