"""Training of dynamic-routing models (CapsNet, its baseline CNN, Su's models).

Losses: the margin loss on capsule lengths plus the scaled reconstruction
error (Sabour et al. 2017), softmax cross-entropy for the baseline CNN, and
Su's binary margin loss for the two-digit models. The loop itself is
``train_lib.fit``.
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
from capsjax import train_lib


def class_scores(outputs: dict[str, jax.Array]) -> jax.Array:
  """[B, K] scores whose argmax is the prediction, whatever the model."""
  for key in ('lengths', 'logits', 'scores', 'activations'):
    if key in outputs:
      return outputs[key]
  raise KeyError(f'model outputs {sorted(outputs)} hold no class scores.')


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
  num_classes = class_scores(outputs).shape[-1]
  one_hot = jax.nn.one_hot(labels, num_classes)
  metrics = {}
  if 'logits' in outputs:
    loss = losses.cross_entropy_loss(outputs['logits'], labels)
  elif 'lengths' in outputs:
    loss = losses.margin_loss(outputs['lengths'], one_hot)
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


def make_steps(config: ml_collections.ConfigDict,
               optimizer: optax.GradientTransformation
               ) -> train_lib.FamilySteps:
  """The jittable train and eval steps of a dynamic-routing model."""

  def train_step(graphdef, state: train_lib.TrainState, images, labels, key):
    images = train_lib.digit_inputs(images, key, config.max_shift)

    def loss_fn(model):
      outputs = model(images, labels, train=True)
      loss, metrics = dynamic_loss(outputs, images, labels, config)
      correct = jnp.argmax(class_scores(outputs), -1) == labels
      return jnp.mean(loss), metrics | {'accuracy': jnp.mean(correct)}

    return train_lib.gradient_step(graphdef, state, optimizer, loss_fn)

  def eval_step(graphdef, params, model_state, images, labels, mask):
    images = train_lib.digit_inputs(images, None, 0)
    model = nnx.merge(graphdef, params, model_state)
    outputs = model(images, train=False)
    loss, _ = dynamic_loss(outputs, images, labels, config)
    correct = jnp.argmax(class_scores(outputs), -1) == labels
    return {'correct': jnp.sum(correct * mask), 'loss': jnp.sum(loss * mask),
            'count': jnp.sum(mask)}

  return train_lib.FamilySteps(train_step, eval_step)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str
                       ) -> dict[str, Any]:
  """Train a dynamic-routing model on ``config.dataset``; see train_lib.fit."""
  dataset = data_lib.load_dataset(
      config.dataset, data_dir=config.data_dir or None,
      validation_size=config.validation_size)
  steps = make_steps(config, train_lib.make_optimizer(config))
  return train_lib.fit(config, workdir, steps, dataset)
