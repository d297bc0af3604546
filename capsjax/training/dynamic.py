"""Training of dynamic-routing models (CapsNet, its baseline CNN, Su's models).

Losses: the margin loss on capsule lengths plus the scaled reconstruction
error (Sabour et al. 2017), softmax cross-entropy for the baseline CNN, and
Su's binary margin loss for the two-digit models. The loop itself is
``loop.fit``.

Two experiments of Sabour et al. section 6 train here too:
- MultiMNIST (``config.dataset = 'multimnist'``): each training batch of
  overlaid digit pairs is drawn inside the jitted step from the MNIST
  training split (minus validation); validation and test are fixed pair sets
  from the validation and test splits. Both labels are targets, the decoder
  reconstructs each digit from its own capsule, and an example is correct
  when the two highest scores are the two true classes.
- Digits on a canvas (``config.canvas_size = 40``, the affNIST training
  set): each training digit is placed at random on a black canvas inside
  the step; validation and test digits are placed once, by a fixed key.

And the section 7 datasets, each with its input pipeline on the device
(``preprocess``): CIFAR-10 and smallNORB as the official code reads them
(random crops, brightness, contrast, standardisation; CIFAR-10's flips),
SVHN as the digits (pixels in [0, 1], random shifts).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from capsjax import data as data_lib
from capsjax import losses
from capsjax import models
from capsjax.data.multimnist import CANVAS_SIZE
from capsjax.training import loop
from capsjax.training import state as state_lib


def dynamic_loss(outputs: dict[str, jax.Array], images: jax.Array,
                 labels: jax.Array, config: ml_collections.ConfigDict
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-example loss [B] and metrics for one batch.

  Args:
    outputs: the model's dict ('lengths' [+ 'reconstructions'], 'logits' or
      'scores').
    images: [B, H, W, C] float inputs (reconstruction targets).
    labels: [B] int32.
  """
  num_classes = models.class_scores(outputs).shape[-1]
  one_hot = jax.nn.one_hot(labels, num_classes)
  metrics = {}
  if 'logits' in outputs:
    loss = losses.cross_entropy_loss(outputs['logits'], labels)
  elif 'lengths' in outputs:
    loss = losses.margin_loss(outputs['lengths'], one_hot,
                              form=config.loss_form)
    metrics['margin_loss'] = jnp.mean(loss)
    if 'reconstructions' in outputs:
      reconstruction = losses.reconstruction_loss(outputs['reconstructions'],
                                                  images)
      metrics['reconstruction_loss'] = jnp.mean(reconstruction)
      loss = loss + config.reconstruction_weight * reconstruction
  else:
    # Su's binary loss: y relu(0.9 - p)^2 + 0.25 (1 - y) relu(p - 0.1)^2.
    loss = losses.margin_loss(outputs['scores'], one_hot,
                              negative_weight=0.25)
  return loss, metrics


def preprocess(config: ml_collections.ConfigDict, images: jax.Array,
               key: jax.Array | None) -> jax.Array:
  """uint8 images [B, H, W, C] -> the model's float32 inputs, for training
  (``key`` given) or evaluation (None), by ``config.dataset``.

  'cifar10': the official code's input (``data.cifar10_train_preprocess``):
  a random crop of the model's input size, a flip (``config.random_flip``),
  brightness, contrast, per-image standardisation of pixels in [0,
  ``config.pixel_max``]; evaluation the central crop, standardised.
  'smallnorb': the official code's smallNORB input with the EM family's
  functions (``data.smallnorb_train_preprocess`` with
  ``config.augment_order`` and ``config.pixel_max``; evaluation the central
  crop, standardised).
  Otherwise the digits' input: pixels in [0, 1], shifted by up to
  ``config.max_shift`` pixels in training (``state.digit_inputs``).
  """
  if config.dataset not in ('cifar10', 'smallnorb'):
    return state_lib.digit_inputs(images, key, config.max_shift)
  # Crops of the model's input size: the config states it once.
  crop = config.model_options.input_shape[0]
  if config.dataset == 'cifar10':
    if key is None:
      return data_lib.cifar10_eval_preprocess(images, crop_size=crop,
                                              pixel_max=config.pixel_max)
    return data_lib.cifar10_train_preprocess(
        key, images, crop_size=crop, flip=config.random_flip,
        pixel_max=config.pixel_max)
  if key is None:
    return data_lib.smallnorb_eval_preprocess(images, crop_size=crop,
                                              pixel_max=config.pixel_max)
  return data_lib.smallnorb_train_preprocess(
      key, images, crop_size=crop, order=config.augment_order,
      pixel_max=config.pixel_max)


