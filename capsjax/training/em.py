"""Training of matrix-capsule models with EM routing (Hinton et al. 2018).

Loss: the spread loss with its growing margin (or cross-entropy / margin loss
for ablations) plus an optional L2 penalty. Non-finite losses or gradients
stop the run with a clear message and keep the last good checkpoint
(``state.apply_gradients`` never applies such an update). The loop itself
is ``loop.fit``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from capsjax import data as data_lib
from capsjax import losses
from capsjax.training import loop
from capsjax.training import state as state_lib

# Keeps logit(a) finite for activations that saturate at 0 or 1.
_ACTIVATION_CLIP = 1e-6


def em_loss(activations: jax.Array, labels: jax.Array, step: jax.Array,
            config: ml_collections.ConfigDict) -> jax.Array:
  """Per-example loss [B] of class activations [B, K] and labels [B]."""
  if config.loss == 'spread':
    margin = losses.spread_loss_margin(
        step, schedule=config.margin_schedule,
        total_steps=config.margin_steps)
    return losses.spread_loss(activations, labels, margin)
  if config.loss == 'cross_entropy':
    a = jnp.clip(activations, _ACTIVATION_CLIP, 1.0 - _ACTIVATION_CLIP)
    return losses.cross_entropy_loss(jnp.log(a) - jnp.log1p(-a), labels)
  if config.loss == 'margin':
    return losses.margin_loss(
        activations, jax.nn.one_hot(labels, activations.shape[-1]))
  raise ValueError(f"config.loss must be 'spread', 'cross_entropy' or "
                   f"'margin', got {config.loss!r}.")


def l2_penalty(params) -> jax.Array:
  """Sum of squared weights (matrices and kernels; biases and betas exempt)."""
  return sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
             for x in jax.tree.leaves(params) if x.ndim > 1)


def preprocess(config: ml_collections.ConfigDict, images: jax.Array,
               key: jax.Array | None) -> jax.Array:
  """uint8 images -> model inputs; training (key given) or evaluation."""
  if config.dataset == 'smallnorb':
    if key is None:
      return data_lib.smallnorb_eval_preprocess(images)
    return data_lib.smallnorb_train_preprocess(key, images)
  return state_lib.digit_inputs(images, key, config.max_shift,
                                config.get('center_crop', 0))


def make_steps(config: ml_collections.ConfigDict,
               optimizer: optax.GradientTransformation
               ) -> state_lib.FamilySteps:
  """The jittable train and eval steps of an EM-routing model."""
  dtype = state_lib.compute_dtype(config)

  def train_step(graphdef, state: state_lib.TrainState, images, labels, key):
    images = preprocess(config, images, key)

    def loss_fn(model):
      activations = state_lib.forward(model, images, dtype, labels,
                                    train=True)['activations']
      loss = jnp.mean(em_loss(activations, labels, state.step, config))
      total = loss + config.weight_decay * l2_penalty(
          nnx.state(model, nnx.Param))
      correct = jnp.argmax(activations, -1) == labels
      return total, {'class_loss': loss, 'accuracy': jnp.mean(correct)}

    return state_lib.gradient_step(graphdef, state, optimizer, loss_fn, dtype)

  def eval_step(graphdef, params, model_state, images, labels, mask):
    model = nnx.merge(graphdef, state_lib.cast_floating(params, dtype),
                      model_state)
    activations = state_lib.forward(
        model, preprocess(config, images, None), dtype)['activations']
    # The loss at the final margin, comparable across steps.
    loss = em_loss(activations, labels, jnp.asarray(10**9), config)
    correct = jnp.argmax(activations, -1) == labels
    return {'correct': jnp.sum(correct * mask), 'loss': jnp.sum(loss * mask),
            'count': jnp.sum(mask)}

  return state_lib.FamilySteps(train_step, eval_step,
                               lambda images: preprocess(config, images, None))


def load_data(config: ml_collections.ConfigDict) -> data_lib.Dataset:
  """The dataset of a run: ``config.dataset`` (smallNORB with its options)."""
  options = {}
  if config.dataset == 'smallnorb':
    options = {'stereo': config.stereo,
               'viewpoint_split': config.viewpoint_split or None}
  return data_lib.load_dataset(
      config.dataset, data_dir=config.data_dir or None,
      validation_size=config.validation_size, **options)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str
                       ) -> dict[str, Any]:
  """Train an EM-routing model on ``config.dataset``; see ``loop.fit``."""
  steps = make_steps(config, state_lib.make_optimizer(config))
  return loop.fit(config, workdir, steps, load_data(config))
