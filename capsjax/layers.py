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
  (``kernel_init=glorot_uniform`` is Keras' default, for Su's models).
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

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from capsjax import attention_routing
from capsjax import em_kernel
from capsjax import routing
from capsjax import votes as votes_lib
from capsjax.conv import CONV_IMPLS
from capsjax.conv import conv2d
from capsjax.conv import dot_general as conv_dot_general
from capsjax.conv.products import sum_rows_float32

# The authors' released initialisation for matrix capsule layers
# (google-research capsule_em: conv_capsule_mat / connector_capsule_mat).
# TF truncated normals (cut at 2 std), as there.
AUTHORS_CONV_INIT = {'transform_std': 0.3, 'transform_init': 'truncated',
                     'beta_a_init': 0.5, 'beta_u_init': 0.5}
AUTHORS_CLASS_INIT = {'transform_std': 0.01, 'transform_init': 'truncated',
                      'beta_a_init': 1.0, 'beta_u_init': 2.0}
# The official dynamic-routing code's initialisers (variables.py there): TF
# truncated normals with std 0.1 for every kernel and capsule transform but
# the first convolution's (0.05), every bias 0.1.
OFFICIAL_WEIGHT_STD = 0.1
OFFICIAL_CONV1_STD = 0.05
OFFICIAL_BIAS_INIT = 0.1



# Initialisers. Each draws a flat vector and reshapes it: on XLA:CPU the
# random-bits program for a many-axis shape compiles 5-10x slower (seconds
# per parameter) than for the same number of values in one axis.
# Truncated normals cut at 2 std, as TF's truncated_normal_initializer.
_TRUNCATED_STD = 0.87962566103423978  # std of a unit normal cut at +-2


def normal_init(std: float):
  """Normal(0, std^2) initialiser: (key, shape, dtype) -> array."""
  def init(key, shape, dtype=jnp.float32):
    size = math.prod(shape)
    return std * jax.random.normal(key, (size,), dtype).reshape(shape)
  return init


def truncated_normal_init(std: float):
  """TF's truncated_normal_initializer(stddev=std): a N(0, std^2) cut at 2 std."""
  def init(key, shape, dtype=jnp.float32):
    size = math.prod(shape)
    return std * jax.random.truncated_normal(key, -2.0, 2.0, (size,),
                                             dtype).reshape(shape)
  return init


def lecun_normal(key, shape, dtype=jnp.float32):
  """Flax's default kernel initialiser: variance 1 / fan_in, truncated.

  fan_in is the product of every axis but the last (K*K*Cin for a conv).
  """
  fan_in = math.prod(shape[:-1])
  std = 1.0 / math.sqrt(fan_in) / _TRUNCATED_STD
  return truncated_normal_init(std)(key, shape, dtype)


def glorot_uniform(key, shape, dtype=jnp.float32):
  """Keras' default kernel initialiser: U(-l, l), l = sqrt(6 / (fan_in + fan_out)).

  For a conv kernel [K, K, Cin, Cout]: fan_in = K*K*Cin, fan_out = K*K*Cout;
  for a dense [Din, Dout]: Din and Dout (Keras' ``_compute_fans``).
  """
  receptive = math.prod(shape[:-2])
  limit = math.sqrt(6.0 / (receptive * (shape[-2] + shape[-1])))
  return jax.random.uniform(key, shape, dtype, -limit, limit)


def he_normal(key, shape, dtype=jnp.float32):
  """Keras' he_normal: variance 2 / fan_in, a normal cut at 2 std.

  fan_in is the product of every axis but the last: K*K*Cin for a conv,
  Din for a dense layer, I*O*Din for capsule transforms [I, O, Din, Dout]
  (Keras' ``_compute_fans`` gives the same for all three).
  """
  std = math.sqrt(2.0 / math.prod(shape[:-1])) / _TRUNCATED_STD
  return truncated_normal_init(std)(key, shape, dtype)


def glorot_normal(key, shape, dtype=jnp.float32):
  """Keras' glorot_normal: variance 2 / (fan_in + fan_out), a normal cut at
  2 std (fans as in ``glorot_uniform``)."""
  receptive = math.prod(shape[:-2])
  std = math.sqrt(2.0 / (receptive * (shape[-2] + shape[-1]))) / _TRUNCATED_STD
  return truncated_normal_init(std)(key, shape, dtype)


KERNEL_INITS = {'lecun_normal': lecun_normal, 'glorot_uniform': glorot_uniform}
# The released EM code's first convolution (capsule_em): truncated normal
# std 0.05, bias 0.1.
AUTHORS_CONV1_INIT = {'kernel_init': truncated_normal_init(0.05),
                      'bias_init': 0.1}
_default_kernel_init = lecun_normal


def _check_positive_int(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f'{name} must be a positive int, got {value!r}.')


# The two forms of the dynamic-routing CapsNet: 'official' computes what the
# official code (Sarasra/models, research/capsules) computes, 'text' what the
# paper's text says (see PrimaryCapsules, models.CapsNet, losses.margin_loss).
FORMS = ('official', 'text')


