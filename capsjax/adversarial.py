"""White-box attacks of Hinton et al. 2018 (section 6): FGSM and BIM.

    loss_fn = adversarial.model_loss_fn(model, config)   # or any pure function
    x_adv = adversarial.fgsm(loss_fn, images, labels, 0.1)
    x_adv = adversarial.bim(loss_fn, images, labels, 0.1, step_size=0.02,
                            num_steps=20)

The attacks are pure and jit-able functions of a per-example loss
``loss_fn(images [B, H, W, C], labels [B]) -> [B]``; ``epsilon`` may be traced
(one compilation for every epsilon). Each example's input gradient is that of
its own loss (the losses are summed, and the models are evaluated without
batch statistics). Pixels live in [``clip_min``, ``clip_max``] = [0, 1].

Which loss the attacker differentiates is the model family's
(``families.of(model).attack_loss``): 'family' is the loss the model was
trained with, without regularisers: the margin loss on capsule lengths for
CapsNet (not the reconstruction term), softmax cross-entropy for the
baseline CNN, Su's binary margin loss for his two-digit models, and for EM
models their spread loss at the final margin (``EMFamily.final_margin``:
m = 0.9 'linear' or 0.99 'authors'). 'cross_entropy' is softmax cross-entropy
over the family's ``class_logits``: the models' logits, or the log-odds of
their scores in [0, 1] (lengths, sigmoid scores, EM activations). The
margin losses are flat at zero for an example classified beyond the margins,
and FGSM then leaves it unchanged (sign(0) = 0): ``zero_gradient_fraction``
measures how often that happens.

Shape legend: B the batch, H x W x C an image, K the classes.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from capsjax import families

LossFn = Callable[[jax.Array, jax.Array], jax.Array]
ATTACKS = ('fgsm', 'bim')


def input_gradient(loss_fn: LossFn, images: ArrayLike, labels: ArrayLike
                   ) -> jax.Array:
  """d loss_fn(images, labels)[b] / d images[b] for every b: [B, H, W, C]."""
  images = jnp.asarray(images)
  images = images.astype(jnp.promote_types(images.dtype, jnp.float32))
  return jax.grad(lambda x: jnp.sum(loss_fn(x, labels)))(images)


def fgsm(loss_fn: LossFn, images: ArrayLike, labels: ArrayLike,
         epsilon: ArrayLike, *, clip_min: float = 0.0,
         clip_max: float = 1.0) -> jax.Array:
  """Fast gradient sign method (Goodfellow et al. 2015).

  Args:
    loss_fn: per-example loss, (images [B, H, W, C], labels [B]) -> [B].
    images: [B, H, W, C] float inputs in [clip_min, clip_max].
    labels: [B] int, the true classes (the loss is increased for them).
    epsilon: scalar L-infinity budget.

  Returns:
    [B, H, W, C]: clip(images + epsilon sign(grad), clip_min, clip_max).
  """
  images = jnp.asarray(images)
  images = images.astype(jnp.promote_types(images.dtype, jnp.float32))
  grad = input_gradient(loss_fn, images, labels)
  return jnp.clip(images + epsilon * jnp.sign(grad), clip_min, clip_max)


def bim(loss_fn: LossFn, images: ArrayLike, labels: ArrayLike,
        epsilon: ArrayLike, *, step_size: float, num_steps: int,
        clip_min: float = 0.0, clip_max: float = 1.0) -> jax.Array:
  """Basic iterative method (Kurakin et al. 2017): projected FGSM steps.

  x_0 = images; x_{t+1} = clip(proj(x_t + step_size sign(grad L(x_t)))),
  where proj clips to the L-infinity ball of radius ``epsilon`` around
  ``images`` and clip to [clip_min, clip_max]. ``num_steps`` is static.

  Args: as ``fgsm``.

  Returns:
    [B, H, W, C] within ``epsilon`` of ``images`` in every pixel.
  """
  images = jnp.asarray(images)
  images = images.astype(jnp.promote_types(images.dtype, jnp.float32))
  if num_steps < 0:
    raise ValueError(f'num_steps must be >= 0, got {num_steps}.')
  low = jnp.maximum(images - epsilon, clip_min)
  high = jnp.minimum(images + epsilon, clip_max)

  def step(_, x):
    grad = input_gradient(loss_fn, x, labels)
    return jnp.clip(x + step_size * jnp.sign(grad), low, high)

  return jax.lax.fori_loop(0, num_steps, step, images)


def attack(name: str, loss_fn: LossFn, images: ArrayLike, labels: ArrayLike,
           epsilon: ArrayLike, *, step_size: float = 0.02,
           num_steps: int = 20) -> jax.Array:
  """``fgsm`` or ``bim`` by name (the BIM options are ignored for FGSM)."""
  if name == 'fgsm':
    return fgsm(loss_fn, images, labels, epsilon)
  if name == 'bim':
    return bim(loss_fn, images, labels, epsilon, step_size=step_size,
               num_steps=num_steps)
  raise ValueError(f'unknown attack {name!r}; one of {ATTACKS}.')


# ----------------------------------------------------------------------------
# Trained models.


def evaluate_attacks(model: nnx.Module, images: ArrayLike, labels: ArrayLike,
                     epsilons: Sequence[float], *,
                     attacks: Sequence[str] = ATTACKS, kind: str = 'family',
                     spread_margin: float = 0.9, step_size: float = 0.02,
                     num_steps: int = 20, batch_size: int = 100
                     ) -> dict[str, Any]:
  """Accuracy of ``model`` under each attack at each epsilon.

  Args:
    model: any capsjax classifier, called as ``model(x, train=False)``; its
      family (``families.of``) gives the loss attacked.
    images: [N, H, W, C], uint8 or float in [0, 1] (what the model sees).
    labels: [N] int.
    epsilons: L-infinity budgets, in pixel units of [0, 1].

  Returns:
    {'clean_accuracy', 'zero_gradient_fraction' (examples whose input
    gradient is exactly zero at the clean input), and per attack a list of
    accuracies, one per epsilon}.
  """
  for name in attacks:
    if name not in ATTACKS:
      raise ValueError(f'unknown attack {name!r}; one of {ATTACKS}.')
  images = np.asarray(images)
  if np.issubdtype(images.dtype, np.integer):
    images = images.astype(np.float32) / 255.0
  labels = np.asarray(labels)
  family = families.of(model)
  graphdef, state = nnx.split(model)

  # The model state is an argument, not a closed-over constant.
  def loss_fn(state, x, y):
    outputs = nnx.merge(graphdef, state)(x, train=False)
    return family.attack_loss(outputs, y, kind=kind,
                              spread_margin=spread_margin)

  def correct(state, x, y):
    outputs = nnx.merge(graphdef, state)(x, train=False)
    return jnp.argmax(outputs['class_scores'], -1) == y

  @jax.jit
  def clean(state, x, y, mask):
    grad = input_gradient(lambda x, y: loss_fn(state, x, y), x, y)
    zero = jnp.all(grad == 0, axis=(1, 2, 3))
    return jnp.sum(correct(state, x, y) * mask), jnp.sum(zero * mask)

  def attacked_correct(name, state, x, y, mask, eps):
    adversarial = attack(name, lambda x, y: loss_fn(state, x, y), x, y, eps,
                         step_size=step_size, num_steps=num_steps)
    return jnp.sum(correct(state, adversarial, y) * mask)

  attacked = jax.jit(attacked_correct, static_argnums=0)
  num = len(labels)
  batch_size = max(1, min(batch_size, num))
  totals = {'clean': 0, 'zero': 0} | {
      (name, e): 0 for name in attacks for e in range(len(epsilons))}
  for start in range(0, num, batch_size):
    idx = np.arange(start, start + batch_size)
    mask = jnp.asarray(idx < num, jnp.float32)
    idx = np.minimum(idx, num - 1)
    x, y = jnp.asarray(images[idx]), jnp.asarray(labels[idx])
    right, zero = clean(state, x, y, mask)
    totals['clean'] += float(right)
    totals['zero'] += float(zero)
    for name in attacks:
      for e, eps in enumerate(epsilons):
        totals[(name, e)] += float(attacked(name, state, x, y, mask,
                                            jnp.float32(eps)))
  out = {'clean_accuracy': totals['clean'] / num,
         'zero_gradient_fraction': totals['zero'] / num}
  for name in attacks:
    out[name] = [totals[(name, e)] / num for e in range(len(epsilons))]
  return out
