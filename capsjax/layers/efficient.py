"""Efficient-CapsNet's layers (Mazzia et al. 2021): depthwise primary
capsules and self-attention routing (shape legend: ``capsjax.layers``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from capsjax import nn
from capsjax.layers.common import check_positive_int
from capsjax.routing import attention as attention_routing
from capsjax.routing import votes as votes_lib

# ----------------------------------------------------------------------------
# Efficient-CapsNet (Mazzia, Salvetti, Chiaberge 2021; the authors' code
# EscVM/Efficient-CapsNet, utils/layers.py).



class DepthwisePrimaryCapsules(nnx.Module):
  """Efficient-CapsNet's primary capsules (the authors' ``PrimaryCaps``):
  a depthwise convolution with bias, its channels grouped into capsules of
  ``dim``, squashed by ``routing.attention.efficient_squash``.

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
  ``routing.attention.self_attention_routing`` with learned priors.

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