def make_steps(config: ml_collections.ConfigDict,
               optimizer: optax.GradientTransformation
               ) -> state_lib.FamilySteps:
  """The jittable train and eval steps of a dynamic-routing model."""

  canvas_size = config.get('canvas_size') or 0
  dtype = state_lib.compute_dtype(config)
  eval_inputs = lambda images: preprocess(config, images, None)  # noqa: E731

  def train_step(graphdef, state: state_lib.TrainState, images, labels, key):
    images = preprocess(config, images, key)
    if canvas_size:
      images = data_lib.place_on_canvas(jax.random.fold_in(key, 1), images,
                                        canvas_size)

    def loss_fn(model):
      outputs = state_lib.forward(model, images, dtype, labels, train=True)
      loss, metrics = dynamic_loss(outputs, images, labels, config)
      correct = jnp.argmax(models.class_scores(outputs), -1) == labels
      return jnp.mean(loss), metrics | {'accuracy': jnp.mean(correct)}

    return state_lib.gradient_step(graphdef, state, optimizer, loss_fn, dtype)

  def eval_step(graphdef, params, model_state, images, labels, mask):
    images = eval_inputs(images)
    model = nnx.merge(graphdef, state_lib.cast_floating(params, dtype),
                      model_state)
    outputs = state_lib.forward(model, images, dtype, train=False)
    loss, _ = dynamic_loss(outputs, images, labels, config)
    correct = jnp.argmax(models.class_scores(outputs), -1) == labels
    return {'correct': jnp.sum(correct * mask), 'loss': jnp.sum(loss * mask),
            'count': jnp.sum(mask)}

  return state_lib.FamilySteps(train_step, eval_step, eval_inputs)


# ----------------------------------------------------------------------------
# MultiMNIST (Sabour et al. section 6). Shape legend: B the batch, K the
# classes, T = 2 digits per image, S = 36 the canvas side.


def multi_hot(labels: jax.Array, num_classes: int) -> jax.Array:
  """int [B, T] class indices -> float32 [B, K] with a 1 at each of them."""
  return jnp.max(jax.nn.one_hot(labels, num_classes), axis=1)


def top_k_correct(scores: jax.Array, labels: jax.Array) -> jax.Array:
  """bool [B]: the T highest of the scores [B, K] are the T labels [B, T].

  The paper's MultiMNIST criterion ("the two longest capsules are the two
  true classes") for T = 2; the order within the T does not matter.
  """
  _, top = jax.lax.top_k(scores, labels.shape[-1])
  return jnp.all(jnp.sort(top, axis=-1) == jnp.sort(labels, axis=-1), axis=-1)


def two_digit_outputs(model: nnx.Module, images: jax.Array,
                      labels: jax.Array, *, train: bool, dtype=None
                      ) -> dict[str, jax.Array]:
  """The model's outputs plus, for a CapsNet with a decoder,
  'digit_reconstructions' [B, T, S*S]: digit t from capsule labels[:, t].

  ``dtype``: the compute dtype (``state.forward``); outputs float32.
  """
  outputs = state_lib.forward(model, images, dtype, train=train)
  if getattr(model, 'decoder', None) is not None and 'capsules' in outputs:
    outputs['digit_reconstructions'] = model.reconstruct_digits(
        outputs['capsules'], labels).astype(jnp.float32)
  return outputs


