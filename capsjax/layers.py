"""Flax NNX capsule layers: they own parameters and call the pure functions.

Shape legend: B the batch, H x W a grid (H' x W' after a kernel), C or Cin /
Cout channels or capsule types, I input capsules, O output capsules, Din /
Dout vector-capsule dimensions, P the side of a pose matrix (4), K a kernel
size. Every module's docstring gives its input and output shapes.

Argument names, one per idea: ``in_features`` / ``out_features`` the
channels of a convolution, ``in_caps`` / ``out_caps`` the capsules of a
dense capsule layer, ``in_types`` / ``out_types`` the capsule types at each
position of a convolutional capsule layer, ``in_dim`` / ``out_dim`` a vector
capsule's length, ``pose_size`` P, ``transform_std`` the std of the capsule
transforms.

Initialisation (see each layer):
- Convolutions: Flax's default, lecun normal kernels and zero biases
  (``kernel_init=nn.glorot_uniform`` is Keras' default, for Su's models;
  the initialisers are in ``capsjax.nn``).
- Vector capsules (Sabour et al. 2017): the official code
  (Sarasra/models, research/capsules) draws capsule transforms from TF's
  truncated normal with stddev 0.1 and sets the routing bias to 0.1;
  DenseCapsules does the same. The official CapsNet's other initialisers
  (``OFFICIAL_*``; ``models.CapsNet(form='official')`` uses them): every
  kernel std 0.1 (the first convolution's 0.05), every bias 0.1.
  SharedCapsules follows Su's Keras layer (glorot uniform over
  [Din, O*Dout], no bias).
- Matrix capsules (Hinton et al. 2018): the paper prints no initialisation.
  The plain default ``transform_std=None`` draws each 4x4 transform from a
  normal with std 1/sqrt(P) (a P x P product sums P terms, so this keeps the
  pose entries' scale) and sets beta_u = beta_a = 0. The authors' released
  code (google-research ``capsule_em``) uses std 0.3 with beta_a = beta_u =
  0.5 in conv capsule layers and std 0.01 with beta_a = 1.0, beta_u = 2.0 in
  the class layer: ``AUTHORS_CONV_INIT`` / ``AUTHORS_CLASS_INIT`` hold those
  keyword arguments, and ``models.create_model('matrix_capsnet',
  init='authors')`` selects them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from capsjax import kernels
from capsjax import nn
from capsjax import routing
from capsjax.kernels import implementations
from capsjax.kernels.conv import dot_general as conv_dot_general
from capsjax.routing import attention as attention_routing
from capsjax.routing import matrix_capsules
from capsjax.routing import votes as votes_lib

# The authors' initialisers of the module docstring, TF truncated normals
# (cut at 2 std): capsule_em's conv_capsule_mat / connector_capsule_mat and
# first convolution; the official CapsNet's variables.py.
AUTHORS_CONV_INIT = {'transform_std': 0.3, 'transform_init': 'truncated',
                     'beta_a_init': 0.5, 'beta_u_init': 0.5}
AUTHORS_CLASS_INIT = {'transform_std': 0.01, 'transform_init': 'truncated',
                      'beta_a_init': 1.0, 'beta_u_init': 2.0}
AUTHORS_CONV1_INIT = {'kernel_init': nn.truncated_normal_init(0.05),
                      'bias_init': 0.1}
OFFICIAL_WEIGHT_STD = 0.1
OFFICIAL_CONV1_STD = 0.05
OFFICIAL_BIAS_INIT = 0.1
_default_kernel_init = nn.lecun_normal


def check_positive_int(name: str, value) -> None:
  """ValueError unless ``value`` is an int >= 1 (a bool is not)."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f'{name} must be a positive int, got {value!r}.')


# The two forms of the dynamic-routing CapsNet: 'official' computes what the
# official code (Sarasra/models, research/capsules) computes, 'text' what the
# paper's text says (see PrimaryCapsules, models.CapsNet, losses.margin_loss).
FORMS = ('official', 'text')


def _check_form(form) -> None:
  if form not in FORMS:
    raise ValueError(f'form must be one of {FORMS}, got {form!r}.')


