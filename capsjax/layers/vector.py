"""Vector-capsule layers with dynamic routing (Sabour et al. 2017; Su's
variants) (shape legend: ``capsjax.layers``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from capsjax import kernels
from capsjax import nn
from capsjax import routing
from capsjax.kernels import implementations
from capsjax.kernels.conv import dot_general as conv_dot_general
from capsjax.layers.common import DEFAULT_KERNEL_INIT
from capsjax.layers.common import OFFICIAL_BIAS_INIT
from capsjax.layers.common import OFFICIAL_WEIGHT_STD
from capsjax.layers.common import Conv2D
from capsjax.layers.common import _check_form
from capsjax.layers.common import check_positive_int
from capsjax.routing import votes as votes_lib

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
               kernel_init=DEFAULT_KERNEL_INIT, bias_init: float = 0.0,
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