def _check_form(form) -> None:
  if form not in FORMS:
    raise ValueError(f'form must be one of {FORMS}, got {form!r}.')


def _check_iterations(num_iterations) -> None:
  if (isinstance(num_iterations, bool) or not isinstance(num_iterations, int)
      or num_iterations < 1):
    raise ValueError(
        f'num_iterations must be a positive int (routing iterations are '
        f'unrolled statically), got {num_iterations!r}.')


def add_bias(y: jax.Array, bias: jax.Array) -> jax.Array:
  """y + bias along the last axis: y [..., F], bias [F] -> [..., F] in y's dtype.

  The bias gradient, the cotangent summed over every other axis, is
  accumulated in float32, or float64 where the cotangent is float64. Left
  to autodiff, a bfloat16 bias sums its gradient in bfloat16 on XLA:CPU:
  over a batch-128 26x26 convolution output that sum was off by 19% of its
  norm, and took about 10x as long as the float32 sum. (Where y and bias
  are both float32 or both float64 this is plain addition, autodiff summing
  in their dtype; else a custom VJP: reverse mode only, as training uses
  it.)
  """
  if y.dtype == bias.dtype == jnp.promote_types(y.dtype, jnp.float32):
    return y + bias.reshape((1,) * (y.ndim - 1) + (-1,))  # autodiff's own sum
  return _add_bias_f32_sum(y, bias)


@jax.custom_vjp
def _add_bias_f32_sum(y: jax.Array, bias: jax.Array) -> jax.Array:
  return y + bias.astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))


def _add_bias_fwd(y, bias):
  return _add_bias_f32_sum(y, bias), bias  # [F]: only its dtype is needed


def _sum_rows(dy: jax.Array) -> jax.Array:
  """dy [..., F] summed over every axis but the last: [F], in float32, or
  float64 for a float64 dy (``sum_rows_float32`` would round it)."""
  if jnp.promote_types(dy.dtype, jnp.float32) != jnp.float32:
    return jnp.sum(dy, axis=tuple(range(dy.ndim - 1)))
  return sum_rows_float32(dy)


def _add_bias_bwd(bias, dy):
  return dy, _sum_rows(dy).astype(bias.dtype)


_add_bias_f32_sum.defvjp(_add_bias_fwd, _add_bias_bwd)


def average_pool_2x2(x: jax.Array) -> jax.Array:
  """Keras' AveragePooling2D(2): [B, H, W, C] -> [B, H // 2, W // 2, C] (an
  odd last row or column dropped).

  Four strided slices summed, which XLA:CPU fuses with the ReLU before it
  into one loop; a reshape and mean becomes a YNNPACK reduction, for which
  XLA materialises its operands, zeros included (Su's capsule model trained
  1.02x faster at batch 128 with the slices: BENCHMARKS.md).
  Summed in float32 for bfloat16 inputs.
  """
  h, w = x.shape[1] // 2 * 2, x.shape[2] // 2 * 2
  wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  total = ((wide[:, 0:h:2, 0:w:2] + wide[:, 0:h:2, 1:w:2]) +
           (wide[:, 1:h:2, 0:w:2] + wide[:, 1:h:2, 1:w:2]))
  return (0.25 * total).astype(x.dtype)