def two_digit_loss(outputs: dict[str, jax.Array], labels: jax.Array,
                   digits: jax.Array, config: ml_collections.ConfigDict
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-example loss [B] and metrics with both digits as targets.

  CapsNet: the margin loss with T_k = 1 for both classes, plus
  ``reconstruction_weight`` times the reconstruction error summed over the
  two digits, each reconstruction against its own digit's image. Baseline
  CNN: sigmoid cross-entropy summed over the K independent classes.

  Args:
    outputs: ``two_digit_outputs``: 'lengths' [B, K] (and
      'digit_reconstructions' [B, T, N]) or 'logits' [B, K].
    labels: int [B, T].
    digits: [B, T, S, S, 1] float, each digit alone (MultiMNIST 'first',
      'second').
  """
  scores = models.class_scores(outputs)
  targets = multi_hot(labels, scores.shape[-1])
  metrics = {}
  if 'logits' in outputs:
    loss = jnp.sum(optax.sigmoid_binary_cross_entropy(scores, targets), -1)
  else:
    loss = losses.margin_loss(scores, targets, form=config.loss_form)
    metrics['margin_loss'] = jnp.mean(loss)
    if 'digit_reconstructions' in outputs:
      per_digit = [losses.reconstruction_loss(
          outputs['digit_reconstructions'][:, t], digits[:, t])
                   for t in range(labels.shape[-1])]
      reconstruction = sum(per_digit)
      metrics['reconstruction_loss'] = jnp.mean(reconstruction)
      loss = loss + config.reconstruction_weight * reconstruction
  return loss, metrics


def pack_pairs(pairs: dict[str, np.ndarray]) -> data_lib.Split:
  """A ``multimnist_test_set`` as a Split: uint8 [M, S, S, 3] images with
  channels (overlay, first digit, second digit), int32 [M, 2] labels.

  Every pixel is a multiple of 1/255 (digits are uint8 / 255, the overlay
  their sum clipped to 1), so this keeps them up to float32 rounding, in a
  quarter of the float32 memory.
  """
  channels = np.concatenate([pairs['image'], pairs['first'], pairs['second']],
                            axis=-1)
  images = np.rint(channels * 255.0).astype(np.uint8)
  return data_lib.Split(images, pairs['labels'].astype(np.int32))


def unpack_pairs(images: jax.Array) -> tuple[jax.Array, jax.Array]:
  """uint8 [B, S, S, 3] from ``pack_pairs`` -> float inputs [B, S, S, 1] and
  digits [B, 2, S, S, 1]."""
  images = data_lib.to_float(images)
  digits = jnp.moveaxis(images[..., 1:], -1, 1)[..., None]
  return images[..., :1], digits


def multimnist_pairs(split: data_lib.Split, num_pairs: int, seed: int,
                     max_shift: int) -> data_lib.Split:
  """A fixed packed MultiMNIST set from a digit split (empty if either is)."""
  if num_pairs == 0 or len(split.labels) == 0:
    return data_lib.Split(np.zeros((0, CANVAS_SIZE, CANVAS_SIZE, 3), np.uint8),
                          np.zeros((0, 2), np.int32))
  return pack_pairs(data_lib.multimnist_test_set(
      split.images, split.labels, num_pairs, seed, max_shift=max_shift))


def multimnist_dataset(config: ml_collections.ConfigDict) -> data_lib.Dataset:
  """Training digits (pairs are drawn in the step); fixed pair sets.

  Validation: ``config.validation_pairs`` pairs of validation-split digits
  (key ``eval_set_seed``); test: ``config.test_pairs`` pairs of test-split
  digits (key ``eval_set_seed + 1``), the same for every training seed.
  """
  for key in ('validation_pairs', 'test_pairs', 'eval_set_seed'):
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f'config.{key} must be an int >= 0, got {value!r}.')
  mnist = data_lib.load_dataset('mnist', data_dir=config.data_dir or None,
                                validation_size=config.validation_size)
  make = lambda split, num, seed: multimnist_pairs(  # noqa: E731
      split, num, seed, config.max_shift)
  return data_lib.Dataset(
      mnist.train,
      make(mnist.validation, config.validation_pairs, config.eval_set_seed),
      make(mnist.test, config.test_pairs, config.eval_set_seed + 1),
      mnist.num_classes, 'multimnist')


def make_multimnist_steps(config: ml_collections.ConfigDict,
                          optimizer: optax.GradientTransformation
                          ) -> state_lib.FamilySteps:
  """Train and eval steps on MultiMNIST; the train step draws its batch."""
  dtype = state_lib.compute_dtype(config)

  def train_step(graphdef, state: state_lib.TrainState, images, labels, key):
    # images, labels: the whole training split (uint8 [N, 28, 28, 1], [N]).
    batch = data_lib.multimnist_batch(key, images, labels, config.batch_size,
                                      max_shift=config.max_shift)
    pairs = batch['labels']
    digits = jnp.stack([batch['first'], batch['second']], axis=1)

    def loss_fn(model):
      outputs = two_digit_outputs(model, batch['image'], pairs, train=True,
                                  dtype=dtype)
      loss, metrics = two_digit_loss(outputs, pairs, digits, config)
      correct = top_k_correct(models.class_scores(outputs), pairs)
      return jnp.mean(loss), metrics | {'accuracy': jnp.mean(correct)}

    return state_lib.gradient_step(graphdef, state, optimizer, loss_fn, dtype)

  def eval_step(graphdef, params, model_state, images, labels, mask):
    inputs, digits = unpack_pairs(images)
    model = nnx.merge(graphdef, state_lib.cast_floating(params, dtype),
                      model_state)
    # The loss reconstructs the true classes' capsules, as in training.
    outputs = two_digit_outputs(model, inputs, labels, train=False,
                                dtype=dtype)
    loss, _ = two_digit_loss(outputs, labels, digits, config)
    correct = top_k_correct(models.class_scores(outputs), labels)
    return {'correct': jnp.sum(correct * mask), 'loss': jnp.sum(loss * mask),
            'count': jnp.sum(mask)}

  # Evaluation reads the overlay of the packed pairs.
  eval_inputs = lambda images: unpack_pairs(images)[0]  # noqa: E731
  return state_lib.FamilySteps(train_step, eval_step, eval_inputs,
                               draws_batches=True)


# ----------------------------------------------------------------------------
# Digits on a canvas (the affNIST training set).


def on_canvas(split: data_lib.Split, canvas_size: int, seed: int
              ) -> data_lib.Split:
  """Each digit of ``split`` at a random place on a black canvas, fixed by
  ``seed`` (the "expanded MNIST" validation and test sets)."""
  if len(split.labels) == 0:
    return data_lib.Split(
        np.zeros((0, canvas_size, canvas_size, split.images.shape[-1]),
                 np.uint8), split.labels)
  images = data_lib.place_on_canvas(jax.random.key(seed), split.images,
                                    canvas_size)
  return data_lib.Split(np.asarray(images), split.labels)


def load_data(config: ml_collections.ConfigDict) -> data_lib.Dataset:
  """The dataset of a run: ``config.dataset``, on a canvas if asked."""
  if config.dataset == 'multimnist':
    return multimnist_dataset(config)
  options = {}
  if config.dataset == 'smallnorb':
    options = {'stereo': config.stereo, 'downsample': config.downsample}
  dataset = data_lib.load_dataset(
      config.dataset, data_dir=config.data_dir or None,
      validation_size=config.validation_size, **options)
  canvas_size = config.get('canvas_size') or 0
  if canvas_size:
    seed = config.eval_set_seed
    dataset = dataset._replace(
        validation=on_canvas(dataset.validation, canvas_size, seed),
        test=on_canvas(dataset.test, canvas_size, seed + 1),
        name=f'{dataset.name}_on_{canvas_size}x{canvas_size}')
  return dataset


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str
                       ) -> dict[str, Any]:
  """Train a dynamic-routing model on ``config.dataset``; see ``loop.fit``."""
  make = (make_multimnist_steps if config.dataset == 'multimnist'
          else make_steps)
  steps = make(config, state_lib.make_optimizer(config))
  return loop.fit(config, workdir, steps, load_data(config))
