"""Capsule networks and their baselines, chosen by name from a registry.

    model = create_model('capsnet', rngs=nnx.Rngs(0), num_iterations=1)
    out = model(images, labels, train=True)   # a dict of arrays

Every model is called as ``model(images [B, H, W, C] float32, labels=None, *,
train=False) -> dict``. ``labels`` is int [B] or multi-hot float [B, K]; only
models with a reconstruction decoder use it. Experiments use
``create_model``, ``list_models`` and ``count_params``; they never import the
classes. Every model returns its class scores [B, K] (their argmax is the
prediction) under ``'class_scores'`` and names its family (``FAMILY``:
``capsjax.families`` owns what its scores are, its losses and its trainer).

A model of yours goes through the same registry: ``register(name, cls)``,
or ``create_model('my_package.my_models:MyCapsNet', ...)`` (a
'module:QualName' path, imported); its contract: docs/own_model.md.

Parameter counts (``count_params``, default options):
- 'capsnet' 28x28x1: 8,215,728 = conv1 20,992 + primary 5,308,672 + digit W
  1,474,560 + digit bias 160 + decoder 1,411,344 (8,215,568 with
  ``use_bias=False``; 6,804,384 without the decoder).
- 'baseline_cnn' 28x28x1: 35,445,522 (layout in ``BaselineCNN``).
- 'efficient_capsnet' 28x28x1: 1,573,168 = 161,824 (the paper's count) +
  decoder 1,411,344 (layout in ``EfficientCapsNet``).
- 'matrix_capsnet' 32x32x1: A=B=C=D=32 316,394; A=64, B=8, C=D=16 67,154
  (paper: about 310K and 68K; what is counted is in ``MatrixCapsNet``).
- 'two_digit_baseline' 276,810; 'two_digit_capsnet' 279,488 (any input size).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from capsjax import layers
from capsjax import nn
from capsjax import routing
from capsjax.kernels import conv as conv_lib
from capsjax.kernels import implementations
from capsjax.layers import check_positive_int as _check_positive_int
from capsjax.routing import votes as votes_lib
from capsjax.study import RoutingStudyNet


def _check_widths(name: str, widths) -> tuple[int, ...]:
  if isinstance(widths, int) or not isinstance(widths, Sequence):
    raise ValueError(f'{name} must be a sequence of positive ints, got '
                     f'{widths!r}.')
  for width in widths:
    _check_positive_int(f'every entry of {name}', width)
  return tuple(widths)


def _check_input_shape(input_shape) -> tuple[int, int, int]:
  if (not isinstance(input_shape, Sequence) or len(input_shape) != 3):
    raise ValueError(
        f'input_shape must be (height, width, channels), got {input_shape!r}.')
  for value in input_shape:
    _check_positive_int('every entry of input_shape', value)
  return tuple(input_shape)


def _check_images(images: ArrayLike, channels: int,
                  spatial: tuple[int, int] | None, dtype) -> jax.Array:
  """[B, H, W, C] images of the parameters' ``dtype``, or a ValueError."""
  images = jnp.asarray(images)
  if images.ndim != 4 or images.shape[-1] != channels or (
      spatial is not None and images.shape[1:3] != tuple(spatial)):
    expected = (f'[B, {spatial[0]}, {spatial[1]}, {channels}]' if spatial
                else f'[B, H, W, {channels}]')
    raise ValueError(f'images must be {expected}, got shape {images.shape}.')
  if images.dtype != dtype:
    # uint8 pixels would otherwise reach the model as 0..255, and another
    # float dtype fails deep in the first convolution.
    hint = ('' if jnp.issubdtype(images.dtype, jnp.floating) else
            '; capsjax.data.to_float converts uint8')
    raise ValueError(
        f'images must be {jnp.dtype(dtype).name} (the dtype of the model\'s '
        f'parameters), pixels in [0, 1], got {images.dtype}{hint}.')
  return images


def _lengths(capsules: jax.Array) -> jax.Array:
  """[..., D] -> float32 [...]: from bfloat16 capsules too, so that class
  scores near 1 do not tie at bfloat16's spacing (2^-8 there)."""
  capsules = capsules.astype(jnp.promote_types(capsules.dtype, jnp.float32))
  return routing.safe_norm(capsules, axis=-1)


class _MLP(nnx.Module):
  """Dense layers, ReLU between them: [B, in] -> [B, widths[-1]]."""

  def __init__(self, in_features: int, widths: Sequence[int], *,
               kernel_init=nn.lecun_normal, bias_init: float = 0.0,
               last_kernel_init=None, rngs: nnx.Rngs):
    sizes = (in_features,) + tuple(widths)
    bias = nnx.initializers.constant(bias_init)
    inits = [kernel_init] * len(widths)
    if last_kernel_init is not None:  # Efficient-CapsNet's decoder output
      inits[-1] = last_kernel_init
    # conv_lib.dot_general: a large bfloat16 layer (the baseline CNN's first
    # dense layer) runs through oneDNN's matmul, XLA:CPU's being slow there.
    self.layers = nnx.List([nnx.Linear(a, b, kernel_init=init,
                                       bias_init=bias,
                                       dot_general=conv_lib.dot_general,
                                       rngs=rngs)
                            for a, b, init in zip(sizes[:-1], sizes[1:], inits,
                                                  strict=True)])

  def __call__(self, x: jax.Array) -> jax.Array:
    for i, layer in enumerate(self.layers):
      x = layer(x)
      if i < len(self.layers) - 1:
        x = jax.nn.relu(x)
    return x


# ----------------------------------------------------------------------------
# Sabour et al. 2017.


