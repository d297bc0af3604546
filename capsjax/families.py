"""Model families: what a model's class scores are, and the losses on them.

Every model returns its class scores under one key, ``outputs['class_scores']``
[B, K] (their argmax is the prediction), and declares its family by name
(``FAMILY``). A family owns the rest of what depends on the kind of model:

- what the scores are: 'probabilities' in [0, 1] (capsule lengths, sigmoid
  scores, EM activations) or 'logits', and ``class_logits``, the logits an
  attacker or a cross-entropy reads (the clipped log-odds of probabilities);
- its training loss (``loss``; ``multi_label_loss`` for MultiMNIST, where
  two classes are targets) and the class loss it is built on
  (``class_loss``);
- the loss an attacker increases (``attack_loss``);
- the outputs its losses read (``outputs``, checked by ``check_outputs``
  before a run trains);
- the trainer that makes its train and eval steps, by name
  (``trainer_name``: 'vector_capsules' or 'matrix_capsules', modules of
  ``capsjax.training``, which maps the name to the module: this module
  imports nothing of training).

    family = families.of('capsnet')   # or of(model), of(model class or factory)
    loss, metrics = family.loss(outputs, labels, config, images=images)

The families: 'capsnet' (Sabour et al.'s CapsNet: the margin loss plus the
scaled reconstruction error), 'cnn' (its baseline CNN: softmax
cross-entropy), 'two_digit' (Su's two-digit models: his binary margin loss)
and 'em' (Hinton et al.'s matrix capsules: the spread loss with its growing
margin, or cross-entropy / margin loss for ablations).

Shape legend: B the batch, K the classes, T = 2 digits per MultiMNIST image.
"""

from __future__ import annotations

import abc
import math
import typing
from collections.abc import Mapping
from typing import Any
from typing import ClassVar

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.typing import ArrayLike

from capsjax import losses
from capsjax import models

CLASS_SCORES = 'class_scores'
ATTACK_LOSSES = ('family', 'cross_entropy')
# Keeps the log-odds of probabilities that saturate at 0 or 1 finite.
_SCORE_CLIP = 1e-6


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