class Conv2D(nnx.Module):
  """Convolution + bias, NHWC: [B, H, W, in_features] -> [B, H', W', out_features].

  H' = (H - K) // stride + 1 with 'VALID' padding, ceil(H / stride) with
  'SAME'. ``implementation``: ``kernels.conv2d``'s (None: the fastest).
  ``scale`` multiplies the convolution before the bias is added:
  scale * conv(x, kernel) + bias (the official CapsNet's primary capsules).
  """

  def __init__(self, in_features: int, out_features: int, kernel_size: int,
               stride: int = 1, *, padding: str = 'VALID',
               implementation: str | None = None, use_bias: bool = True,
               kernel_init=_default_kernel_init, bias_init: float = 0.0,
               scale: float = 1.0, rngs: nnx.Rngs):
    for name, value in (('in_features', in_features),
                        ('out_features', out_features),
                        ('kernel_size', kernel_size), ('stride', stride)):
      check_positive_int(name, value)
    if padding not in ('VALID', 'SAME'):
      raise ValueError(f"padding must be 'VALID' or 'SAME', got {padding!r}.")
    implementations.check(implementation, 'conv2d')
    self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
    self.implementation = implementation
    self.scale = scale
    self.kernel = nnx.Param(kernel_init(
        rngs.params(), (kernel_size, kernel_size, in_features, out_features)))
    self.bias = (nnx.Param(jnp.full((out_features,), bias_init, jnp.float32))
                 if use_bias else None)

  def output_size(self, size: int) -> int:
    """H' for an input side H."""
    if self.padding == 'SAME':
      return -(-size // self.stride)
    return votes_lib.output_size(size, self.kernel_size, self.stride)

  def __call__(self, x: ArrayLike) -> jax.Array:
    y = kernels.conv2d(x, self.kernel[...], self.stride, self.padding,
                       self.implementation)
    if self.scale != 1.0:
      y = self.scale * y
    if self.bias is not None:
      y = nn.add_bias(y, self.bias[...])
    return y


class BatchNorm(nnx.Module):
  """Keras 2's ``BatchNormalization()`` on [B, H, W, C], TF's fused kernel
  (``nn.batch_norm``: the running variance averages the unbiased batch
  variance): [..., C] -> [..., C], float32 for bfloat16 x. Parameters
  ``scale`` and ``bias``, running ``mean`` and ``var`` (``nnx.BatchStat``):
  flax's ``nnx.BatchNorm``'s names, whose checkpoints load."""

  def __init__(self, num_features: int, *, momentum: float = 0.99,
               epsilon: float = 1e-3):
    check_positive_int('num_features', num_features)
    if not (0.0 <= momentum < 1.0 and epsilon > 0.0):
      raise ValueError(f'BatchNorm needs 0 <= momentum < 1 and epsilon > 0, '
                       f'got momentum={momentum!r}, epsilon={epsilon!r}.')
    self.momentum, self.epsilon = momentum, epsilon
    self.scale = nnx.Param(jnp.ones((num_features,), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((num_features,), jnp.float32))
    self.mean = nnx.BatchStat(jnp.zeros((num_features,), jnp.float32))
    self.var = nnx.BatchStat(jnp.ones((num_features,), jnp.float32))

  def __call__(self, x: ArrayLike, *, train: bool) -> jax.Array:
    """``train``: by the batch's statistics, updating the running ones."""
    y, mean, var = nn.batch_norm(
        x, self.scale[...], self.bias[...], self.mean[...], self.var[...],
        train=train, momentum=self.momentum, epsilon=self.epsilon)
    if train:
      self.mean[...], self.var[...] = mean, var
    return y


# ----------------------------------------------------------------------------
# Vector capsules (Sabour et al. 2017).


class PrimaryCapsules(nnx.Module):
  """Convolutional primary capsules: conv, group channels, squash.

  [B, H, W, in_features] -> [B, H'*W'*num_types, dim] with H' = (H - K) //
  stride + 1 ('VALID' ``padding``) or ceil(H / stride) ('SAME': the
  official CIFAR-10 model's); capsules ordered (row, column, type).

  Two forms (``form``):
  - 'text' (the paper's text: "no routing"): squash(conv(x) + b).
  - 'official' (the official code, Sarasra/models research/capsules:
    ``conv_slim_capsule`` with one routing iteration over a single input
    capsule): every coupling is softmax(0) over the ``num_types`` outputs,
    1/num_types (1/(num_types + 1) with ``leaky``, whose extra zero logit
    takes a share), so the layer computes squash(conv(x) * c + b) with
    c = 1/32 (1/33) in the MNIST model; the bias is not scaled. The function
    class is the text form's; the training dynamics are not: under Adam the
    convolution's contribution moves 32x less per step. That code orders its
    capsules (type, row, column); the order only permutes the next layer's
    per-capsule transforms.
  ``leaky`` has no effect in the 'text' form (it has no routing).
  """

  def __init__(self, in_features: int, num_types: int = 32, dim: int = 8,
               kernel_size: int = 9, stride: int = 2, *,
               implementation: str | None = None,
               squash_constant: float = 1.0,
               form: str = 'text', leaky: bool = False,
               padding: str = 'VALID',
               kernel_init=_default_kernel_init, bias_init: float = 0.0,
               rngs: nnx.Rngs):
    check_positive_int('num_types', num_types)
    check_positive_int('dim', dim)
    _check_form(form)
    self.num_types, self.dim = num_types, dim
    self.squash_constant = squash_constant
    self.form, self.leaky = form, leaky
    self.conv = Conv2D(in_features, num_types * dim, kernel_size, stride,
                       padding=padding, implementation=implementation,
                       kernel_init=kernel_init, bias_init=bias_init,
                       scale=self.coupling if form == 'official' else 1.0,
                       rngs=rngs)

  @property
  def coupling(self) -> float:
    """The official form's coupling: 1/num_types, 1/(num_types + 1) leaky."""
    return 1.0 / (self.num_types + int(self.leaky))

  def num_capsules(self, height: int, width: int) -> int:
    """Number of output capsules for an H x W input."""
    return (self.conv.output_size(height) * self.conv.output_size(width)
            * self.num_types)

  def __call__(self, x: ArrayLike) -> jax.Array:
    y = self.conv(x)  # [B, H', W', types * dim]
    y = y.reshape(y.shape[0], -1, self.dim)  # [B, H'*W'*types, dim]
    return routing.squash(y, constant=self.squash_constant)


class _DynamicRoutingLayer(nnx.Module):
  """What ``DenseCapsules`` and ``SharedCapsules`` share: their routing
  options, the optional bias and the call into ``kernels.dynamic_routing``."""

  def _set_routing(self, num_iterations: int, accumulate: bool, leaky: bool,
                   squash_constant: float, normalize_agreement: bool,
                   implementation: str | None, bias_shape: tuple[int, int],
                   use_bias: bool, bias_init: float) -> None:
    routing.check_iterations(num_iterations)
    implementations.check(implementation, 'dynamic_routing')
    self.implementation = implementation
    self.num_iterations = num_iterations
    self.accumulate, self.leaky = accumulate, leaky
    self.squash_constant = squash_constant
    self.normalize_agreement = normalize_agreement
    self.bias = (nnx.Param(jnp.full(bias_shape, bias_init, jnp.float32))
                 if use_bias else None)

  def _route(self, u_hat: jax.Array) -> tuple[jax.Array, jax.Array]:
    """u_hat: [B, I, O, Dout] -> (outputs [B, O, Dout], coupling [B, I, O])."""
    return kernels.dynamic_routing(
        u_hat, self.num_iterations, accumulate=self.accumulate,
        leaky=self.leaky, squash_constant=self.squash_constant,
        bias=None if self.bias is None else self.bias[...],
        normalize_agreement=self.normalize_agreement,
        implementation=self.implementation)


class DenseCapsules(_DynamicRoutingLayer):
  """Fully connected capsule layer with dynamic routing (DigitCaps).

  One transform W_ij [Din, Dout] per (input, output) pair and an optional
  learned bias [O, Dout] added to s_j before the squash (the official code's
  ``capsule`` layer; it initialises W from a truncated normal with std 0.1
  and the bias to 0.1, the defaults here). Su's routing variants
  (``accumulate=False``, ``squash_constant=0.5``, ``normalize_agreement``)
  are options, so his later routing with unshared weights is this layer.
  ``implementation``: ``kernels.dynamic_routing``'s (None: 'xla').

  Input [B, I, Din] -> (outputs [B, O, Dout], coupling [B, I, O]).
  """

  def __init__(self, in_caps: int, in_dim: int, out_caps: int, out_dim: int,
               num_iterations: int = 3, *, accumulate: bool = True,
               leaky: bool = False, squash_constant: float = 1.0,
               use_bias: bool = True,
               transform_std: float = OFFICIAL_WEIGHT_STD,
               bias_init: float = OFFICIAL_BIAS_INIT,
               normalize_agreement: bool = False,
               implementation: str | None = None, rngs: nnx.Rngs):
    for name, value in (('in_caps', in_caps), ('in_dim', in_dim),
                        ('out_caps', out_caps), ('out_dim', out_dim)):
      check_positive_int(name, value)
    self._set_routing(num_iterations, accumulate, leaky, squash_constant,
                      normalize_agreement, implementation, (out_caps, out_dim),
                      use_bias, bias_init)
    self.weights = nnx.Param(nn.truncated_normal_init(transform_std)(
        rngs.params(), (in_caps, out_caps, in_dim, out_dim)))

  def __call__(self, inputs: ArrayLike) -> tuple[jax.Array, jax.Array]:
    return self._route(votes_lib.vector_votes(inputs, self.weights[...]))


class SharedCapsules(_DynamicRoutingLayer):
  """Capsule layer whose transform W_j is shared by every input (Su's post).

  Parameters do not depend on the number of input capsules, so the layer
  accepts any I (any image size). Defaults follow Su's Keras ``Capsule``
  layer: glorot-uniform W over [Din, O*Dout], no bias; his routing variants
  (``accumulate=False``, ``squash_constant=0.5``, ``normalize_agreement``)
  are options; ``implementation`` as in ``DenseCapsules``.

  Input [B, I, Din] (any I) -> (outputs [B, O, Dout], coupling [B, I, O]).
  """

  def __init__(self, in_dim: int, out_caps: int, out_dim: int,
               num_iterations: int = 3, *, accumulate: bool = True,
               leaky: bool = False, squash_constant: float = 1.0,
               use_bias: bool = False, bias_init: float = OFFICIAL_BIAS_INIT,
               normalize_agreement: bool = False,
               implementation: str | None = None, rngs: nnx.Rngs):
    for name, value in (('in_dim', in_dim), ('out_caps', out_caps),
                        ('out_dim', out_dim)):
      check_positive_int(name, value)
    self._set_routing(num_iterations, accumulate, leaky, squash_constant,
                      normalize_agreement, implementation, (out_caps, out_dim),
                      use_bias, bias_init)
    limit = math.sqrt(6.0 / (in_dim + out_caps * out_dim))
    self.weights = nnx.Param(jax.random.uniform(
        rngs.params(), (out_caps * in_dim * out_dim,), jnp.float32, -limit,
        limit).reshape(out_caps, in_dim, out_dim))

  def __call__(self, inputs: ArrayLike) -> tuple[jax.Array, jax.Array]:
    return self._route(votes_lib.shared_vector_votes(
        inputs, self.weights[...], dot_general=conv_dot_general))


# ----------------------------------------------------------------------------
# Efficient-CapsNet (Mazzia, Salvetti, Chiaberge 2021; the authors' code
# EscVM/Efficient-CapsNet, utils/layers.py).



class DepthwisePrimaryCapsules(nnx.Module):
  """Efficient-CapsNet's primary capsules (the authors' ``PrimaryCaps``):
  a depthwise convolution with bias, its channels grouped into capsules of
  ``dim``, squashed by ``attention_routing.efficient_squash``.

  [B, H, W, in_features] -> [B, H'*W'*in_features/dim, dim], capsules
  ordered (row, column, group of ``dim`` channels). On MNIST the 9x9 kernel
  covers the whole 9x9 grid: 16 capsules of 8 from 128 channels. The
  kernel is Keras' default (glorot uniform, fans K*K and K*K*C), the bias
  zeros, as the authors' layer leaves them.
  """

  def __init__(self, in_features: int, dim: int = 8, kernel_size: int = 9,
               stride: int = 1, *, rngs: nnx.Rngs):
    for name, value in (('in_features', in_features), ('dim', dim),
                        ('kernel_size', kernel_size), ('stride', stride)):
      check_positive_int(name, value)
    if in_features % dim:
      raise ValueError(f'in_features ({in_features}) must be a multiple of '
                       f'the capsule dim ({dim}).')
    self.dim, self.kernel_size, self.stride = dim, kernel_size, stride
    self.kernel = nnx.Param(nn.glorot_uniform(
        rngs.params(), (kernel_size, kernel_size, 1, in_features)))
    self.bias = nnx.Param(jnp.zeros((in_features,), jnp.float32))

  def num_capsules(self, height: int, width: int) -> int:
    """Number of output capsules for an H x W input."""
    rows, cols = (votes_lib.output_size(n, self.kernel_size, self.stride)
                  for n in (height, width))
    return rows * cols * self.kernel.shape[-1] // self.dim

  def __call__(self, x: ArrayLike) -> jax.Array:
    y = nn.add_bias(nn.depthwise_conv2d(x, self.kernel[...], self.stride),
                 self.bias[...])
    y = y.reshape(y.shape[0], -1, self.dim)  # [B, H'*W'*C/dim, dim]
    return attention_routing.efficient_squash(y)


class SelfAttentionCapsules(nnx.Module):
  """Efficient-CapsNet's fully connected capsules (the authors' ``FCCaps``):
  a vote W_io u_i per (input, output) pair, routed by
  ``attention_routing.self_attention_routing`` with learned priors.

  Transforms [I, O, Din, Dout] from Keras' he_normal (the authors' W [O, I,
  Din, Dout] has the same fans), priors B [I, O] zeros (their b [O, I, 1]).

  Input [B, I, Din] -> (outputs [B, O, Dout], coupling [B, I, O]).
  """

  def __init__(self, in_caps: int, in_dim: int, out_caps: int, out_dim: int,
               *, rngs: nnx.Rngs):
    for name, value in (('in_caps', in_caps), ('in_dim', in_dim),
                        ('out_caps', out_caps), ('out_dim', out_dim)):
      check_positive_int(name, value)
    self.weights = nnx.Param(nn.he_normal(rngs.params(),
                                       (in_caps, out_caps, in_dim, out_dim)))
    self.log_priors = nnx.Param(jnp.zeros((in_caps, out_caps), jnp.float32))

  def __call__(self, inputs: ArrayLike) -> tuple[jax.Array, jax.Array]:
    votes = votes_lib.vector_votes(inputs, self.weights[...])
    return attention_routing.self_attention_routing(votes,
                                                    self.log_priors[...])


# ----------------------------------------------------------------------------
# Matrix capsules (Hinton et al. 2018).


class MatrixPrimaryCapsules(nnx.Module):
  """1x1 convolution to pose matrices and sigmoid activations.

  [B, H, W, in_features] -> (poses [B, H, W, num_types, P, P],
  activations [B, H, W, num_types]).

  ``form='paper'``: a pose kernel and an activation kernel with biases
  (LeCun normal, zero biases), activations sigmoid(x W_a + b_a).
  The released forms follow google-research capsule_em's ``primary_caps``:
  no biases, activations sigmoid(logit - 1), one kernel [in_features,
  num_types * P*P + num_types], the concatenation of a pose kernel (TF
  truncated normal, std 0.5) and an activation kernel (std 3.0), drawn the
  same way here. They differ in how the output channels are read:
  ``form='released'`` (that code from 2020 on) splits them first, the
  first num_types * P*P channels the poses (type by type) and the last
  num_types the activation logits, so the std-3.0 columns are the logits;
  ``form='released_2019'`` (the code first released, which the published
  checkpoint came with) reads them type by type in groups of P*P + 1, P*P
  pose entries then the logit, so the std-3.0 columns are the last
  num_types columns, not the logits (for 32 types the poses and logits of
  the last two types).
  """

  def __init__(self, in_features: int, num_types: int, pose_size: int = 4, *,
               form: str = 'paper', rngs: nnx.Rngs):
    for name, value in (('in_features', in_features),
                        ('num_types', num_types), ('pose_size', pose_size)):
      check_positive_int(name, value)
    if form not in ('paper', 'released', 'released_2019'):
      raise ValueError(f"form must be 'paper', 'released' or "
                       f"'released_2019', got {form!r}.")
    self.num_types, self.pose_size, self.form = num_types, pose_size, form
    poses = num_types * pose_size * pose_size
    if form != 'paper':
      pose_key, activation_key = rngs.params(), rngs.params()
      self.kernel = nnx.Param(jnp.concatenate([
          nn.truncated_normal_init(0.5)(pose_key, (in_features, poses)),
          nn.truncated_normal_init(3.0)(activation_key,
                                        (in_features, num_types)),
      ], axis=-1))
      return
    self.pose_kernel = nnx.Param(_default_kernel_init(
        rngs.params(), (in_features, poses)))
    self.pose_bias = nnx.Param(jnp.zeros((poses,), jnp.float32))
    self.activation_kernel = nnx.Param(_default_kernel_init(
        rngs.params(), (in_features, num_types)))
    self.activation_bias = nnx.Param(jnp.zeros((num_types,), jnp.float32))

  def __call__(self, x: ArrayLike) -> tuple[jax.Array, jax.Array]:
    x = jnp.asarray(x)
    p = self.pose_size
    if self.form != 'paper':
      y = jnp.einsum('...c,cf->...f', x, self.kernel[...])
      lead, types = x.shape[:-1], self.num_types
      if self.form == 'released':
        poses, logits = y[..., :types * p * p], y[..., types * p * p:]
      else:
        y = y.reshape(lead + (types, p * p + 1))
        poses, logits = y[..., :p * p], y[..., p * p]
      poses = poses.reshape(lead + (types, p, p))
      return poses, jax.nn.sigmoid(logits - 1.0)
    poses = nn.dense(x, self.pose_kernel[...], self.pose_bias[...])
    poses = poses.reshape(x.shape[:-1] + (self.num_types, p, p))
    logits = nn.dense(x, self.activation_kernel[...], self.activation_bias[...])
    return poses, jax.nn.sigmoid(logits)


def _check_em_routing(em_routing) -> routing.EMRouting:
  if not isinstance(em_routing, routing.EMRouting):
    raise ValueError(f'em_routing must be a routing.EMRouting (presets: '
                     f'routing.EM_ROUTING_PRESETS), got {em_routing!r}.')
  return em_routing



class ConvCapsules(nnx.Module):
  """Convolutional capsule layer with EM routing (ConvCaps1 / ConvCaps2).

  W [K, K, in_types, out_types, P, P]: one transform per kernel tap and (in
  type, out type) pair, shared over positions; beta_u, beta_a [out_types]
  shared over positions (the authors' answer in the review thread).

  (poses [B, H, W, in_types, P, P], activations [B, H, W, in_types]) ->
  (poses [B, H', W', out_types, P, P], activations [B, H', W', out_types]),
  H' = (H - K) // stride + 1.

  ``remat=True`` wraps patches, votes and routing in ``jax.checkpoint`` so the
  backward pass recomputes the votes (the largest tensor of the network:
  [B, H', W', K*K*Cin, Cout, P*P]) instead of storing them.
  ``remat_iterations=True`` checkpoints each routing iteration instead
  (``routing.em_routing``): only the assignments are kept between
  iterations (BENCHMARKS.md compares the two).
  ``votes_dtype=jnp.bfloat16`` stores votes in bfloat16; routing statistics
  stay float32. ``window_chunk``: windows routed at a time, their votes
  recomputed in the backward pass
  (``matrix_capsules.conv_capsule_routing``; None: chunks of about
  ``matrix_capsules.WINDOW_CHUNK_BYTES`` of votes on a CPU, all at once on
  an accelerator). ``implementation``: ``kernels.conv_capsule_routing``'s
  (None: the fused CPU kernel where it applies).
  """

  def __init__(self, in_types: int, out_types: int, kernel_size: int = 3,
               stride: int = 2, *, pose_size: int = 4,
               em_routing: routing.EMRouting = routing.PAPER_EM,
               remat: bool = False, remat_iterations: bool = False,
               window_chunk: int | None = None,
               implementation: str | None = None,
               votes_dtype=None, transform_std: float | None = None,
               transform_init: str = 'normal',
               beta_u_init: float = 0.0, beta_a_init: float = 0.0,
               rngs: nnx.Rngs):
    for name, value in (('in_types', in_types), ('out_types', out_types),
                        ('kernel_size', kernel_size), ('stride', stride),
                        ('pose_size', pose_size)):
      check_positive_int(name, value)
    self.kernel_size, self.stride = kernel_size, stride
    self.em_routing = _check_em_routing(em_routing)
    self.remat, self.remat_iterations = remat, remat_iterations
    matrix_capsules.check_window_chunk(window_chunk)
    self.window_chunk = window_chunk
    implementations.check(implementation, 'conv_capsule_routing')
    self.implementation = implementation
    self.votes_dtype = None if votes_dtype is None else jnp.dtype(votes_dtype)
    self.weights = nnx.Param(nn.capsule_transform_init(
        rngs.params(), (kernel_size, kernel_size, in_types, out_types,
                        pose_size, pose_size), pose_size, transform_std,
        transform_init))
    self.beta_u = nnx.Param(jnp.full((out_types,), beta_u_init, jnp.float32))
    self.beta_a = nnx.Param(jnp.full((out_types,), beta_a_init, jnp.float32))

  def output_size(self, size: int) -> int:
    """H' for an input grid side H (ValueError if the kernel does not fit)."""
    return votes_lib.output_size(size, self.kernel_size, self.stride)

  def __call__(self, poses: ArrayLike, activations: ArrayLike
               ) -> tuple[jax.Array, jax.Array]:
    fn = functools.partial(
        kernels.conv_capsule_routing, stride=self.stride,
        em_routing=self.em_routing, votes_dtype=self.votes_dtype,
        remat_iterations=self.remat_iterations,
        window_chunk=self.window_chunk, implementation=self.implementation)
    if self.remat:
      fn = jax.checkpoint(fn)
    out_poses, out_acts, _ = fn(poses, activations, self.weights[...],
                                self.beta_u[...], self.beta_a[...])
    return out_poses, out_acts



class ClassCapsules(nnx.Module):
  """Class capsule layer: transforms shared over positions, coordinate addition.

  W [in_types, num_classes, P, P] shared by every position; beta_u, beta_a
  [num_classes]. Votes [B, H, W, Cin, O, P*P] (+ coordinate addition) are
  routed as H*W*Cin input capsules.

  (poses [B, H, W, in_types, P, P], activations [B, H, W, in_types]) ->
  (poses [B, num_classes, P, P], activations [B, num_classes]).
  ``coordinate_offsets`` (rows, cols): what coordinate addition adds (see
  ``matrix_capsules.class_capsule_routing``); None: the grid's (h + 0.5) / H.
  """

  def __init__(self, in_types: int, num_classes: int, *, pose_size: int = 4,
               coordinate_addition: bool = True,
               coordinate_offsets: tuple[Sequence[float], Sequence[float]]
               | None = None,
               em_routing: routing.EMRouting = routing.PAPER_EM,
               coordinate_order: str = 'row_col', votes_dtype=None,
               transform_std: float | None = None,
               transform_init: str = 'normal', beta_u_init: float = 0.0,
               beta_a_init: float = 0.0, rngs: nnx.Rngs):
    for name, value in (('in_types', in_types), ('num_classes', num_classes),
                        ('pose_size', pose_size)):
      check_positive_int(name, value)
    self.coordinate_addition = coordinate_addition
    # Tuples of floats: static, hashable module attributes.
    self.coordinate_offsets = None if coordinate_offsets is None else tuple(
        tuple(float(x) for x in axis) for axis in coordinate_offsets)
    self.em_routing = _check_em_routing(em_routing)
    if coordinate_order not in ('row_col', 'col_row'):
      raise ValueError(f"coordinate_order must be 'row_col' or 'col_row', got "
                       f'{coordinate_order!r}.')
    self.coordinate_order = coordinate_order
    self.votes_dtype = None if votes_dtype is None else jnp.dtype(votes_dtype)
    self.weights = nnx.Param(nn.capsule_transform_init(
        rngs.params(), (in_types, num_classes, pose_size, pose_size),
        pose_size, transform_std, transform_init))
    self.beta_u = nnx.Param(jnp.full((num_classes,), beta_u_init, jnp.float32))
    self.beta_a = nnx.Param(jnp.full((num_classes,), beta_a_init, jnp.float32))

  def route(self, poses: ArrayLike, activations: ArrayLike
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(poses [B, K, P, P], activations [B, K], assignments [B, H*W*Cin, K])
    (see ``matrix_capsules.class_capsule_routing``)."""
    return matrix_capsules.class_capsule_routing(
        poses, activations, self.weights[...], self.beta_u[...],
        self.beta_a[...], coordinate_addition=self.coordinate_addition,
        coordinate_offsets=self.coordinate_offsets,
        coordinate_order=self.coordinate_order, votes_dtype=self.votes_dtype,
        em_routing=self.em_routing)

  def __call__(self, poses: ArrayLike, activations: ArrayLike
               ) -> tuple[jax.Array, jax.Array]:
    out_poses, out_acts, _ = self.route(poses, activations)
    return out_poses, out_acts
