"""The trainer of the vector-capsule models and their baselines: CapsNet, its
baseline CNN and Su's two-digit models (``families``: 'capsnet', 'cnn',
'two_digit').

It makes their train and eval steps around the family's loss, the input
pipeline on the device (``preprocess``) and the dataset of a run
(``load_data``); the loop itself is ``loop.fit``.

Two experiments of Sabour et al. section 6 train here too:
- MultiMNIST (``config.dataset = 'multimnist'``): each training batch of
  overlaid digit pairs is drawn inside the jitted step from the MNIST
  training split (minus validation); validation and test are fixed pair sets
  from the validation and test splits (``data.load_multimnist``). Both
  labels are targets (the family's ``multi_label_loss``), the decoder
  reconstructs each digit from its own capsule, and an example is correct
  when the two highest scores are the two true classes.
- Digits on a canvas (``config.canvas_size = 40``, the affNIST training
  set): each training digit is placed at random on a black canvas inside
  the step; validation and test digits are placed once, by a fixed key
  (``data.dataset_on_canvas``).

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
import optax
from flax import nnx

from capsjax import data as data_lib
from capsjax import families
from capsjax.training import loop
from capsjax.training import state as state_lib
from capsjax.training.defaults import fill_defaults


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
  ``config.max_shift`` pixels in training (``state.digit_inputs``), then
  with ``config.augment = 'efficient_capsnet'`` Efficient-CapsNet's
  rotation, shift within the margins, squeeze and erased patch
  (``data.efficient_capsnet_augment``).
  """
  if config.dataset not in ('cifar10', 'smallnorb'):
    images = state_lib.digit_inputs(images, key, config.max_shift)
    if key is not None and fill_defaults(config).augment == 'efficient_capsnet':
      images = data_lib.efficient_capsnet_augment(
          jax.random.fold_in(key, 2), images)
    return images
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

  family = families.of(config.model)
  canvas_size = fill_defaults(config).canvas_size or 0
  dtype = state_lib.compute_dtype(config)
  eval_inputs = lambda images: preprocess(config, images, None)  # noqa: E731

  def train_step(graphdef, state: state_lib.TrainState, images, labels, key):
    images = preprocess(config, images, key)
    if canvas_size:
      images = data_lib.place_on_canvas(jax.random.fold_in(key, 1), images,
                                        canvas_size)

    def loss_fn(model):
      outputs = state_lib.forward(model, images, dtype, labels, train=True)
      loss, metrics = family.loss(outputs, labels, config, images=images,
                                  step=state.step)
      correct = jnp.argmax(outputs['class_scores'], -1) == labels
      return jnp.mean(loss), metrics | {'accuracy': jnp.mean(correct)}

    return state_lib.gradient_step(graphdef, state, optimizer, loss_fn, dtype)

  def eval_step(graphdef, params, model_state, images, labels, mask):
    images = eval_inputs(images)
    model = nnx.merge(graphdef, state_lib.cast_floating(params, dtype),
                      model_state)
    outputs = state_lib.forward(model, images, dtype, train=False)
    loss, _ = family.loss(outputs, labels, config, images=images)
    correct = jnp.argmax(outputs['class_scores'], -1) == labels
    return {'correct': jnp.sum(correct * mask), 'loss': jnp.sum(loss * mask),
            'count': jnp.sum(mask)}

  return state_lib.FamilySteps(train_step, eval_step, eval_inputs)


# ----------------------------------------------------------------------------
# MultiMNIST (Sabour et al. section 6). Shape legend: B the batch, K the
# classes, T = 2 digits per image, S = 36 the canvas side.


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
        outputs['capsules'], labels)
    outputs['digit_reconstructions'] = outputs['digit_reconstructions'].astype(
        jnp.promote_types(outputs['digit_reconstructions'].dtype, jnp.float32))
  return outputs


def check_pair_counts(config: ml_collections.ConfigDict) -> None:
  """ValueError unless the MultiMNIST set sizes and key are ints >= 0."""
  for key in ('validation_pairs', 'test_pairs', 'eval_set_seed'):
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f'config.{key} must be an int >= 0, got {value!r}.')


def make_multimnist_steps(config: ml_collections.ConfigDict,
                          optimizer: optax.GradientTransformation
                          ) -> state_lib.FamilySteps:
  """Train and eval steps on MultiMNIST; the train step draws its batch."""
  family = families.of(config.model)
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
      loss, metrics = family.multi_label_loss(outputs, pairs, config,
                                              digits=digits)
      correct = families.top_k_correct(outputs['class_scores'], pairs)
      return jnp.mean(loss), metrics | {'accuracy': jnp.mean(correct)}

    return state_lib.gradient_step(graphdef, state, optimizer, loss_fn, dtype)

  def eval_step(graphdef, params, model_state, images, labels, mask):
    inputs, digits = data_lib.unpack_pairs(images)
    model = nnx.merge(graphdef, state_lib.cast_floating(params, dtype),
                      model_state)
    # The loss reconstructs the true classes' capsules, as in training.
    outputs = two_digit_outputs(model, inputs, labels, train=False,
                                dtype=dtype)
    loss, _ = family.multi_label_loss(outputs, labels, config, digits=digits)
    correct = families.top_k_correct(outputs['class_scores'], labels)
    return {'correct': jnp.sum(correct * mask), 'loss': jnp.sum(loss * mask),
            'count': jnp.sum(mask)}

  # Evaluation reads the overlay of the packed pairs.
  eval_inputs = lambda images: data_lib.unpack_pairs(images)[0]  # noqa: E731
  return state_lib.FamilySteps(train_step, eval_step, eval_inputs,
                               train_batch=state_lib.whole_split)


def load_data(config: ml_collections.ConfigDict) -> data_lib.Dataset:
  """The dataset of a run: ``config.dataset``, on a canvas if asked."""
  if config.dataset == 'multimnist':
    check_pair_counts(config)
    return data_lib.load_multimnist(
        data_dir=config.data_dir or None,
        validation_size=config.validation_size,
        validation_pairs=config.validation_pairs,
        test_pairs=config.test_pairs, seed=config.eval_set_seed,
        max_shift=config.max_shift)
  options = {}
  if config.dataset == 'smallnorb':
    options = {'stereo': config.stereo, 'downsample': config.downsample}
  dataset = data_lib.load_dataset(
      config.dataset, data_dir=config.data_dir or None,
      validation_size=config.validation_size, **options)
  canvas_size = fill_defaults(config).canvas_size or 0
  if canvas_size:
    dataset = data_lib.dataset_on_canvas(dataset, canvas_size,
                                         config.eval_set_seed)
  return dataset


def steps_for(config: ml_collections.ConfigDict,
              optimizer: optax.GradientTransformation
              ) -> state_lib.FamilySteps:
  """The steps of ``config.dataset``: MultiMNIST's or the single-label ones."""
  make = (make_multimnist_steps if config.dataset == 'multimnist'
          else make_steps)
  return make(config, optimizer)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       **fit_options) -> dict[str, Any]:
  """Train a dynamic-routing model on ``config.dataset``; ``loop.fit`` with
  ``fit_options``."""
  steps = steps_for(config, state_lib.make_optimizer(config))
  return loop.fit(config, workdir, steps, load_data(config), **fit_options)
