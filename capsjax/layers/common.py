"""What every layer shares: argument checks, the authors' initialisers, a
convolution and batch normalisation (shape legend: ``capsjax.layers``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from capsjax import kernels
from capsjax import nn
from capsjax.kernels import implementations
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
DEFAULT_KERNEL_INIT = nn.lecun_normal


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
               kernel_init=DEFAULT_KERNEL_INIT, bias_init: float = 0.0,
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


class SuTrunk(nnx.Module):
  """Su's shared trunk, Keras defaults (VALID padding, 2x2 average pool).

  Conv 3x3 ReLU, conv 3x3 ReLU, average pool 2x2 (floor), conv 3x3 ReLU,
  conv 3x3 ReLU, of ``widths`` (4 positive ints, checked by the caller,
  which names them): [B, H, W, C] -> [B, (H-4)//2 - 4, (W-4)//2 - 4,
  widths[-1]] (28x28 -> 8x8, 56x28 -> 22x8). Inputs need H, W >= 14: each
  output position sees a 14x14 window of the input, at stride 2.
  """

  def __init__(self, in_channels: int, widths: tuple[int, ...], *,
               kernel_init=nn.glorot_uniform,
               implementation: str | None = None, rngs: nnx.Rngs):
    sizes = (in_channels,) + tuple(widths)
    self.convs = nnx.List([
        Conv2D(a, b, 3, kernel_init=kernel_init,
               implementation=implementation, rngs=rngs)
        for a, b in zip(sizes[:-1], sizes[1:], strict=True)])

  def __call__(self, x: jax.Array) -> jax.Array:
    if min(x.shape[1:3]) < 14:
      raise ValueError(
          f'images must be at least 14x14 for this trunk, got {x.shape}.')
    for i, conv in enumerate(self.convs):
      x = jax.nn.relu(conv(x))
      if i == 1:
        x = nn.average_pool_2x2(x)
    return x