class Family(abc.ABC):
  """The knowledge of one kind of model; subclasses fill it in.

  ``name``: as the models' ``FAMILY``. ``scores``: 'probabilities' or
  'logits'. ``score_name``: what one class score is, in words;
  ``class_loss_name``: the attacked class loss, in words. ``outputs``: what
  a model of the family returns for its losses, in words. ``trainer_name``:
  the module of ``capsjax.training`` that trains it.
  """

  name: ClassVar[str]
  scores: ClassVar[str]
  score_name: ClassVar[str]
  class_loss_name: ClassVar[str]
  outputs: ClassVar[str]
  trainer_name: ClassVar[str] = 'vector_capsules'

  def __repr__(self) -> str:
    return f'families.of({self.name!r})'

  def check_outputs(self, outputs: Any, images: tuple[int, ...],
                    num_classes: int | None, model: str) -> None:
    """ValueError, one line naming ``model``, unless ``outputs`` (of
    images [B, H, W, C]: arrays or ``jax.ShapeDtypeStruct``) hold what the
    family's losses read: a dict with float 'class_scores' [B, K], K =
    ``num_classes`` when given."""
    if not isinstance(outputs, Mapping):
      raise ValueError(f'model {model} returned a {type(outputs).__name__}, '
                       f'not a dict; a {self.name!r} model returns '
                       f'{self.outputs}.')
    if CLASS_SCORES not in outputs:
      raise ValueError(f'model {model} returned no {CLASS_SCORES!r} (its '
                       f'outputs: {", ".join(map(str, outputs)) or "none"}); '
                       f'a {self.name!r} model returns {self.outputs}.')
    scores = outputs[CLASS_SCORES]
    shape = tuple(scores.shape)
    if (len(shape) != 2 or shape[0] != images[0]
        or (num_classes and shape[1] != num_classes)):
      expected = f'[{images[0]}, {num_classes or "K"}]'
      raise ValueError(f'model {model}: {CLASS_SCORES!r} has shape {shape} '
                       f'for {images[0]} images of {num_classes or "K"} '
                       f'classes, expected [B, K] = {expected}.')
    if not jnp.issubdtype(scores.dtype, jnp.floating):
      raise ValueError(f'model {model}: {CLASS_SCORES!r} are {scores.dtype}, '
                       f'expected floats ({self.outputs}).')

  def class_logits(self, scores: jax.Array) -> jax.Array:
    """[B, K] logits: the scores themselves, or the log-odds of
    probabilities (clipped to [1e-6, 1 - 1e-6], finite when saturated)."""
    if self.scores == 'logits':
      return scores
    p = jnp.clip(scores, _SCORE_CLIP, 1.0 - _SCORE_CLIP)
    return jnp.log(p) - jnp.log1p(-p)

  @abc.abstractmethod
  def class_loss(self, scores: jax.Array, labels: jax.Array, **options
                 ) -> jax.Array:
    """Per-example loss [B] of class scores [B, K] and int labels [B]."""

  def loss(self, outputs: dict[str, jax.Array], labels: jax.Array,
           config: ml_collections.ConfigDict, *,
           images: jax.Array | None = None, step: ArrayLike = 0
           ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-example training loss [B] and metrics of one batch.

    Args:
      outputs: the model's dict ('class_scores' [B, K], and what else the
        family's loss reads).
      labels: [B] int32.
      config: the run's config (the loss options).
      images: [B, H, W, C] float inputs (reconstruction targets).
      step: the optimizer step (the EM margin schedule).
    """
    del config, images, step
    return self.class_loss(outputs[CLASS_SCORES], labels), {}

  def multi_label_loss(self, outputs: dict[str, jax.Array], labels: jax.Array,
                       config: ml_collections.ConfigDict, *,
                       digits: jax.Array | None = None
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-example loss [B] and metrics with T classes as targets
    (MultiMNIST): ``labels`` int [B, T]; ``digits`` [B, T, S, S, 1], each
    digit alone (the targets of 'digit_reconstructions' [B, T, N])."""
    raise ValueError(f'{self.name!r} models do not train on MultiMNIST.')

  def attack_loss(self, outputs: dict[str, jax.Array], labels: ArrayLike, *,
                  kind: str = 'family', spread_margin: float = 0.9
                  ) -> jax.Array:
    """Per-example loss [B] an attacker increases (``capsjax.adversarial``).

    ``kind='family'``: the class loss the model was trained with, without
    regularisers (no reconstruction term) and with its default options;
    ``'cross_entropy'``: softmax cross-entropy over ``class_logits``.
    ``spread_margin``: the spread-loss margin of the 'em' family.
    """
    labels = jnp.asarray(labels)
    scores = outputs[CLASS_SCORES]
    if kind == 'cross_entropy':
      return losses.cross_entropy_loss(self.class_logits(scores), labels)
    if kind != 'family':
      raise ValueError(f'unknown attack loss {kind!r}; one of {ATTACK_LOSSES}.')
    return self._attack_class_loss(scores, labels, spread_margin)

  def _attack_class_loss(self, scores: jax.Array, labels: jax.Array,
                         spread_margin: float) -> jax.Array:
    del spread_margin
    return self.class_loss(scores, labels)

  def attack_options(self, config: ml_collections.ConfigDict, kind: str
                     ) -> tuple[str, float]:
    """(kind, spread_margin) of ``attack_loss`` that attack a model trained
    with ``config`` with its own loss (``kind='family'``) or cross-entropy."""
    del config
    return kind, 0.9

  def attack_loss_name(self, kind: str, spread_margin: float) -> str:
    """In words, the loss ``attack_loss`` differentiates."""
    del spread_margin
    if kind == 'cross_entropy':
      return ('softmax cross-entropy on logits' if self.scores == 'logits'
              else 'softmax cross-entropy on the log-odds of the class scores')
    return self.class_loss_name


class CapsNetFamily(Family):
  """Sabour et al.'s CapsNet: scores are capsule lengths."""

  name = 'capsnet'
  scores = 'probabilities'
  score_name = 'capsule length'
  class_loss_name = 'margin loss on capsule lengths (no reconstruction term)'
  outputs = ("'class_scores' [B, K], capsule lengths in [0, 1] (the margin "
             "loss), and with a decoder 'reconstructions' [B, H*W*C] in [0, "
             '1], the input images rebuilt from the capsules masked by the '
             'labels the model is called with in training')

  def check_outputs(self, outputs, images, num_classes, model):
    """Also: 'reconstructions', when returned, as many values per image
    as the images have pixels."""
    super().check_outputs(outputs, images, num_classes, model)
    if 'reconstructions' not in outputs:
      return
    shape = tuple(outputs['reconstructions'].shape)
    if not shape or shape[0] != images[0] or (
        math.prod(shape[1:]) != math.prod(images[1:])):
      raise ValueError(
          f"model {model}: 'reconstructions' has shape {shape} for images "
          f'{tuple(images)}, expected [B, H*W*C] = [{images[0]}, '
          f'{math.prod(images[1:])}] (the reconstruction loss compares them '
          f'with the input images).')

  def class_loss(self, scores, labels, *, form: str = 'text'):
    """The margin loss (``losses.margin_loss``, its ``form``)."""
    return losses.margin_loss(scores, jax.nn.one_hot(labels, scores.shape[-1]),
                              form=form)

  def loss(self, outputs, labels, config, *, images=None, step=0):
    """The margin loss (``config.loss_form``) plus
    ``config.reconstruction_weight`` times the reconstruction error when the
    model has a decoder ('reconstructions')."""
    del step
    loss = self.class_loss(outputs[CLASS_SCORES], labels,
                           form=config.loss_form)
    metrics = {'margin_loss': jnp.mean(loss)}
    if 'reconstructions' in outputs:
      reconstruction = losses.reconstruction_loss(outputs['reconstructions'],
                                                  images)
      metrics['reconstruction_loss'] = jnp.mean(reconstruction)
      loss = loss + config.reconstruction_weight * reconstruction
    return loss, metrics

  def multi_label_loss(self, outputs, labels, config, *, digits=None):
    """The margin loss with T_k = 1 for each of the T classes, plus
    ``config.reconstruction_weight`` times the reconstruction error summed
    over the T digits, each reconstruction against its own digit's image."""
    scores = outputs[CLASS_SCORES]
    loss = losses.margin_loss(scores, multi_hot(labels, scores.shape[-1]),
                              form=config.loss_form)
    metrics = {'margin_loss': jnp.mean(loss)}
    if 'digit_reconstructions' in outputs:
      per_digit = [losses.reconstruction_loss(
          outputs['digit_reconstructions'][:, t], digits[:, t])
                   for t in range(labels.shape[-1])]
      reconstruction = sum(per_digit)
      metrics['reconstruction_loss'] = jnp.mean(reconstruction)
      loss = loss + config.reconstruction_weight * reconstruction
    return loss, metrics


class CNNFamily(Family):
  """The baseline CNN: scores are logits."""

  name = 'cnn'
  scores = 'logits'
  score_name = 'logit'
  class_loss_name = 'softmax cross-entropy on logits'
  outputs = "'class_scores' [B, K], logits (softmax cross-entropy)"

  def class_loss(self, scores, labels):
    """Softmax cross-entropy."""
    return losses.cross_entropy_loss(scores, labels)

  def multi_label_loss(self, outputs, labels, config, *, digits=None):
    """Sigmoid cross-entropy summed over the K independent classes."""
    del config, digits
    scores = outputs[CLASS_SCORES]
    targets = multi_hot(labels, scores.shape[-1])
    return jnp.sum(optax.sigmoid_binary_cross_entropy(scores, targets),
                   -1), {}


class TwoDigitFamily(CapsNetFamily):
  """Su's two-digit models: scores are capsule lengths (TwoDigitCapsNet) or
  sigmoid scores (TwoDigitBaseline), K independent binary problems. On
  MultiMNIST they take the CapsNet's multi-label loss."""

  name = 'two_digit'
  score_name = 'score'
  class_loss_name = "Su's binary margin loss on the scores"
  outputs = ("'class_scores' [B, K], scores in [0, 1] (Su's binary margin "
             'loss)')

  def class_loss(self, scores, labels):
    """Su's binary loss: y relu(0.9 - p)^2 + 0.25 (1 - y) relu(p - 0.1)^2."""
    return losses.margin_loss(scores, jax.nn.one_hot(labels, scores.shape[-1]),
                              negative_weight=0.25)

  def loss(self, outputs, labels, config, *, images=None, step=0):
    del config, images, step
    return self.class_loss(outputs[CLASS_SCORES], labels), {}


class EMFamily(Family):
  """Hinton et al.'s matrix capsules with EM routing: scores are class
  activations."""

  name = 'em'
  scores = 'probabilities'
  score_name = 'activation'
  class_loss_name = 'spread loss'
  outputs = "'class_scores' [B, K], class activations in [0, 1] (the spread loss)"
  trainer_name = 'matrix_capsules'

  CLASS_LOSSES: ClassVar[tuple[str, ...]] = ('spread', 'cross_entropy',
                                             'margin')

  def class_loss(self, scores, labels, *, loss: str = 'spread',
                 margin: ArrayLike = 0.9, class_reduction: str = 'sum'):
    """``loss``: 'spread' (``losses.spread_loss`` at ``margin``, reduced
    over the classes by ``class_reduction``), 'cross_entropy' (over
    ``class_logits``) or 'margin' (``losses.margin_loss``)."""
    if loss == 'spread':
      return losses.spread_loss(scores, labels, margin,
                                class_reduction=class_reduction)
    if loss == 'cross_entropy':
      return losses.cross_entropy_loss(self.class_logits(scores), labels)
    if loss == 'margin':
      return losses.margin_loss(scores,
                                jax.nn.one_hot(labels, scores.shape[-1]))
    raise ValueError(f"config.loss must be 'spread', 'cross_entropy' or "
                     f"'margin', got {loss!r}.")

  def loss(self, outputs, labels, config, *, images=None, step=0):
    """``config.loss`` at the margin of ``step`` on ``config``'s schedule
    (``config.margin_schedule``, ``margin_steps``,
    ``spread_class_reduction``). The L2 penalty is on the parameters, not
    the outputs: the trainer adds it (``training.matrix_capsules.l2_penalty``)."""
    del images
    margin = 0.0
    if config.loss == 'spread':
      margin = losses.spread_loss_margin(
          step, schedule=config.margin_schedule,
          total_steps=config.margin_steps)
    return self.class_loss(
        outputs[CLASS_SCORES], labels, loss=config.loss, margin=margin,
        class_reduction=config.spread_class_reduction), {}

  def _attack_class_loss(self, scores, labels, spread_margin):
    return self.class_loss(scores, labels, margin=spread_margin)

  @staticmethod
  def final_margin(config: ml_collections.ConfigDict) -> float:
    """The spread-loss margin a run in ``config`` ends its schedule with."""
    return float(losses.spread_loss_margin(
        10**9, schedule=config.margin_schedule,
        total_steps=config.margin_steps))

  def attack_options(self, config, kind):
    """The spread loss at the run's final margin; a run trained on
    cross-entropy is attacked with it."""
    if kind == 'family' and config.loss == 'cross_entropy':
      kind = 'cross_entropy'
    return kind, self.final_margin(config)

  def attack_loss_name(self, kind, spread_margin):
    if kind == 'family':
      return f'spread loss at the final margin {spread_margin:.2f}'
    return super().attack_loss_name(kind, spread_margin)


_FAMILIES: dict[str, Family] = {
    family.name: family for family in (CapsNetFamily(), CNNFamily(),
                                       TwoDigitFamily(), EMFamily())}


def names() -> tuple[str, ...]:
  """The families' names, sorted."""
  return tuple(sorted(_FAMILIES))


def of(model: str | nnx.Module | Any) -> Family:
  """The family of a model: a name or 'module:Class' path
  (``models.model_class``), a model, a model class, or a model factory
  function, whose return annotation names its class. Each class declares
  it as ``FAMILY``; ValueError (one line: the families and the outputs
  each reads) for an unknown name or a model that declares none."""
  if isinstance(model, str):
    model = models.model_class(model)
  if isinstance(model, nnx.Module):
    model = type(model)
  owner = model if isinstance(model, type) else _returned_class(model)
  name = getattr(owner, 'FAMILY', None)
  if name not in _FAMILIES:
    what = getattr(model, '__qualname__', repr(model))
    where = ('' if owner is model else
             f' (a factory: the class its return annotation names, '
             f'{getattr(owner, "__qualname__", "none")})')
    raise ValueError(
        f'{what}{where} declares no model family (FAMILY = {name!r}); set the '
        f'class attribute FAMILY to the family whose losses train it: '
        + '; '.join(f'{f.name!r}: {f.outputs}' for f in _FAMILIES.values())
        + '.')
  return _FAMILIES[name]


def _returned_class(factory: Any) -> type | None:
  """The class a model factory's return annotation names (None if none
  resolves)."""
  try:
    returned = typing.get_type_hints(factory).get('return')
  except Exception:  # noqa: BLE001 - an unresolvable annotation names none
    return None
  return returned if isinstance(returned, type) else None


__all__ = (
    'ATTACK_LOSSES',
    'CLASS_SCORES',
    'CNNFamily',
    'CapsNetFamily',
    'EMFamily',
    'Family',
    'TwoDigitFamily',
    'multi_hot',
    'names',
    'of',
    'top_k_correct',
)