class CapsNet(nnx.Module):
  """CapsNet (Sabour et al. 2017): Conv1, PrimaryCaps, DigitCaps, decoder.

  Conv1 ReLU (stride 1) -> PrimaryCapsules (stride 2) -> DenseCapsules with
  dynamic routing and the official learned bias -> optional decoder FC 512
  ReLU -> FC 1024 ReLU -> FC H*W*C sigmoid. Both convolutions take
  ``padding``: 'VALID' (the paper's MNIST model) or 'SAME' (the official
  code's CIFAR-10 model, ``padding=SAME`` in its README's command: 24x24
  inputs keep a 24x24 Conv1 grid and a 12x12 primary grid).
  ``implementation``: how its convolutions and routing run
  (``capsjax.kernels.implementations``): None, the fastest of each; 'xla';
  'native' (oneDNN's convolutions); 'pallas' (DigitCaps' routing by the
  fused kernels of ``capsjax.kernels.pallas_dynamic``).

  ``form`` picks what the primary capsules compute and how the layers start:
  - 'official': the official code's model (Sarasra/models,
    research/capsules), which produced the paper's numbers. Primary capsules
    squash(conv(x) / 32 + b) (one routing iteration over a single input:
    ``layers.PrimaryCapsules``); TF truncated-normal initialisers, std 0.05
    for Conv1 and 0.1 for the primary kernel, the capsule transforms and the
    decoder, every bias 0.1; ``leaky`` routing in both capsule layers.
    Its loss is ``losses.margin_loss(form='official')``.
  - 'text' (the default): the paper's text. Primary capsules squash(conv(x)
    + b); LeCun-normal kernels and zero biases for the convolutions and the
    decoder (the capsule transforms as above); ``leaky`` in DigitCaps only.

  Returns {'class_scores': [B, K] capsule lengths, 'capsules': [B, K,
  digit_dim], 'coupling': [B, I, K] (I primary capsules), 'primary_lengths':
  [B, I] (the primary capsules' lengths, which scale their votes), and with
  ``reconstruction`` 'reconstructions': [B, H*W*C]}. The decoder sees only
  the label's capsule when ``train`` and labels are given (a multi-hot [B,
  K] label keeps several), else only the longest capsule.
  """

  FAMILY: ClassVar[str] = 'capsnet'

  def __init__(self, *, input_shape: Sequence[int] = (28, 28, 1),
               num_classes: int = 10, conv1_channels: int = 256,
               conv1_kernel: int = 9, primary_types: int = 32,
               primary_dim: int = 8, primary_kernel: int = 9,
               primary_stride: int = 2, digit_dim: int = 16,
               num_iterations: int = 3, accumulate: bool = True,
               leaky: bool = False, squash_constant: float = 1.0,
               use_bias: bool = True, reconstruction: bool = True,
               decoder_widths: Sequence[int] = (512, 1024),
               form: str = 'text', padding: str = 'VALID',
               implementation: str | None = None, rngs: nnx.Rngs):
    height, width, channels = _check_input_shape(input_shape)
    implementations.check(implementation)
    conv_implementation = implementations.for_op(implementation, 'conv2d')
    # Named here, not by the layer's own argument names.
    for name, value in (('num_classes', num_classes),
                        ('conv1_channels', conv1_channels),
                        ('conv1_kernel', conv1_kernel),
                        ('primary_types', primary_types),
                        ('primary_dim', primary_dim),
                        ('primary_kernel', primary_kernel),
                        ('primary_stride', primary_stride),
                        ('digit_dim', digit_dim)):
      _check_positive_int(name, value)
    if form not in layers.FORMS:
      raise ValueError(f'form must be one of {layers.FORMS}, got {form!r}.')
    self.input_shape = (height, width, channels)
    self.num_classes = num_classes
    self.form = form
    if form == 'official':
      init = {'kernel_init': nn.truncated_normal_init(
          layers.OFFICIAL_WEIGHT_STD), 'bias_init': layers.OFFICIAL_BIAS_INIT}
      conv1_init = init | {'kernel_init': nn.truncated_normal_init(
          layers.OFFICIAL_CONV1_STD)}
    else:
      init = conv1_init = {}
    self.conv1 = layers.Conv2D(channels, conv1_channels, conv1_kernel, 1,
                               padding=padding,
                               implementation=conv_implementation, rngs=rngs,
                               **conv1_init)
    grid = (self.conv1.output_size(height), self.conv1.output_size(width))
    self.primary = layers.PrimaryCapsules(
        conv1_channels, primary_types, primary_dim, primary_kernel,
        primary_stride, implementation=conv_implementation, form=form,
        leaky=leaky,
        padding=padding, rngs=rngs, **init)
    num_primary = self.primary.num_capsules(*grid)
    self.digit = layers.DenseCapsules(
        num_primary, primary_dim, num_classes, digit_dim, num_iterations,
        accumulate=accumulate, leaky=leaky, squash_constant=squash_constant,
        use_bias=use_bias,
        implementation=implementations.for_op(implementation,
                                              'dynamic_routing'),
        rngs=rngs)
    if reconstruction:
      widths = _check_widths('decoder_widths', decoder_widths)
      self.decoder = _MLP(num_classes * digit_dim,
                          widths + (height * width * channels,), rngs=rngs,
                          **init)
    else:
      self.decoder = None

  def decoder_mask(self, lengths: jax.Array, labels: ArrayLike | None,
                   train: bool) -> jax.Array:
    """[B, K] mask of the capsules the decoder sees."""
    if train and labels is not None:
      labels = jnp.asarray(labels)
      if labels.ndim == 1:
        return jax.nn.one_hot(labels, self.num_classes, dtype=lengths.dtype)
      if labels.shape != lengths.shape:
        raise ValueError(
            f'labels must be int [B] or multi-hot [B, {self.num_classes}], got '
            f'shape {labels.shape}.')
      return labels.astype(lengths.dtype)
    return jax.nn.one_hot(jnp.argmax(lengths, axis=-1), self.num_classes,
                          dtype=lengths.dtype)

  def reconstruct_digits(self, capsules: jax.Array, classes: ArrayLike
                         ) -> jax.Array:
    """Each of T digits decoded from its own capsule alone (MultiMNIST).

    Sabour et al. section 6: with two overlapping digits, the decoder
    reconstructs each digit from its own DigitCaps output, every other
    capsule masked; one decoder pass per digit.

    Args:
      capsules: [B, K, D] DigitCaps outputs.
      classes: int [B, T], the capsule each reconstruction keeps (the two
        labels in training; the two longest capsules at test time).
    Returns:
      [B, T, H*W*C] in (0, 1): entry t is the decoder applied to the
      capsules masked to class ``classes[:, t]``.
    """
    if self.decoder is None:
      raise ValueError('this CapsNet has no decoder (reconstruction=False).')
    classes = jnp.asarray(classes)
    if (classes.ndim != 2 or classes.shape[0] != capsules.shape[0]
        or not jnp.issubdtype(classes.dtype, jnp.integer)):
      raise ValueError(f'classes must be int [B, T] with B = '
                       f'{capsules.shape[0]}, got {classes.dtype} '
                       f'{classes.shape}.')
    b, t = classes.shape
    mask = jax.nn.one_hot(classes, self.num_classes, dtype=capsules.dtype)
    masked = capsules[:, None] * mask[..., None]  # [B, T, K, D]
    decoded = self.decoder(masked.reshape(b * t, -1))
    return jax.nn.sigmoid(decoded).reshape(b, t, -1)

  def __call__(self, images: ArrayLike, labels: ArrayLike | None = None, *,
               train: bool = False) -> dict[str, jax.Array]:
    images = _check_images(images, self.input_shape[2], self.input_shape[:2],
                           self.conv1.kernel.dtype)
    features = jax.nn.relu(self.conv1(images))
    primary = self.primary(features)  # [B, I, primary_dim]
    return _class_capsule_outputs(self, primary, labels, train)


