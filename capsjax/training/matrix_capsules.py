"""The trainer of the matrix-capsule models (the 'em' family): matrix
capsules with EM routing (Hinton et al. 2018).

Loss: the family's class loss (``families.EMFamily``: the spread loss with
its growing margin, or cross-entropy / margin loss for ablations) plus an
optional L2 penalty of the weights (``l2_penalty``). Non-finite losses or
gradients stop the run with a clear message and keep the last good
checkpoint (``state.apply_gradients`` never applies such an update). The
loop itself is ``loop.fit``.

The released code's protocol (google-research capsule_em) is a set of
options, each defaulting to capsjax's (the paper's) form:
``config.spread_class_reduction`` and ``config.l2_form`` (the loss),
``config.grad_clip`` (``make_optimizer``), and on smallNORB
``config.downsample``, ``config.augment_order``, ``config.pixel_max`` and
``config.test_crops`` (``preprocess``, ``make_steps``, ``load_data``).
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


def l2_penalty(params, *, form: str = 'sum') -> jax.Array:
  """The L2 penalty of the weights (matrices and kernels; biases and betas
  exempt: every leaf of more than one dimension).

  ``form='sum'`` (capsjax): the sum of their squares. ``'half'`` (the
  released code: ``utils.weight_variable`` adds ``wd * tf.nn.l2_loss(w)``
  for each weight, and tf.nn.l2_loss is sum(w^2) / 2): half of it. Both
  penalise the same tensors: conv1's kernel, the primary capsules' pose and
  activation kernels, the convolutional capsules' and the class capsules'
  transforms; not conv1's bias nor the betas (``bias_variable``s in the
  released code, which never decays them). The released primary capsules
  have no bias; capsjax's default ones have, exempt. Summed in float32, or
  float64 for float64 weights.
  """
  if form not in ('sum', 'half'):
    raise ValueError(f"form must be 'sum' or 'half', got {form!r}.")
  total = sum(jnp.sum(jnp.square(x.astype(jnp.promote_types(x.dtype,
                                                            jnp.float32))))
              for x in jax.tree.leaves(params) if x.ndim > 1)
  return total / 2 if form == 'half' else total


def clip_gradients(optimizer: optax.GradientTransformation, clip: float
                   ) -> optax.GradientTransformation:
  """``optimizer`` fed gradients clipped element-wise to [-clip, clip].

  optax.clip's clipping, but the state is ``optimizer``'s own (optax.chain
  would nest it): ``loop.fit`` builds the train state with
  ``state.make_optimizer``, and checkpoints stay interchangeable.
  """
  clipper = optax.clip(clip)

  def update(updates, state, params=None):
    clipped, _ = clipper.update(updates, clipper.init(updates))
    return optimizer.update(clipped, state, params)

  return optax.GradientTransformation(optimizer.init, update)


def make_optimizer(config: ml_collections.ConfigDict
                   ) -> optax.GradientTransformation:
  """Adam with its exponential decay, after optional element-wise clipping.

  ``config.grad_clip`` > 0 clips each gradient element to
  [-grad_clip, grad_clip] before Adam: the released code's
  ``model._average_gradients`` applies tf.clip_by_value(grad, -200, 200) to
  every variable's gradient (averaged over the GPU towers, the L2 term's
  gradient included) before ``AdamOptimizer.apply_gradients`` (the current
  model.py; its first, 2018, version has no clipping). 0: no clipping
  (capsjax; the paper mentions none).
  """
  optimizer = state_lib.make_optimizer(config)
  clip = config.grad_clip  # filled by state_lib.make_optimizer
  if clip < 0:
    raise ValueError(f'config.grad_clip must be >= 0, got {clip}.')
  return clip_gradients(optimizer, clip) if clip else optimizer


def preprocess(config: ml_collections.ConfigDict, images: jax.Array,
               key: jax.Array | None) -> jax.Array:
  """uint8 images -> model inputs; training (key given) or evaluation.

  smallNORB: ``config.augment_order`` and ``config.pixel_max`` (see
  ``data.smallnorb_distort``); evaluation is the centre crop.
  """
  fill_defaults(config)
  if config.dataset == 'smallnorb':
    pixel_max = config.pixel_max
    if key is None:
      return data_lib.smallnorb_eval_preprocess(images, pixel_max=pixel_max)
    return data_lib.smallnorb_train_preprocess(
        key, images, order=config.augment_order,
        pixel_max=pixel_max)
  return state_lib.digit_inputs(images, key, config.max_shift,
                                config.center_crop)


TEST_CROPS = ('centre', 'released13')


def eval_crop_mode(config: ml_collections.ConfigDict) -> str:
  """``config.test_crops``: 'centre' (one crop) or 'released13' (smallNORB)."""
  crops = fill_defaults(config).test_crops
  if crops not in TEST_CROPS:
    raise ValueError(f'config.test_crops must be one of {TEST_CROPS}, got '
                     f'{crops!r}.')
  if crops != 'centre' and config.dataset != 'smallnorb':
    raise ValueError(f"config.test_crops={crops!r} is smallNORB's; "
                     f'{config.dataset} evaluates one view.')
  return crops


def make_steps(config: ml_collections.ConfigDict,
               optimizer: optax.GradientTransformation
               ) -> state_lib.FamilySteps:
  """The jittable train and eval steps of an EM-routing model."""
  family = families.of(config.model)
  dtype = state_lib.compute_dtype(config)

  def train_step(graphdef, state: state_lib.TrainState, images, labels, key):
    images = preprocess(config, images, key)

    def loss_fn(model):
      outputs = state_lib.forward(model, images, dtype, labels, train=True)
      activations = outputs['class_scores']
      loss = jnp.mean(family.loss(outputs, labels, config,
                                  step=state.step)[0])
      total = loss + config.weight_decay * l2_penalty(
          nnx.state(model, nnx.Param), form=config.l2_form)
      correct = jnp.argmax(activations, -1) == labels
      return total, {'class_loss': loss, 'accuracy': jnp.mean(correct)}

    return state_lib.gradient_step(graphdef, state, optimizer, loss_fn, dtype)

  crops = eval_crop_mode(config)

  def activations_of(graphdef, params, model_state, inputs):
    model = nnx.merge(graphdef, state_lib.cast_floating(params, dtype),
                      model_state)
    return state_lib.forward(model, inputs, dtype)['class_scores']

  def eval_step(graphdef, params, model_state, images, labels, mask):
    if crops == 'released13':
      # The released eval_once: 13 crops per image, each one's activations
      # normalised over the classes, summed. One crop's batch at a time.
      views = data_lib.smallnorb_multicrop(
          images, pattern='released', pixel_max=config.pixel_max)
      per_crop = jax.lax.map(
          lambda x: activations_of(graphdef, params, model_state, x), views)
      # Entry 0 is the centre crop: its loss stays comparable with 'centre'.
      activations = per_crop[0]
      scores = data_lib.combine_crop_activations(per_crop)
    else:
      activations = activations_of(graphdef, params, model_state,
                                   preprocess(config, images, None))
      scores = activations
    # The loss at the final margin, comparable across steps.
    loss, _ = family.loss({'class_scores': activations}, labels, config,
                          step=jnp.asarray(10**9))
    correct = jnp.argmax(scores, -1) == labels
    return {'correct': jnp.sum(correct * mask), 'loss': jnp.sum(loss * mask),
            'count': jnp.sum(mask)}

  return state_lib.FamilySteps(train_step, eval_step,
                               lambda images: preprocess(config, images, None))


def load_data(config: ml_collections.ConfigDict) -> data_lib.Dataset:
  """The dataset of a run: ``config.dataset`` (smallNORB with its options)."""
  fill_defaults(config)
  options = {}
  if config.dataset == 'smallnorb':
    options = {'stereo': config.stereo,
               'viewpoint_split': config.viewpoint_split or None,
               'downsample': config.downsample}
  return data_lib.load_dataset(
      config.dataset, data_dir=config.data_dir or None,
      validation_size=config.validation_size, **options)


def steps_for(config: ml_collections.ConfigDict,
              optimizer: optax.GradientTransformation
              ) -> state_lib.FamilySteps:
  """The steps of a run (``make_steps``: the EM family has one kind)."""
  return make_steps(config, optimizer)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       **fit_options) -> dict[str, Any]:
  """Train an EM-routing model on ``config.dataset``; ``loop.fit`` with
  ``fit_options``."""
  steps = steps_for(config, make_optimizer(config))
  return loop.fit(config, workdir, steps, load_data(config), **fit_options)