class Conv2D(nnx.Module):
  """Convolution + bias, NHWC: [B, H, W, in_features] -> [B, H', W', out_features].

  H' = (H - K) // stride + 1 with 'VALID' padding, ceil(H / stride) with
  'SAME'. ``conv_impl`` picks the strided implementation (see ``conv2d``).
  ``scale`` multiplies the convolution before the bias is added:
  scale * conv(x, kernel) + bias (the official CapsNet's primary capsules).
  """

  def __init__(self, in_features: int, out_features: int, kernel_size: int,
               stride: int = 1, *, padding: str = 'VALID',
               conv_impl: str | None = None, use_bias: bool = True,
               kernel_init=_default_kernel_init, bias_init: float = 0.0,
               scale: float = 1.0, rngs: nnx.Rngs):
    for name, value in (('in_features', in_features),
                        ('out_features', out_features),
                        ('kernel_size', kernel_size), ('stride', stride)):
      _check_positive_int(name, value)
    if padding not in ('VALID', 'SAME'):
      raise ValueError(f"padding must be 'VALID' or 'SAME', got {padding!r}.")
    if conv_impl is not None and conv_impl not in CONV_IMPLS:
      raise ValueError(
          f'conv_impl must be one of {CONV_IMPLS} or None, got {conv_impl!r}.')
    self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
    self.conv_impl = conv_impl
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
    y = conv2d(x, self.kernel[...], self.stride, self.padding, self.conv_impl)
    if self.scale != 1.0:
      y = self.scale * y
    if self.bias is not None:
      y = add_bias(y, self.bias[...])
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
               conv_impl: str | None = None, squash_constant: float = 1.0,
               form: str = 'text', leaky: bool = False,
               padding: str = 'VALID',
               kernel_init=_default_kernel_init, bias_init: float = 0.0,
               rngs: nnx.Rngs):
    _check_positive_int('num_types', num_types)
    _check_positive_int('dim', dim)
    _check_form(form)
    self.num_types, self.dim = num_types, dim
    self.squash_constant = squash_constant
    self.form, self.leaky = form, leaky
    self.conv = Conv2D(in_features, num_types * dim, kernel_size, stride,
                       padding=padding, conv_impl=conv_impl,
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


class DenseCapsules(nnx.Module):
  """Fully connected capsule layer with dynamic routing (DigitCaps).

  One transform W_ij [Din, Dout] per (input, output) pair and an optional
  learned bias [O, Dout] added to s_j before the squash (the official code's
  ``capsule`` layer; it initialises W from a truncated normal with std 0.1
  and the bias to 0.1, the defaults here). Su's routing variants
  (``accumulate=False``, ``squash_constant=0.5``, ``normalize_agreement``)
  are options, so his later routing with unshared weights is this layer.

  Input [B, I, Din] -> (outputs [B, O, Dout], coupling [B, I, O]).
  """

  def __init__(self, in_caps: int, in_dim: int, out_caps: int, out_dim: int,
               num_iterations: int = 3, *, accumulate: bool = True,
               leaky: bool = False, squash_constant: float = 1.0,
               use_bias: bool = True,
               transform_std: float = OFFICIAL_WEIGHT_STD,
               bias_init: float = OFFICIAL_BIAS_INIT,
               normalize_agreement: bool = False, rngs: nnx.Rngs):
    for name, value in (('in_caps', in_caps), ('in_dim', in_dim),
                        ('out_caps', out_caps), ('out_dim', out_dim)):
      _check_positive_int(name, value)
    _check_iterations(num_iterations)
    self.num_iterations = num_iterations
    self.accumulate, self.leaky = accumulate, leaky
    self.squash_constant = squash_constant
    self.normalize_agreement = normalize_agreement
    self.weights = nnx.Param(truncated_normal_init(transform_std)(
        rngs.params(), (in_caps, out_caps, in_dim, out_dim)))
    self.bias = (nnx.Param(jnp.full((out_caps, out_dim), bias_init, jnp.float32))
                 if use_bias else None)

  def __call__(self, inputs: ArrayLike) -> tuple[jax.Array, jax.Array]:
    u_hat = votes_lib.vector_votes(inputs, self.weights[...])
    return routing.dynamic_routing(
        u_hat, self.num_iterations, accumulate=self.accumulate,
        leaky=self.leaky, squash_constant=self.squash_constant,
        bias=None if self.bias is None else self.bias[...],
        normalize_agreement=self.normalize_agreement)


class SharedCapsules(nnx.Module):
  """Capsule layer whose transform W_j is shared by every input (Su's post).

  Parameters do not depend on the number of input capsules, so the layer
  accepts any I (any image size). Defaults follow Su's Keras ``Capsule``
  layer: glorot-uniform W over [Din, O*Dout], no bias; his routing variants
  (``accumulate=False``, ``squash_constant=0.5``, ``normalize_agreement``)
  are options.

  Input [B, I, Din] (any I) -> (outputs [B, O, Dout], coupling [B, I, O]).
  """

  def __init__(self, in_dim: int, out_caps: int, out_dim: int,
               num_iterations: int = 3, *, accumulate: bool = True,
               leaky: bool = False, squash_constant: float = 1.0,
               use_bias: bool = False, bias_init: float = OFFICIAL_BIAS_INIT,
               normalize_agreement: bool = False, rngs: nnx.Rngs):
    for name, value in (('in_dim', in_dim), ('out_caps', out_caps),
                        ('out_dim', out_dim)):
      _check_positive_int(name, value)
    _check_iterations(num_iterations)
    self.num_iterations = num_iterations
    self.accumulate, self.leaky = accumulate, leaky
    self.squash_constant = squash_constant
    self.normalize_agreement = normalize_agreement
    limit = math.sqrt(6.0 / (in_dim + out_caps * out_dim))
    self.weights = nnx.Param(jax.random.uniform(
        rngs.params(), (out_caps * in_dim * out_dim,), jnp.float32, -limit,
        limit).reshape(out_caps, in_dim, out_dim))
    self.bias = (nnx.Param(jnp.full((out_caps, out_dim), bias_init, jnp.float32))
                 if use_bias else None)

  def __call__(self, inputs: ArrayLike) -> tuple[jax.Array, jax.Array]:
    u_hat = votes_lib.shared_vector_votes(inputs, self.weights[...],
                                          dot_general=conv_dot_general)
    return routing.dynamic_routing(
        u_hat, self.num_iterations, accumulate=self.accumulate,
        leaky=self.leaky, squash_constant=self.squash_constant,
        bias=None if self.bias is None else self.bias[...],
        normalize_agreement=self.normalize_agreement)


# ----------------------------------------------------------------------------
# Efficient-CapsNet (Mazzia, Salvetti, Chiaberge 2021; the authors' code
# EscVM/Efficient-CapsNet, utils/layers.py).


def depthwise_conv2d(x: ArrayLike, kernel: ArrayLike, stride: int = 1,
                     padding: str = 'VALID') -> jax.Array:
  """Depthwise convolution, NHWC: channel c convolved with its own kernel.

  Keras' ``Conv2D(C, K, groups=C)`` on C channels (one output channel per
  input channel): out[b, i, j, c] = sum_{u, v} x[b, s i + u, s j + v, c]
  kernel[u, v, 0, c].

  Args:
    x: [B, H, W, C].
    kernel: [K, K, 1, C].
  Returns:
    [B, H', W', C], H' = (H - K) // stride + 1 with 'VALID' padding.
  """
  x, kernel = jnp.asarray(x), jnp.asarray(kernel)
  if kernel.ndim != 4 or kernel.shape[2] != 1 or kernel.shape[3] != x.shape[-1]:
    raise ValueError(f'depthwise_conv2d: kernel must be [K, K, 1, C] with C = '
                     f'{x.shape[-1]} (the input channels), got {kernel.shape}.')
  return jax.lax.conv_general_dilated(
      x, kernel, (stride, stride), padding,
      dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
      feature_group_count=x.shape[-1])


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
      _check_positive_int(name, value)
    if in_features % dim:
      raise ValueError(f'in_features ({in_features}) must be a multiple of '
                       f'the capsule dim ({dim}).')
    self.dim, self.kernel_size, self.stride = dim, kernel_size, stride
    self.kernel = nnx.Param(glorot_uniform(
        rngs.params(), (kernel_size, kernel_size, 1, in_features)))
    self.bias = nnx.Param(jnp.zeros((in_features,), jnp.float32))

  def num_capsules(self, height: int, width: int) -> int:
    """Number of output capsules for an H x W input."""
    rows, cols = (votes_lib.output_size(n, self.kernel_size, self.stride)
                  for n in (height, width))
    return rows * cols * self.kernel.shape[-1] // self.dim

  def __call__(self, x: ArrayLike) -> jax.Array:
    y = add_bias(depthwise_conv2d(x, self.kernel[...], self.stride),
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
      _check_positive_int(name, value)
    self.weights = nnx.Param(he_normal(rngs.params(),
                                       (in_caps, out_caps, in_dim, out_dim)))
    self.log_priors = nnx.Param(jnp.zeros((in_caps, out_caps), jnp.float32))

  def __call__(self, inputs: ArrayLike) -> tuple[jax.Array, jax.Array]:
    votes = votes_lib.vector_votes(inputs, self.weights[...])
    return attention_routing.self_attention_routing(votes,
                                                    self.log_priors[...])


# ----------------------------------------------------------------------------
# Matrix capsules (Hinton et al. 2018).


def _dense(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
  """[..., Cin] @ [Cin, F] + [F], broadcast explicitly (no rank promotion)."""
  return add_bias(jnp.einsum('...c,cf->...f', x, kernel), bias)


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
      _check_positive_int(name, value)
    if form not in ('paper', 'released', 'released_2019'):
      raise ValueError(f"form must be 'paper', 'released' or "
                       f"'released_2019', got {form!r}.")
    self.num_types, self.pose_size, self.form = num_types, pose_size, form
    poses = num_types * pose_size * pose_size
    if form != 'paper':
      pose_key, activation_key = rngs.params(), rngs.params()
      self.kernel = nnx.Param(jnp.concatenate([
          truncated_normal_init(0.5)(pose_key, (in_features, poses)),
          truncated_normal_init(3.0)(activation_key, (in_features, num_types)),
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
    poses = _dense(x, self.pose_kernel[...], self.pose_bias[...])
    poses = poses.reshape(x.shape[:-1] + (self.num_types, p, p))
    logits = _dense(x, self.activation_kernel[...], self.activation_bias[...])
    return poses, jax.nn.sigmoid(logits)


def _check_em_routing(em_routing) -> routing.EMRouting:
  if not isinstance(em_routing, routing.EMRouting):
    raise ValueError(f'em_routing must be a routing.EMRouting (presets: '
                     f'routing.EM_ROUTING_PRESETS), got {em_routing!r}.')
  return em_routing


def _transform_init(rngs: nnx.Rngs, shape: Sequence[int], pose_size: int,
                    transform_std: float | None, transform_init: str = 'normal'
                    ) -> jax.Array:
  """A normal (or, 'truncated', TF's truncated normal: the released code's)
  with std ``transform_std``, default 1/sqrt(pose_size)."""
  std = 1.0 / math.sqrt(pose_size) if transform_std is None else transform_std
  if transform_init not in ('normal', 'truncated'):
    raise ValueError(f"transform_init must be 'normal' or 'truncated', got "
                     f'{transform_init!r}.')
  init = truncated_normal_init if transform_init == 'truncated' else normal_init
  return init(std)(rngs.params(), tuple(shape))


# On a CPU, conv_capsule_routing routes the windows in chunks whose votes
# take about this many bytes, so that one chunk's votes and their routing
# temporaries (about 6 votes-sized tensors forward and backward) stay in
# the caches instead of streaming the whole layer's through memory each
# pass: 3 windows of the paper EM model's conv capsule layers (288 x 32 x
# 16 float32 votes each; benchmarks/em_memory.py times other sizes).
WINDOW_CHUNK_BYTES = 2**21


def _check_window_chunk(window_chunk) -> None:
  if window_chunk is not None and (
      isinstance(window_chunk, bool) or not isinstance(window_chunk, int)
      or window_chunk < 0):
    raise ValueError(f'window_chunk must be None or an int >= 0, got '
                     f'{window_chunk!r}.')


def window_chunk_size(window_chunk: int | None, votes_per_window: int,
                      dtype) -> int:
  """Windows per chunk: ``window_chunk`` (0: all at once) or, for None,
  the CPU's default (``WINDOW_CHUNK_BYTES`` of votes; all at once on an
  accelerator, where one chunk at a time would leave it idle)."""
  _check_window_chunk(window_chunk)
  if window_chunk is not None:
    return window_chunk
  if jax.default_backend() != 'cpu':
    return 0
  return max(1, WINDOW_CHUNK_BYTES
             // (votes_per_window * jnp.dtype(dtype).itemsize))


def _chunk_shape(batch: int, positions: int, window_chunk: int,
                 whole_images: bool) -> tuple[int, int]:
  """(images, positions) per chunk of about ``window_chunk`` windows.

  The images per chunk divide the batch and, where the batch allows, are a
  multiple of the device count: a batch sharded over the devices then
  stays sharded inside every chunk, and the chunks run over unsharded
  axes (mapping over a sharded axis made a 4-device train step 4x
  slower).
  """
  if whole_images or window_chunk >= positions:
    per_image, images = positions, max(1, window_chunk // positions)
  else:
    per_image, images = window_chunk, 1
  devices = jax.device_count()
  step = devices if batch % devices == 0 else 1
  # A multiple of step, at most the batch (itself a multiple of step).
  images = -(-min(images, batch) // step) * step
  while batch % images:
    images += step
  return images, per_image


def _chunked_windows(route, pose_patches: jax.Array, act_patches: jax.Array,
                     images: int, per_image: int):
  """``route`` over [B, positions] windows, chunk by chunk.

  A chunk is ``per_image`` positions of ``images`` images (every
  B/images-th image, so that a sharded batch dim stays the chunk's major
  dim). Each chunk's votes and routing are recomputed in the backward pass
  (``jax.checkpoint`` per chunk), so neither pass holds more than one
  chunk's [images, per_image, I, O, P*P] temporaries, and the forward pass
  keeps only the patches for the backward.

  Args:
    route: (pose patches [b, n, I, P, P], activation patches [b, n, I]) ->
      pytree of [b, n, ...] arrays.
    pose_patches: [B, N, I, P, P]; act_patches: [B, N, I].
    images: images per chunk (divides B); per_image: positions per chunk.
  Returns:
    route's pytree over all [B, N] windows.
  """
  batch, num = pose_patches.shape[:2]
  if images >= batch and per_image >= num:
    return route(pose_patches, act_patches)
  groups, count = batch // images, -(-num // per_image)
  pad = count * per_image - num

  def split(x):
    """[B, N, ...] -> [groups * count, images, per_image, ...]; positions
    padded with zeros (zero activations route to finite outputs, sliced
    off below)."""
    if pad:
      x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    rest = x.shape[2:]
    x = x.reshape((images, groups, count, per_image) + rest)
    x = jnp.moveaxis(x, 0, 2)
    return x.reshape((groups * count, images, per_image) + rest)

  def merge(y):
    rest = y.shape[3:]
    y = jnp.moveaxis(y.reshape((groups, count, images, per_image) + rest), 2,
                     0)
    return y.reshape((batch, count * per_image) + rest)[:, :num]

  out = jax.lax.map(lambda xs: jax.checkpoint(route)(*xs),
                    (split(pose_patches), split(act_patches)))
  return jax.tree.map(merge, out)


EM_IMPLS = (None, 'kernel', 'xla')


def _check_em_impl(name: str, impl) -> None:
  if impl not in EM_IMPLS:
    raise ValueError(f"{name} must be None, 'kernel' or 'xla', got {impl!r}.")


def _use_em_kernel(impl, window_chunk, why_not: str) -> bool:
  """Whether conv_capsule_routing routes with the fused kernel."""
  _check_em_impl('impl', impl)
  if impl == 'kernel' and why_not:
    raise ValueError(f"impl='kernel': the fused EM kernel cannot route these "
                     f"windows: {why_not}. Use impl=None or 'xla'.")
  use = impl == 'kernel' or (impl is None and window_chunk is None
                             and not why_not)
  em_kernel.note_choice(use, why_not or (
      "impl='xla'" if impl == 'xla' else 'window_chunk is set'))
  return use


def conv_capsule_routing(
    poses: ArrayLike, activations: ArrayLike, weights: ArrayLike,
    beta_u: ArrayLike, beta_a: ArrayLike, *, stride: int,
    em_routing: routing.EMRouting | None = None, votes_dtype=None,
    remat_iterations: bool = False, window_chunk: int | None = None,
    impl: str | None = None, **fields
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Convolutional capsules with EM routing, as a pure function.

  Every K x K window of children is routed to the out_types parents at its
  output position: votes V = M_i W_(tap, in type, out type), I = K*K*Cin
  children ordered (row tap, column tap, type).

  Args:
    poses: [B, H, W, Cin, P, P]; activations: [B, H, W, Cin].
    weights: [K, K, Cin, Cout, P, P]; beta_u, beta_a: [Cout].
    stride: window stride.
    em_routing: the routing (``routing.EMRouting``; None: the paper's);
      ``fields``, any of its fields by name, override it. Without
      ``normalize_across_positions`` or ``released`` each window routes on
      its own (one em_routing per output position, mapped over [B, H',
      W']); ``normalize_across_positions`` normalises each child's
      assignments over every parent that receives its votes across
      positions (``votes.conv_parent_normalizer``); ``released`` is the
      released code's conv routing (``update_conv_routing``): the mass
      padded by ``mass_epsilon`` (default 1e-7) and its E-step normaliser
      ``votes.released_conv_normalizer``, windows indexed as if the stride
      were 1 unless ``true_stride``.
    votes_dtype: dtype of the votes (e.g. bfloat16 to halve their memory);
      routing statistics stay float32. None keeps the poses' dtype. The
      fused kernel rounds poses and transforms to it and then computes the
      votes and routing in float32 (it stores no votes).
    window_chunk: windows routed at a time: each chunk computes its votes
      from its pose patches and is recomputed in the backward pass
      (``jax.checkpoint``), so no pass holds more than one chunk's votes.
      With an E-step normaliser (``normalize_across_positions``,
      ``released``) the chunks are whole images, as many as fit in
      ``window_chunk`` windows (at least one). 0 routes all windows at
      once; None is 0 on an accelerator and on a CPU the windows whose
      votes take about ``WINDOW_CHUNK_BYTES``.
    impl: 'kernel' routes the windows with the fused CPU kernel
      (``em_kernel.route_windows``: votes and routing window by window in
      the core's cache, forward and backward), 'xla' through XLA in
      ``window_chunk`` chunks; None picks the kernel where it applies
      (``em_kernel.unsupported`` says why not) and ``window_chunk`` is None.
  Returns:
    (poses [B, H', W', Cout, P, P], activations [B, H', W', Cout] in the input
    poses' dtype, assignments [B, H', W', I, Cout] float32).
  """
  em_routing = routing.with_overrides(em_routing, **fields)
  poses, activations = jnp.asarray(poses), jnp.asarray(activations)
  weights = jnp.asarray(weights)
  if poses.ndim != 6 or activations.shape != poses.shape[:4]:
    raise ValueError(
        f'conv capsules: poses must be [B, H, W, C, P, P] and activations '
        f'[B, H, W, C], got {poses.shape} and {activations.shape}.')
  kernel_size, _, in_types, out_types, p, _ = weights.shape
  if poses.shape[3:] != (in_types, p, p):
    raise ValueError(
        f'conv capsules: poses {poses.shape} do not match weights [K, K, Cin, '
        f'Cout, P, P] = {weights.shape}.')
  height, width = poses.shape[1], poses.shape[2]
  out_dtype = poses.dtype
  if votes_dtype is not None:
    poses, weights = poses.astype(votes_dtype), weights.astype(votes_dtype)
  num_in = kernel_size * kernel_size * in_types
  pose_patches = votes_lib.conv_capsule_patches(poses, kernel_size, stride)
  batch, out_h, out_w = pose_patches.shape[:3]
  pose_patches = pose_patches.reshape(batch, out_h, out_w, num_in, p, p)
  act_patches = votes_lib.conv_capsule_patches(
      activations, kernel_size, stride).reshape(batch, out_h, out_w, num_in)
  options = dict(remat_iterations=remat_iterations)
  if em_routing.released:
    options.update(assignment_normalizer=votes_lib.released_conv_normalizer(
        out_h, out_w, kernel_size, stride, in_types,
        true_stride=em_routing.true_stride))
    if em_routing.mass_epsilon is None:
      em_routing = dataclasses.replace(
          em_routing, mass_epsilon=routing.RELEASED_CONV_MASS_EPSILON)
  elif em_routing.normalize_across_positions:
    options.update(assignment_normalizer=votes_lib.conv_parent_normalizer(
        height, width, kernel_size, stride, in_types))
  options.update(options=em_routing)
  flat_weights = weights.reshape(num_in, out_types, p, p)
  use_kernel = _use_em_kernel(impl, window_chunk, em_kernel.unsupported(
      p, pose_patches.dtype, normalizer='assignment_normalizer' in options,
      released=em_routing.released, remat_iterations=remat_iterations))
  if use_kernel:
    out_poses, out_acts, assignments = em_kernel.route_windows(
        pose_patches.reshape(-1, num_in, p, p),
        act_patches.reshape(-1, num_in), flat_weights, beta_u, beta_a,
        em_routing=em_routing)
    return (out_poses.reshape(batch, out_h, out_w, out_types, p, p
                              ).astype(out_dtype),
            out_acts.reshape(batch, out_h, out_w, out_types).astype(out_dtype),
            assignments.reshape(batch, out_h, out_w, num_in, out_types))
  # An E-step normaliser couples the windows of an image: it routes whole
  # images. Without one every window routes on its own (em_routing maps
  # over the leading dims exactly as a vmap over windows would; a nested
  # vmap over H', W' cost 1.5x more on CPU).
  whole_images = 'assignment_normalizer' in options

  def route(pose_windows, act_windows):
    """[b, H'*W', I, P, P], [b, H'*W', I] -> routing outputs [b, H'*W', ...]."""
    if whole_images:
      pose_windows = pose_windows.reshape((-1, out_h, out_w)
                                          + pose_windows.shape[2:])
      act_windows = act_windows.reshape(-1, out_h, out_w, num_in)
    out = routing.em_routing(
        votes_lib.matrix_votes(pose_windows, flat_weights), act_windows,
        beta_u, beta_a, **options)
    return tuple(x.reshape((-1, out_h * out_w) + x.shape[3:]) if whole_images
                 else x for x in out)

  positions = out_h * out_w
  window_chunk = window_chunk_size(
      window_chunk, num_in * out_types * p * p,
      jnp.promote_types(pose_patches.dtype, jnp.float32))
  images, per_image = (batch, positions) if not window_chunk else (
      _chunk_shape(batch, positions, window_chunk, whole_images))
  out_poses, out_acts, assignments = _chunked_windows(
      route, pose_patches.reshape((batch, positions, num_in, p, p)),
      act_patches.reshape(batch, positions, num_in), images, per_image)
  out_acts = out_acts.reshape(batch, out_h, out_w, out_types)
  assignments = assignments.reshape(batch, out_h, out_w, num_in, out_types)
  out_poses = out_poses.reshape(batch, out_h, out_w, out_types, p, p)
  return (out_poses.astype(out_dtype), out_acts.astype(out_dtype),
          assignments)


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
  recomputed in the backward pass (``conv_capsule_routing``; None: chunks
  of about ``WINDOW_CHUNK_BYTES`` of votes on a CPU, all at once on an
  accelerator). ``routing_impl``: ``conv_capsule_routing``'s ``impl`` (None:
  the fused CPU kernel where it applies).
  """

  def __init__(self, in_types: int, out_types: int, kernel_size: int = 3,
               stride: int = 2, *, pose_size: int = 4,
               em_routing: routing.EMRouting = routing.PAPER_EM,
               remat: bool = False, remat_iterations: bool = False,
               window_chunk: int | None = None, routing_impl: str | None = None,
               votes_dtype=None, transform_std: float | None = None,
               transform_init: str = 'normal',
               beta_u_init: float = 0.0, beta_a_init: float = 0.0,
               rngs: nnx.Rngs):
    for name, value in (('in_types', in_types), ('out_types', out_types),
                        ('kernel_size', kernel_size), ('stride', stride),
                        ('pose_size', pose_size)):
      _check_positive_int(name, value)
    self.kernel_size, self.stride = kernel_size, stride
    self.em_routing = _check_em_routing(em_routing)
    self.remat, self.remat_iterations = remat, remat_iterations
    _check_window_chunk(window_chunk)
    self.window_chunk = window_chunk
    _check_em_impl('routing_impl', routing_impl)
    self.routing_impl = routing_impl
    self.votes_dtype = None if votes_dtype is None else jnp.dtype(votes_dtype)
    self.weights = nnx.Param(_transform_init(
        rngs, (kernel_size, kernel_size, in_types, out_types, pose_size,
               pose_size), pose_size, transform_std, transform_init))
    self.beta_u = nnx.Param(jnp.full((out_types,), beta_u_init, jnp.float32))
    self.beta_a = nnx.Param(jnp.full((out_types,), beta_a_init, jnp.float32))

  def output_size(self, size: int) -> int:
    """H' for an input grid side H (ValueError if the kernel does not fit)."""
    return votes_lib.output_size(size, self.kernel_size, self.stride)

  def __call__(self, poses: ArrayLike, activations: ArrayLike
               ) -> tuple[jax.Array, jax.Array]:
    fn = functools.partial(
        conv_capsule_routing, stride=self.stride, em_routing=self.em_routing,
        votes_dtype=self.votes_dtype, remat_iterations=self.remat_iterations,
        window_chunk=self.window_chunk, impl=self.routing_impl)
    if self.remat:
      fn = jax.checkpoint(fn)
    out_poses, out_acts, _ = fn(poses, activations, self.weights[...],
                                self.beta_u[...], self.beta_a[...])
    return out_poses, out_acts


def class_capsule_routing(
    poses: ArrayLike, activations: ArrayLike, weights: ArrayLike,
    beta_u: ArrayLike, beta_a: ArrayLike, *, coordinate_addition: bool = True,
    coordinate_offsets: tuple[Sequence[float], Sequence[float]] | None = None,
    coordinate_order: str = 'row_col', votes_dtype=None,
    em_routing: routing.EMRouting | None = None, **fields
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Class capsules: transforms shared over positions, one EM routing.

  Args:
    poses: [B, H, W, Cin, P, P]; activations: [B, H, W, Cin].
    weights: [Cin, O, P, P]; beta_u, beta_a: [O].
    coordinate_addition: add each position's scaled (row, col) centre,
      (h + 0.5) / H and (w + 0.5) / W, to vote entries 0 and 1
      (``votes.coordinate_addition``).
    coordinate_offsets: (row offsets [H], column offsets [W]) to add
      instead (e.g. ``votes.authors_coordinates``); None: the grid's.
    coordinate_order: 'row_col' puts the row on vote entry 0 and the column
      on entry 1; 'col_row' the other way round (the released code, whose
      ``conv_pos`` swaps its two channels at each of its three calls).
    em_routing, fields: the routing, as ``routing.em_routing``'s
      ``options`` and ``fields`` (the released class layer pads the mass
      by 1e-5).
  Returns:
    (poses [B, O, P, P] in the input poses' dtype, activations [B, O]
    float32 (the class scores), assignments [B, H*W*Cin, O] float32), inputs
    ordered (row, col, type).
  """
  poses, activations = jnp.asarray(poses), jnp.asarray(activations)
  weights = jnp.asarray(weights)
  if poses.ndim != 6 or activations.shape != poses.shape[:4]:
    raise ValueError(
        f'class capsules: poses must be [B, H, W, C, P, P] and activations '
        f'[B, H, W, C], got {poses.shape} and {activations.shape}.')
  out_dtype = poses.dtype
  if votes_dtype is not None:
    poses, weights = poses.astype(votes_dtype), weights.astype(votes_dtype)
  batch = poses.shape[0]
  num_out, p = weights.shape[1], weights.shape[2]
  v = votes_lib.matrix_votes(poses, weights)  # [B, H, W, Cin, O, P*P]
  if coordinate_addition:
    v = votes_lib.coordinate_addition(v, *(coordinate_offsets or (None, None)),
                                      order=coordinate_order)
  v = v.reshape(batch, -1, num_out, p * p)
  out_poses, out_acts, assignments = routing.em_routing(
      v, activations.reshape(batch, -1), beta_u, beta_a,
      options=routing.with_overrides(em_routing, **fields))
  # The class activations are the class scores: float32 (routing.em_routing).
  return (out_poses.reshape(batch, num_out, p, p).astype(out_dtype),
          out_acts, assignments)


class ClassCapsules(nnx.Module):
  """Class capsule layer: transforms shared over positions, coordinate addition.

  W [in_types, num_classes, P, P] shared by every position; beta_u, beta_a
  [num_classes]. Votes [B, H, W, Cin, O, P*P] (+ coordinate addition) are
  routed as H*W*Cin input capsules.

  (poses [B, H, W, in_types, P, P], activations [B, H, W, in_types]) ->
  (poses [B, num_classes, P, P], activations [B, num_classes]).
  ``coordinate_offsets`` (rows, cols): what coordinate addition adds (see
  ``class_capsule_routing``); None: the grid's (h + 0.5) / H.
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
      _check_positive_int(name, value)
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
    self.weights = nnx.Param(_transform_init(
        rngs, (in_types, num_classes, pose_size, pose_size), pose_size,
        transform_std, transform_init))
    self.beta_u = nnx.Param(jnp.full((num_classes,), beta_u_init, jnp.float32))
    self.beta_a = nnx.Param(jnp.full((num_classes,), beta_a_init, jnp.float32))

  def route(self, poses: ArrayLike, activations: ArrayLike
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(poses [B, K, P, P], activations [B, K], assignments [B, H*W*Cin, K])
    (see ``class_capsule_routing``)."""
    return class_capsule_routing(
        poses, activations, self.weights[...], self.beta_u[...],
        self.beta_a[...], coordinate_addition=self.coordinate_addition,
        coordinate_offsets=self.coordinate_offsets,
        coordinate_order=self.coordinate_order, votes_dtype=self.votes_dtype,
        em_routing=self.em_routing)

  def __call__(self, poses: ArrayLike, activations: ArrayLike
               ) -> tuple[jax.Array, jax.Array]:
    out_poses, out_acts, _ = self.route(poses, activations)
    return out_poses, out_acts