def _class_capsule_outputs(model: nnx.Module, primary: jax.Array,
                           labels: ArrayLike | None, train: bool
                           ) -> dict[str, jax.Array]:
  """A vector-capsule model's outputs from its primary capsules [B, I, P]:
  its ``digit`` layer's class capsules [B, K, D] and couplings [B, I, K],
  their lengths as the class scores, and with a ``decoder`` the
  reconstruction from the masked capsules (``decoder_mask``)."""
  capsules, coupling = model.digit(primary)
  lengths = _lengths(capsules)
  out = {'class_scores': lengths, 'capsules': capsules, 'coupling': coupling,
         'primary_lengths': routing.safe_norm(primary, axis=-1)}
  if model.decoder is not None:
    # The mask (0s and 1s) in the capsules' dtype: a float32 mask (the
    # lengths') would promote a bfloat16 decoder to float32.
    mask = model.decoder_mask(lengths, labels, train).astype(capsules.dtype)
    masked = (capsules * mask[..., None]).reshape(capsules.shape[0], -1)
    out['reconstructions'] = jax.nn.sigmoid(model.decoder(masked))
  return out


class BaselineCNN(nnx.Module):
  """The baseline CNN of Sabour et al. 2017 (35.4M parameters on MNIST).

  Three ReLU convolutions (256, 256, 128 channels, 5x5, stride 1, 'SAME'
  padding, no pooling) -> flatten -> FC 328 ReLU -> FC 192 ReLU -> dropout ->
  FC K logits (softmax cross-entropy outside). This layout is the one whose
  count matches the paper's 35.4M on 28x28x1 inputs: 6,656 + 1,638,656 +
  819,328 (convs) + 32,915,784 (FC 328 on 28*28*128 inputs) + 63,168 +
  1,930 = 35,445,522; pooling would shrink the FC 328 layer far below that.

  Returns {'class_scores': [B, K] logits}. Dropout draws from the model's
  own 'dropout' stream (``rngs``), only when ``train=True``.
  """

  FAMILY: ClassVar[str] = 'cnn'

  def __init__(self, *, input_shape: Sequence[int] = (28, 28, 1),
               num_classes: int = 10,
               conv_channels: Sequence[int] = (256, 256, 128),
               kernel_size: int = 5, padding: str = 'SAME',
               fc_widths: Sequence[int] = (328, 192),
               dropout_rate: float = 0.5, rngs: nnx.Rngs):
    height, width, channels = _check_input_shape(input_shape)
    _check_positive_int('num_classes', num_classes)
    _check_positive_int('kernel_size', kernel_size)
    conv_channels = _check_widths('conv_channels', conv_channels)
    fc_widths = _check_widths('fc_widths', fc_widths)
    if not 0.0 <= dropout_rate < 1.0:
      raise ValueError(f'dropout_rate must be in [0, 1), got {dropout_rate!r}.')
    self.input_shape = (height, width, channels)
    sizes = (channels,) + conv_channels
    self.convs = nnx.List([
        layers.Conv2D(a, b, kernel_size, 1, padding=padding, rngs=rngs)
        for a, b in zip(sizes[:-1], sizes[1:], strict=True)])
    for conv in self.convs:
      height, width = conv.output_size(height), conv.output_size(width)
    self.hidden = _MLP(height * width * conv_channels[-1], fc_widths,
                       rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
    self.head = nnx.Linear(fc_widths[-1], num_classes,
                           kernel_init=nn.lecun_normal, rngs=rngs)

  def __call__(self, images: ArrayLike, labels: ArrayLike | None = None, *,
               train: bool = False) -> dict[str, jax.Array]:
    del labels  # No decoder.
    x = _check_images(images, self.input_shape[2], self.input_shape[:2],
                      self.convs[0].kernel.dtype)
    for conv in self.convs:
      x = jax.nn.relu(conv(x))
    x = jax.nn.relu(self.hidden(x.reshape(x.shape[0], -1)))
    x = self.dropout(x, deterministic=not train)
    return {'class_scores': self.head(x)}


# ----------------------------------------------------------------------------
# Hinton, Sabour, Frosst 2018.


def _em_layer_inits(init: str, transform_std: float | None
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
  """The conv and class capsule layers' initialisation keyword arguments."""
  if init not in ('paper', 'authors'):
    raise ValueError(f"init must be 'paper' or 'authors', got {init!r}.")
  if transform_std is not None and not transform_std > 0:
    raise ValueError(f'transform_std must be > 0, got {transform_std!r}.')
  if init == 'authors':
    if transform_std is not None:
      raise ValueError("transform_std applies to init='paper' only; the "
                       "authors' init fixes its own stds.")
    return layers.AUTHORS_CONV_INIT, layers.AUTHORS_CLASS_INIT
  return {'transform_std': transform_std}, {'transform_std': transform_std}


def _em_layer_routings(
    em_routing: str | routing.EMRouting,
    overrides: Mapping[str, Any] | None, caps1_iterations: int,
    class_inverse_temperature, class_lambda_scale: float
) -> tuple[routing.EMRouting, routing.EMRouting, routing.EMRouting]:
  """(ConvCaps2's, ConvCaps1's, the class layer's) routing: ``em_routing``
  (a preset's name or an ``EMRouting``) with ``overrides``; ConvCaps1 with
  its own iterations, the class layer with its own inverse temperature."""
  conv = routing.em_routing_with(em_routing, overrides)
  if (isinstance(caps1_iterations, bool) or
      not isinstance(caps1_iterations, int) or caps1_iterations < 0):
    raise ValueError(f'caps1_iterations must be a positive int (or 0: '
                     f'num_iterations), got {caps1_iterations!r}.')
  caps1 = dataclasses.replace(
      conv, num_iterations=caps1_iterations or conv.num_iterations)
  if not class_lambda_scale > 0:
    raise ValueError(f'class_lambda_scale must be > 0, got '
                     f'{class_lambda_scale!r}.')
  if class_inverse_temperature is None:
    class_inverse_temperature = _scaled_inverse_temperature(
        conv.inverse_temperature, class_lambda_scale, conv.num_iterations)
  return conv, caps1, dataclasses.replace(
      conv, inverse_temperature=class_inverse_temperature)


def _scaled_inverse_temperature(inverse_temperature, scale: float,
                                num_iterations: int):
  """``scale`` times an EM layer's lambda (None: the authors' schedule)."""
  if scale == 1.0:
    return inverse_temperature
  if inverse_temperature is None:
    return routing.inverse_temperature_schedule(
        num_iterations, scale * routing.FINAL_INVERSE_TEMPERATURE)
  return scale * np.asarray(inverse_temperature, np.float64)


class MatrixCapsNet(nnx.Module):
  """Matrix capsules with EM routing (Hinton et al. 2018, Figure 1).

  ReLU Conv1 A@5x5 stride 2 (VALID) -> MatrixPrimaryCapsules B (1x1) ->
  ConvCapsules C (K=3, stride 2) -> ConvCapsules D (K=3, stride 1) ->
  ClassCapsules K (shared transforms, coordinate addition). Grids: 32x32 ->
  14 -> 14 -> 6 -> 4 -> classes (smallNORB crops); 28x28 -> 12 -> 5 -> 3.

  Parameters counted: Conv1 kernel + bias (25 in_ch A + A); primary pose
  and activation 1x1 kernels + biases (A*17B + 17B); each conv capsule layer
  9 * in * out * 16 transforms + beta_u, beta_a per output type; class layer
  D*K*16 + 2K. 32x32x1 gives 316,394 for A=B=C=D=32 (paper "310K") and
  67,154 for A=64, B=8, C=D=16 (paper "68K").

  The released code (google-research ``capsule_em``) and the paper's text
  differ in the places below; each is an option, and the ``:authors``
  config variants set them all (``tests/test_released_em.py`` checks them
  against float64 references written from that code).

  ``coordinate_form``: what coordinate addition adds to the class votes:
  'grid', each position's (h + 0.5) / H of the last grid on entries (0, 1)
  = (row, column); 'authors', its receptive field's centre in input pixels,
  centred and divided by 100 (``votes.authors_coordinates``), row on entry
  0; 'released', those centres with the column on entry 0 and the row on
  entry 1, as the released code's ``conv_pos`` leaves them.

  ``primary_form``: 'paper' (pose and activation kernels with biases),
  'released' (sigmoid(logit - 1), no biases, the pose channels and then
  the activation logits, as capsule_em reads them from 2020 on) or
  'released_2019' (the same kernel read as P*P + 1 channels per type, as
  the code first released did; ``MatrixPrimaryCapsules``).

  ``em_routing``: every EM layer's routing, a ``routing.EMRouting`` or
  the name of one of ``routing.EM_ROUTING_PRESETS`` ('paper', 'authors',
  'released', 'capsjax'), its fields replaced by those in
  ``em_routing_overrides`` (docs/em_routing_options.md). 'released' routes
  every EM layer as the released slow path (``routing.RELEASED_EM``: the
  padded mass, and in conv capsules its E-step normaliser, each (child,
  parent type) over the windows that cover the child, windows indexed as
  if the stride were 1; the field ``true_stride`` corrects that indexing
  in the stride-2 ConvCaps1).

  ``init='paper'`` (the paper prints none): transforms normal std 1/2 =
  1/sqrt(pose side), or ``transform_std``, beta_u = beta_a = 0.
  ``init='authors'``: the released code's TF truncated normals, std 0.3 /
  beta 0.5 (conv capsules), std 0.01 / beta_a 1.0, beta_u 2.0 (class
  capsules), and Conv1 std 0.05 with bias 0.1. ``caps1_iterations`` > 0
  overrides the routing's ``num_iterations`` in ConvCaps1 (the largest
  routing, most of a CPU training step); ``class_inverse_temperature``
  overrides its ``inverse_temperature`` in the class layer, and without it
  ``class_lambda_scale`` multiplies the other layers' lambda there (the
  released code: 0.25, final lambda / 4).

  ``window_chunk``: how many windows each conv capsule layer routes at a
  time (``matrix_capsules.conv_capsule_routing``): None, on a CPU chunks
  of about ``matrix_capsules.WINDOW_CHUNK_BYTES`` of votes recomputed in the
  backward pass (far less memory, and faster: the chunk stays in cache), on an
  accelerator all at once; 0 all at once; N that many.
  ``implementation``: how its convolution and conv capsule routing run
  (``capsjax.kernels.implementations``): None, the fastest of each (on a
  CPU the fused routing kernel, ``capsjax.kernels.em_cpu``, where it
  applies and ``window_chunk`` is None); 'xla'; 'native' (that kernel and
  oneDNN's convolution); 'pallas' (the Pallas GPU routing kernel
  ``capsjax.kernels.pallas_em``, never picked by default).

  Returns {'class_scores': [B, K] class activations, 'poses': [B, K, 4, 4],
  and the class layer's routing: 'assignments' [B, I, K] (I = h * w * D
  ConvCaps2 capsules, ordered (row, column, type)) and
  'class_input_activations' [B, I]}.
  """

  FAMILY: ClassVar[str] = 'em'

  def __init__(self, *, input_shape: Sequence[int] = (32, 32, 1),
               num_classes: int = 5, A: int = 32, B: int = 32, C: int = 32,
               D: int = 32, em_routing: str | routing.EMRouting = 'paper',
               em_routing_overrides: Mapping[str, Any] | None = None,
               caps1_iterations: int = 0,
               class_inverse_temperature=None, class_lambda_scale: float = 1.0,
               coordinate_addition: bool = True,
               coordinate_form: str = 'grid', conv1_kernel: int = 5,
               conv1_stride: int = 2, caps1_kernel: int = 3,
               caps1_stride: int = 2, caps2_kernel: int = 3,
               caps2_stride: int = 1, primary_form: str = 'paper',
               remat: bool = False, remat_iterations: bool = False,
               window_chunk: int | None = None, votes_dtype=None,
               init: str = 'paper', transform_std: float | None = None,
               implementation: str | None = None, rngs: nnx.Rngs):
    height, width, channels = _check_input_shape(input_shape)
    implementations.check(implementation)
    for name, value in (('num_classes', num_classes), ('A', A), ('B', B),
                        ('C', C), ('D', D), ('conv1_kernel', conv1_kernel),
                        ('conv1_stride', conv1_stride),
                        ('caps1_kernel', caps1_kernel),
                        ('caps1_stride', caps1_stride),
                        ('caps2_kernel', caps2_kernel),
                        ('caps2_stride', caps2_stride)):
      _check_positive_int(name, value)
    if coordinate_form not in ('grid', 'authors', 'released'):
      raise ValueError(f"coordinate_form must be 'grid', 'authors' or "
                       f"'released', got {coordinate_form!r}.")
    conv_init, class_init = _em_layer_inits(init, transform_std)
    conv_routing, caps1_routing, class_routing = _em_layer_routings(
        em_routing, em_routing_overrides, caps1_iterations,
        class_inverse_temperature, class_lambda_scale)
    self.input_shape = (height, width, channels)
    self.conv1 = layers.Conv2D(
        channels, A, conv1_kernel, conv1_stride,
        implementation=implementations.for_op(implementation, 'conv2d'),
        rngs=rngs, **(layers.AUTHORS_CONV1_INIT if init == 'authors' else {}))
    self.primary = layers.MatrixPrimaryCapsules(A, B, form=primary_form,
                                                rngs=rngs)
    execution = dict(votes_dtype=votes_dtype, remat=remat,
                     remat_iterations=remat_iterations,
                     window_chunk=window_chunk,
                     implementation=implementations.for_op(
                         implementation, 'conv_capsule_routing'))
    self.caps1 = layers.ConvCapsules(
        B, C, caps1_kernel, caps1_stride, em_routing=caps1_routing,
        rngs=rngs, **execution, **conv_init)
    self.caps2 = layers.ConvCapsules(
        C, D, caps2_kernel, caps2_stride, em_routing=conv_routing,
        rngs=rngs, **execution, **conv_init)
    # The authors' coordinates: each class-layer position's receptive-field
    # centre in input pixels (Conv1, then the 1x1 primary capsules, then
    # the two conv capsule layers).
    windows = ((conv1_kernel, conv1_stride), (caps1_kernel, caps1_stride),
               (caps2_kernel, caps2_stride))
    offsets = (None if coordinate_form == 'grid' else tuple(
        votes_lib.authors_coordinates(side, windows) for side in (height,
                                                                   width)))
    self.class_caps = layers.ClassCapsules(
        D, num_classes, coordinate_addition=coordinate_addition,
        coordinate_offsets=offsets,
        coordinate_order='col_row' if coordinate_form == 'released'
        else 'row_col', em_routing=class_routing, votes_dtype=votes_dtype,
        rngs=rngs, **class_init)
    # Fail at construction, not first call, when a kernel does not fit.
    # (rows, cols) of the Conv1 / ConvCaps1 / ConvCaps2 grids.
    self.grid_sizes = tuple(self._grid_sizes(side) for side in (height, width))

  def _grid_sizes(self, side: int) -> tuple[int, int, int]:
    """The Conv1, ConvCaps1 and ConvCaps2 grid sides of an input side."""
    conv1 = self.conv1.output_size(side)
    caps1 = self.caps1.output_size(conv1)
    return conv1, caps1, self.caps2.output_size(caps1)

  # The model options that the routing's fields replaced (configs and
  # checkpoints written before ``em_routing``): ``upgrade_options`` moves
  # them into ``em_routing_overrides``.
  _FLAT_ROUTING_OPTIONS: ClassVar[dict[str, str]] = {
      'num_iterations': 'num_iterations',
      'inverse_temperature': 'inverse_temperature',
      'variance_epsilon': 'variance_epsilon',
      'normalize_cost': 'normalize_cost',
      'center_momentum': 'center_momentum',
      'activation_form': 'activation_form',
      'normalize_across_positions': 'normalize_across_positions',
      'released_routing': 'released', 'true_stride': 'true_stride'}

  @classmethod
  def upgrade_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with the flat routing options of older configs moved
    into ``em_routing_overrides`` (on top of the 'paper' preset, which was
    those options' default)."""
    flat = {key: value for key, value in options.items()
            if key in cls._FLAT_ROUTING_OPTIONS}
    if not flat:
      return dict(options)
    upgraded = {key: value for key, value in options.items()
                if key not in flat}
    overrides = dict(upgraded.get('em_routing_overrides') or {})
    overrides.update({cls._FLAT_ROUTING_OPTIONS[key]: value
                      for key, value in flat.items()})
    upgraded['em_routing_overrides'] = overrides
    return upgraded

  def __call__(self, images: ArrayLike, labels: ArrayLike | None = None, *,
               train: bool = False) -> dict[str, jax.Array]:
    del labels, train  # No decoder, no dropout.
    x = _check_images(images, self.input_shape[2], self.input_shape[:2],
                      self.conv1.kernel.dtype)
    x = jax.nn.relu(self.conv1(x))
    poses, acts = self.primary(x)
    poses, acts = self.caps1(poses, acts)
    poses, acts = self.caps2(poses, acts)
    class_poses, class_acts, assignments = self.class_caps.route(poses, acts)
    return {'class_scores': class_acts, 'poses': class_poses,
            'assignments': assignments,
            'class_input_activations': acts.reshape(acts.shape[0], -1)}


# ----------------------------------------------------------------------------
# Su's transfer experiment (his 2018 capsule post).


def _kernel_init(name: str):
  if name not in nn.KERNEL_INITS:
    raise ValueError(f'kernel_init must be one of {sorted(nn.KERNEL_INITS)}'
                     f', got {name!r}.')
  return nn.KERNEL_INITS[name]


def _su_trunk(input_channels: int, widths, kernel_init,
              rngs: nnx.Rngs) -> layers.SuTrunk:
  """``layers.SuTrunk`` of ``widths``, checked: 4 positive ints."""
  widths = _check_widths('trunk_widths', widths)
  if len(widths) != 4:
    raise ValueError(f'trunk_widths needs 4 entries, got {widths!r}.')
  return layers.SuTrunk(input_channels, widths, kernel_init=kernel_init,
                        rngs=rngs)


class TwoDigitBaseline(nnx.Module):
  """Su's CNN baseline: trunk, global average pool, Dense 128 ReLU, Dense K.

  Any input size >= 14x14 with the same parameters. Kernels are Keras'
  default glorot uniform, as Su's (``kernel_init='lecun_normal'``: Flax's).
  Returns {'class_scores': [B, K]} (sigmoid: K independent binary problems).
  """

  FAMILY: ClassVar[str] = 'two_digit'

  def __init__(self, *, input_channels: int = 1, num_classes: int = 10,
               trunk_widths: Sequence[int] = (64, 64, 128, 128),
               hidden_width: int = 128, kernel_init: str = 'glorot_uniform',
               rngs: nnx.Rngs):
    _check_positive_int('input_channels', input_channels)
    _check_positive_int('num_classes', num_classes)
    _check_positive_int('hidden_width', hidden_width)
    init = _kernel_init(kernel_init)
    self.input_channels = input_channels
    self.trunk = _su_trunk(input_channels, trunk_widths, init, rngs)
    self.head = _MLP(trunk_widths[-1], (hidden_width, num_classes),
                     kernel_init=init, rngs=rngs)

  def __call__(self, images: ArrayLike, labels: ArrayLike | None = None, *,
               train: bool = False) -> dict[str, jax.Array]:
    del labels, train
    x = self.trunk(_check_images(images, self.input_channels, None,
                                 self.trunk.convs[0].kernel.dtype))
    pooled = x.mean(axis=(1, 2)).astype(jnp.promote_types(x.dtype, jnp.float32))
    # float32: the head (128 -> 128 -> K) is cheap, and bfloat16 compute
    # would round the scores into ties (see _lengths).
    return {'class_scores': jax.nn.sigmoid(self.head(pooled))}


class TwoDigitCapsNet(nnx.Module):
  """Su's capsule model: trunk, every position a capsule, shared capsules.

  The trunk output [B, h, w, 128] is reshaped to [B, h*w, 128] input capsules
  (Su's ``Reshape((-1, 128))``) and routed by a SharedCapsules layer to K
  capsules of 16-D; score = length. Routing defaults follow Su's Keras code:
  non-accumulating updates (``accumulate=False``), squash constant 0.5, no
  bias, and his later agreement with s / |s| (``normalize_agreement=True``;
  False is his blog's agreement with squash(s)). Trunk kernels are Keras'
  glorot uniform, as Su's. Any input size >= 14x14 with the same parameters.

  Returns {'class_scores': [B, K] capsule lengths, 'capsules': [B, K,
  capsule_dim], 'coupling': [B, h*w, K]}.
  """

  FAMILY: ClassVar[str] = 'two_digit'

  def __init__(self, *, input_channels: int = 1, num_classes: int = 10,
               trunk_widths: Sequence[int] = (64, 64, 128, 128),
               capsule_dim: int = 16, num_iterations: int = 3,
               accumulate: bool = False, leaky: bool = False,
               squash_constant: float = 0.5, use_bias: bool = False,
               normalize_agreement: bool = True,
               kernel_init: str = 'glorot_uniform', rngs: nnx.Rngs):
    for name, value in (('input_channels', input_channels),
                        ('num_classes', num_classes),
                        ('capsule_dim', capsule_dim)):
      _check_positive_int(name, value)
    self.input_channels = input_channels
    self.trunk = _su_trunk(input_channels, trunk_widths,
                           _kernel_init(kernel_init), rngs)
    self.capsules = layers.SharedCapsules(
        trunk_widths[-1], num_classes, capsule_dim, num_iterations,
        accumulate=accumulate, leaky=leaky, squash_constant=squash_constant,
        use_bias=use_bias, normalize_agreement=normalize_agreement, rngs=rngs)

  def __call__(self, images: ArrayLike, labels: ArrayLike | None = None, *,
               train: bool = False) -> dict[str, jax.Array]:
    del labels, train
    x = self.trunk(_check_images(images, self.input_channels, None,
                                 self.trunk.convs[0].kernel.dtype))
    x = x.reshape(x.shape[0], -1, x.shape[-1])  # [B, h*w, 128]
    capsules, coupling = self.capsules(x)
    return {'class_scores': _lengths(capsules), 'capsules': capsules,
            'coupling': coupling}


# ----------------------------------------------------------------------------
# Mazzia, Salvetti, Chiaberge 2021.


class EfficientCapsNet(nnx.Module):
  """Efficient-CapsNet (Mazzia, Salvetti, Chiaberge 2021), its MNIST model.

  As the authors' code builds it (EscVM/Efficient-CapsNet,
  models/efficient_capsnet_graph_mnist.py): four 'VALID' convolutions, each
  ReLU then batch normalisation (32 5x5, 64 3x3, 64 3x3, 128 3x3 stride 2:
  28 -> 24 -> 22 -> 20 -> 9), depthwise primary capsules (a 9x9 kernel over
  the 9x9 grid: 16 capsules of 8, ``layers.DepthwisePrimaryCapsules``),
  fully connected capsules with self-attention routing to K capsules of 16
  (``layers.SelfAttentionCapsules``); class scores are their lengths. The
  decoder (FC 512 ReLU, FC 1024 ReLU, FC H*W*C sigmoid) sees the capsules
  masked as ``CapsNet``'s does.

  Initialisation as theirs: Keras' he_normal for the convolutions, the
  capsule transforms and the decoder's hidden layers, glorot normal for its
  output layer, glorot uniform for the depthwise kernel, zero biases and
  priors; batch normalisation as Keras 2's on these 4-D maps, TF's fused
  kernel (``layers.BatchNorm``: epsilon 1e-3, running averages at
  ``batch_norm_momentum`` 0.99, the running variance of the unbiased batch
  variance). With ``train`` it normalises by the
  batch's statistics and updates its running averages (``nnx.BatchStat``,
  which the trainers carry as the model state); otherwise it normalises by
  those averages, which at 0.99 keep 13% of their initial values after
  200 steps (a short run evaluates better at 0.9).

  Other input sizes keep the layers: the depthwise kernel leaves an h x w
  grid and h*w*C/8 primary capsules (the authors instead choose a kernel
  that leaves 1x1 for each dataset).

  Parameters on 28x28x1: 161,824 without the decoder, the paper's count
  (Keras' summary also counts the 576 running means and variances):
  convolutions 832 + 18,496 + 36,928 + 73,856, batch-norm scales and offsets
  576, depthwise kernel and bias 10,496, transforms 20,480, priors 160. The
  decoder adds 1,411,344.

  Returns {'class_scores': [B, K] capsule lengths, 'capsules': [B, K,
  digit_dim], 'coupling': [B, I, K] (I primary capsules; c + B, see
  ``self_attention_routing``), 'primary_lengths': [B, I], and with
  ``reconstruction`` 'reconstructions': [B, H*W*C]}.
  """

  FAMILY: ClassVar[str] = 'capsnet'
  CONV_KERNELS: ClassVar[tuple[int, ...]] = (5, 3, 3, 3)
  CONV_STRIDES: ClassVar[tuple[int, ...]] = (1, 1, 1, 2)
  # Keras' BatchNormalization epsilon, which the authors keep.
  BATCH_NORM_EPSILON: ClassVar[float] = 1e-3

  def __init__(self, *, input_shape: Sequence[int] = (28, 28, 1),
               num_classes: int = 10,
               conv_channels: Sequence[int] = (32, 64, 64, 128),
               primary_dim: int = 8, primary_kernel: int = 9,
               digit_dim: int = 16, reconstruction: bool = True,
               decoder_widths: Sequence[int] = (512, 1024),
               batch_norm_momentum: float = 0.99, rngs: nnx.Rngs):
    height, width, channels = _check_input_shape(input_shape)
    if not 0.0 <= batch_norm_momentum < 1.0:
      raise ValueError(f'batch_norm_momentum must be in [0, 1), got '
                       f'{batch_norm_momentum!r}.')
    for name, value in (('num_classes', num_classes),
                        ('primary_dim', primary_dim),
                        ('primary_kernel', primary_kernel),
                        ('digit_dim', digit_dim)):
      _check_positive_int(name, value)
    conv_channels = _check_widths('conv_channels', conv_channels)
    if len(conv_channels) != len(self.CONV_KERNELS):
      raise ValueError(f'conv_channels must name {len(self.CONV_KERNELS)} '
                       f'widths, got {conv_channels!r}.')
    self.input_shape = (height, width, channels)
    self.num_classes = num_classes
    sizes = (channels,) + conv_channels
    self.convs = nnx.List([
        layers.Conv2D(a, b, k, s, kernel_init=nn.he_normal, rngs=rngs)
        for a, b, k, s in zip(sizes[:-1], sizes[1:], self.CONV_KERNELS,
                              self.CONV_STRIDES, strict=True)])
    self.norms = nnx.List([
        layers.BatchNorm(c, momentum=batch_norm_momentum,
                         epsilon=self.BATCH_NORM_EPSILON)
        for c in conv_channels])
    for conv in self.convs:
      height, width = conv.output_size(height), conv.output_size(width)
    self.primary = layers.DepthwisePrimaryCapsules(
        conv_channels[-1], primary_dim, primary_kernel, rngs=rngs)
    self.digit = layers.SelfAttentionCapsules(
        self.primary.num_capsules(height, width), primary_dim, num_classes,
        digit_dim, rngs=rngs)
    if reconstruction:
      widths = _check_widths('decoder_widths', decoder_widths)
      self.decoder = _MLP(num_classes * digit_dim,
                          widths + (math.prod(self.input_shape),),
                          kernel_init=nn.he_normal,
                          last_kernel_init=nn.glorot_normal, rngs=rngs)
    else:
      self.decoder = None

  # The same masks as the CapsNet's: the label's capsule in training, the
  # longest otherwise (the authors' Mask layer).
  decoder_mask = CapsNet.decoder_mask

  def __call__(self, images: ArrayLike, labels: ArrayLike | None = None, *,
               train: bool = False) -> dict[str, jax.Array]:
    x = _check_images(images, self.input_shape[2], self.input_shape[:2],
                      self.convs[0].kernel.dtype)
    for conv, norm in zip(self.convs, self.norms, strict=True):
      y = jax.nn.relu(conv(x))
      # Its running averages stay float32 under a bfloat16 compute dtype.
      x = norm(y, train=train).astype(y.dtype)
    primary = self.primary(x)  # [B, I, primary_dim]
    return _class_capsule_outputs(self, primary, labels, train)


# ----------------------------------------------------------------------------
# Registry: one for the models here and yours.
#
# A name is looked up in ``_REGISTRY`` (the built-in names and those given to
# ``register``); a 'module:QualName' path is imported. A model constructor is
# a class (an ``nnx.Module``) or a module-level function that builds one; it
# takes ``rngs`` and its options as keywords.

ModelConstructor = Callable[..., nnx.Module]

_REGISTRY: dict[str, ModelConstructor] = {}
PATH_SEPARATOR = ':'
# Where the contract of a model from outside capsjax is written down.
CONTRACT_DOC = 'docs/own_model.md'


class ModelNotFound(ValueError):
  """A 'module:QualName' model not found here: its module does not import,
  or holds no such name."""


def _constructor_parameters(constructor: ModelConstructor
                            ) -> list[inspect.Parameter]:
  """The parameters a constructor is called with (a class's ``__init__``
  without ``self``)."""
  if isinstance(constructor, type):
    return list(inspect.signature(constructor.__init__).parameters.values()
                )[1:]
  return list(inspect.signature(constructor).parameters.values())


def _takes_any_keyword(constructor: ModelConstructor) -> bool:
  return any(p.kind == p.VAR_KEYWORD
             for p in _constructor_parameters(constructor))


def _check_constructor(name: str, constructor: Any) -> None:
  """ValueError unless ``constructor`` builds models as capsjax calls it:
  an ``nnx.Module`` class or a function, taking the keyword ``rngs``."""
  what = getattr(constructor, '__name__', repr(constructor))
  if isinstance(constructor, type):
    if not issubclass(constructor, nnx.Module):
      raise ValueError(f'model {name!r}: {what} is not a flax.nnx.Module '
                       f'subclass; see {CONTRACT_DOC}.')
  elif not callable(constructor):
    raise ValueError(f'model {name!r} names {what}, which is neither a '
                     f'model class nor a function; see {CONTRACT_DOC}.')
  names = {p.name for p in _constructor_parameters(constructor)
           if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
  if 'rngs' not in names and not _takes_any_keyword(constructor):
    raise ValueError(f'model {name!r}: {what} takes no keyword rngs; a model '
                     f'is built as {what}(rngs=nnx.Rngs(...), **options); '
                     f'see {CONTRACT_DOC}.')


def register(name: str, constructor: ModelConstructor) -> ModelConstructor:
  """Adds ``constructor`` (a model class, or a function that builds a
  model) under ``name``: ``create_model(name, ...)`` and
  ``config.model = name`` then build it. Returns ``constructor``.

  A workdir records a name registered here as the constructor's
  'module:QualName' path (``portable_name``), so that a new process loads
  it by importing that module. ValueError for a name that holds ':' (an
  import path needs no registering), is taken by another constructor, or a
  constructor that takes no keyword ``rngs``.
  """
  if not isinstance(name, str) or not name.strip() or name != name.strip():
    raise ValueError(f'a model name is a non-empty string without outer '
                     f'spaces, got {name!r}.')
  if PATH_SEPARATOR in name:
    raise ValueError(f'model name {name!r} holds {PATH_SEPARATOR!r}, which '
                     f'marks an import path: config.model = {name!r} '
                     f'imports it without registering.')
  _check_constructor(name, constructor)
  taken = _REGISTRY.get(name)
  # The same definition again (a notebook cell run twice) replaces itself.
  if taken is not None and _qualified(taken) != _qualified(constructor):
    raise ValueError(f'model name {name!r} is taken by '
                     f'{_qualified(taken)}; register {_qualified(constructor)}'
                     f' under another name.')
  _REGISTRY[name] = constructor
  return constructor


def _qualified(constructor: Any) -> str:
  """'module:QualName' as the constructor says it, importable or not."""
  module = getattr(constructor, '__module__', None) or '?'
  qualname = getattr(constructor, '__qualname__', None) or repr(constructor)
  return f'{module}{PATH_SEPARATOR}{qualname}'


def import_path(constructor: ModelConstructor) -> str:
  """'module:QualName' of a model class or a module-level function,
  checked to name ``constructor`` again (ValueError for a lambda, a
  function or class defined inside a function, a ``functools.partial``):
  what ``config.model`` holds for a model of yours given from Python."""
  path = _qualified(constructor)
  if '<' in path or '?' in path:
    raise ValueError(
        f'{path} cannot be imported by name (a lambda, a partial, or defined '
        f'inside a function): define the model class or function at the top '
        f'level of a module, so that a workdir trained with it can be '
        f'loaded again; see {CONTRACT_DOC}.')
  try:
    found = _import_constructor(path)
  except ValueError as e:
    raise ValueError(f'{path} is not found where its name says: {e}') from e
  if found is not constructor:
    raise ValueError(f'{path} names another object than the model given '
                     f'(redefined or replaced since); give the current one.')
  return path


def _import_constructor(path: str) -> ModelConstructor:
  """The model constructor at 'module:QualName' (ValueError naming what is
  missing and what to do)."""
  module_name, _, qualname = path.partition(PATH_SEPARATOR)
  if not module_name or not qualname:
    raise ValueError(f'model path {path!r} must be module:Class, e.g. '
                     f"'my_package.my_models:TwoLayerCapsNet'.")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ModelNotFound(
        f'cannot import module {module_name!r} of model {path!r} ({e}): '
        f'install it, or put the folder it is in on PYTHONPATH (or on '
        f'sys.path, or run from that folder), so that '
        f'`import {module_name}` works.') from e
  found: Any = module
  for part in qualname.split('.'):
    found = getattr(found, part, None)
    if found is None:
      break
  if found is None:
    if module_name == '__main__':
      raise ModelNotFound(
          f'model {path!r} was defined in a script or notebook (__main__), '
          f'and this one defines no {qualname}: define or import it in '
          f'__main__ first, or move it into a module of its own.')
    models = sorted(n for n, v in vars(module).items()
                    if isinstance(v, type) and issubclass(v, nnx.Module)
                    and v.__module__ == module.__name__
                    and not n.startswith('_'))
    raise ModelNotFound(
        f'module {module_name} ({getattr(module, "__file__", "built in")}) '
        f'has no {qualname!r}; its model classes: '
        f'{", ".join(models) or "none"}.')
  _check_constructor(path, found)
  return found


def list_models() -> tuple[str, ...]:
  """The registered names accepted by ``create_model``, sorted (the
  built-in models and those given to ``register``; any 'module:Class'
  path is accepted too)."""
  return tuple(sorted(_REGISTRY))


def model_class(name: str) -> ModelConstructor:
  """What builds model ``name``: a registered name (``list_models``) or a
  'module:QualName' path, imported. ValueError if unknown or not a model
  constructor (``ModelNotFound`` when a path's module does not import or
  lacks the name)."""
  if isinstance(name, str) and name in _REGISTRY:
    return _REGISTRY[name]
  if isinstance(name, str) and PATH_SEPARATOR in name:
    return _import_constructor(name)
  raise ValueError(
      f'unknown model {name!r}; valid names: {", ".join(list_models())} '
      f'(a name given to models.register exists once the module that '
      f"registers it is imported); or a model of yours as 'module:Class' "
      f'(see {CONTRACT_DOC}).')


def portable_name(name: str) -> str:
  """``name`` as a workdir records it: one a new process resolves. Built-in
  names and 'module:QualName' paths stay; a name given to ``register`` from
  outside capsjax becomes its constructor's path (``import_path``), or stays
  when that path does not lead back to it."""
  constructor = model_class(name)
  if PATH_SEPARATOR in name or name in BUILT_IN_MODELS:
    return name
  try:
    return import_path(constructor)
  except ValueError:
    return name


def _option_parameters(constructor: ModelConstructor
                       ) -> dict[str, inspect.Parameter]:
  return {p.name: p for p in _constructor_parameters(constructor)
          if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
          and p.name != 'rngs'}


def model_options(name: str) -> dict[str, object]:
  """The options of model ``name`` and their defaults
  (``inspect.Parameter.empty`` for an option it requires)."""
  return {option: p.default
          for option, p in _option_parameters(model_class(name)).items()}


def create_model(name: str, *, rngs: nnx.Rngs, **options) -> nnx.Module:
  """Builds model ``name`` with keyword ``options`` (see ``model_options``).

  Raises ValueError for an unknown name, an unknown option (listing the valid
  ones), a required option left out, or an invalid value (non-positive
  widths, zero iterations, a kernel larger than its input grid, ...).
  """
  constructor = model_class(name)
  if hasattr(constructor, 'upgrade_options'):
    options = constructor.upgrade_options(options)
  valid = _option_parameters(constructor)
  unknown = sorted(set(options) - set(valid))
  if unknown and not _takes_any_keyword(constructor):
    raise ValueError(
        f'unknown option(s) {unknown} for model {name!r}; valid options: '
        f'{", ".join(sorted(valid))}.')
  missing = sorted(option for option, p in valid.items()
                   if p.default is p.empty and option not in options)
  if missing:
    raise ValueError(f'model {name!r} requires the option(s) {missing}; set '
                     f'config.model_options.{missing[0]} (and the others).')
  model = constructor(rngs=rngs, **options)
  if not isinstance(model, nnx.Module):
    raise ValueError(f'model {name!r} built a {type(model).__name__}, not a '
                     f'flax.nnx.Module; see {CONTRACT_DOC}.')
  return model


# The models here, registered as yours are.
_BUILT_IN = {'capsnet': CapsNet, 'baseline_cnn': BaselineCNN,
             'efficient_capsnet': EfficientCapsNet,
             'matrix_capsnet': MatrixCapsNet,
             'routing_study_net': RoutingStudyNet,
             'two_digit_baseline': TwoDigitBaseline,
             'two_digit_capsnet': TwoDigitCapsNet}
BUILT_IN_MODELS = tuple(sorted(_BUILT_IN))
for _name, _cls in _BUILT_IN.items():
  register(_name, _cls)
del _name, _cls


def count_params(model: nnx.Module) -> int:
  """Number of trainable parameters (``nnx.Param`` entries) of ``model``."""
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  return int(sum(math.prod(leaf.shape) for leaf in leaves))


__all__ = (
    'BUILT_IN_MODELS',
    'BaselineCNN',
    'CapsNet',
    'EfficientCapsNet',
    'MatrixCapsNet',
    'TwoDigitBaseline',
    'TwoDigitCapsNet',
    'ModelConstructor',
    'ModelNotFound',
    'count_params',
    'create_model',
    'import_path',
    'list_models',
    'model_class',
    'model_options',
    'portable_name',
    'register',
)
