"""Pure losses of both capsule papers and Su's transfer experiment.

Shape legend: B the batch, K the classes, N the pixels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike


def _at_least_float32(x: ArrayLike) -> jax.Array:
  """float32, or float64 where the input is (the float64 reference tests)."""
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def margin_loss(lengths: ArrayLike, labels: ArrayLike, *,
                positive_margin: float = 0.9, negative_margin: float = 0.1,
                negative_weight: float = 0.5, form: str = 'text'
                ) -> jax.Array:
  """Sabour et al. eq. 4 per class, reduced over the classes by ``form``.

  L_k = T_k max(0, m+ - |v_k|)^2 + lambda (1 - T_k) max(0, |v_k| - m-)^2.

  ``form='text'`` (the paper's text): sum_k L_k. ``form='official'`` (the
  official code's ``_margin_loss``, whose batch loss is a mean over the
  batch *and* the classes): 0.5 * mean_k L_k, i.e. the text's value / (2K):
  1/20 of it for 10 classes. With the reconstruction term unchanged
  (0.0005 * the summed squared error in both), the official code weighs
  reconstruction 2K = 20x more, relative to the margin, than the text.

  Args:
    lengths: [B, K] capsule lengths |v_k| (or scores p in [0, 1]).
    labels: [B, K] targets T_k in {0, 1} (several ones allowed: MultiMNIST).
  Returns:
    [B] loss per example. Su's binary loss is
    ``margin_loss(p, y, negative_weight=0.25)``.
  """
  if form not in ('text', 'official'):
    raise ValueError(f"form must be 'text' or 'official', got {form!r}.")
  lengths = _at_least_float32(lengths)
  labels = jnp.asarray(labels, lengths.dtype)
  present = labels * jnp.square(jax.nn.relu(positive_margin - lengths))
  absent = negative_weight * (1.0 - labels) * jnp.square(
      jax.nn.relu(lengths - negative_margin))
  if form == 'official':
    return 0.5 * jnp.mean(present + absent, axis=-1)
  return jnp.sum(present + absent, axis=-1)


def reconstruction_loss(reconstructions: ArrayLike, images: ArrayLike
                        ) -> jax.Array:
  """Sum of squared pixel errors per example (scale it by 0.0005 in CapsNet).

  Args:
    reconstructions: [B, ...] in [0, 1]; images: [B, ...] same size.
  Returns:
    [B].
  """
  reconstructions = _at_least_float32(reconstructions)
  images = jnp.asarray(images, reconstructions.dtype).reshape(
      reconstructions.shape)
  diff = reconstructions - images
  return jnp.sum(jnp.square(diff).reshape(diff.shape[0], -1), axis=-1)


def spread_loss(activations: ArrayLike, labels: ArrayLike, margin: ArrayLike,
                *, class_reduction: str = 'sum') -> jax.Array:
  """Hinton et al. 2018 eq. 3, reduced over the classes by ``class_reduction``.

  L_i = max(0, m - (a_t - a_i))^2 for each class i != t (L_t = 0).

  ``class_reduction='sum'`` (the paper's eq. 3, capsjax): sum_{i != t} L_i.
  ``'mean'`` (the released code: ``layers.optimizer`` takes
  ``tf.reduce_mean`` of its ``order_loss`` over the batch AND the K classes,
  the target's zero term included): (1/K) sum_{i != t} L_i, i.e. the sum /
  K: 1/5 of it on smallNORB, 1/10 on MNIST. Either way the batch mean is the
  caller's.

  Args:
    activations: [B, K] class activations a_i.
    labels: [B] integer target class t.
    margin: scalar m (see ``spread_loss_margin``), taken in the loss's dtype.
    class_reduction: 'sum' or 'mean'.
  Returns:
    [B].
  """
  if class_reduction not in ('sum', 'mean'):
    raise ValueError(f"class_reduction must be 'sum' or 'mean', got "
                     f'{class_reduction!r}.')
  activations = _at_least_float32(activations)
  labels = jnp.asarray(labels)
  # In the loss's dtype: a float64 margin (``spread_loss_margin`` under
  # jax_enable_x64) must not widen a float32 model's loss.
  margin = jnp.asarray(margin, activations.dtype)
  num_classes = activations.shape[-1]
  one_hot = jax.nn.one_hot(labels, num_classes, dtype=activations.dtype)
  target = jnp.sum(activations * one_hot, axis=-1, keepdims=True)
  gaps = jnp.square(jax.nn.relu(margin - (target - activations)))
  total = jnp.sum(gaps * (1.0 - one_hot), axis=-1)
  return total / num_classes if class_reduction == 'mean' else total


def spread_loss_margin(step: ArrayLike, *, schedule: str = 'authors',
                       total_steps: int = 50_000, start: float = 0.2,
                       end: float = 0.9, dtype=None) -> jax.Array:
  """The spread-loss margin m at a training step, a scalar in ``dtype``.

  'linear': m grows linearly from ``start`` to ``end`` over ``total_steps``
  (the paper's words). 'authors': m = 0.2 + 0.79 sigmoid(min(10, step/50000
  - 4)) (the released code; ``total_steps`` is then the 50000 scale).

  ``dtype`` None: JAX's default float, float32, or float64 under
  jax_enable_x64, so that a float64 loss gets a margin computed in float64
  (``spread_loss`` takes it in the loss's dtype).
  """
  if dtype is None:
    dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
  step = jnp.asarray(step, dtype)
  if schedule == 'linear':
    return start + (end - start) * jnp.clip(step / total_steps, 0.0, 1.0)
  if schedule == 'authors':
    return 0.2 + 0.79 * jax.nn.sigmoid(jnp.minimum(10.0,
                                                   step / total_steps - 4.0))
  raise ValueError(f"schedule must be 'linear' or 'authors', got {schedule!r}.")


def cross_entropy_loss(logits: ArrayLike, labels: ArrayLike) -> jax.Array:
  """Softmax cross-entropy, [B, K] logits and [B] integer labels -> [B], in
  float32 or the logits' wider dtype."""
  logits = _at_least_float32(logits)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.take_along_axis(log_probs, jnp.asarray(labels)[:, None],
                              axis=-1)[:, 0]
