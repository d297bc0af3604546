"""Self-routing layers (Hahn, Pyeon, Kim, NeurIPS 2019): they own the
parameters and call ``capsjax.routing.self_routing`` (shape legend:
``capsjax.layers``; ``...`` any leading batch dimensions).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from capsjax.layers.common import check_positive_int
from capsjax.routing import self_routing as sr
from capsjax.routing import votes as votes_lib

COUPLINGS = ('self', 'uniform')


def authors_transform_init(key: jax.Array, shape, dtype=jnp.float32
                           ) -> jax.Array:
  """The authors' vote transforms, for W [I, O, Din, Dout]: U(-l, l) with
  l = sqrt(6 / (O * Dout * Din)).

  Their layer stores W as [K*K*A, B*D, C] (children, parents x Dout, Din)
  and draws it with torch's ``kaiming_uniform_``, whose fan_in is
  everything after the first axis: B*D*C = O * Dout * Din.
  """
  num_out, in_dim, out_dim = shape[-3:]
  limit = math.sqrt(6.0 / (num_out * in_dim * out_dim))
  size = math.prod(shape)
  return jax.random.uniform(key, (size,), dtype, -limit, limit).reshape(shape)


class SelfRoutingCapsules(nnx.Module):
  """Dense capsule layer with self-routing.

  Parameters:
    weights [I, O, Din, Dout]: the vote transforms, u_hat_j|i = W_ij u_i
      (``authors_transform_init`` unless ``transform_init`` is given).
    route_weights [I, Din, O] and route_bias [I, O]: each child's routing
      network, logits_i = W_i^route u_i + b_i^route (zeros, as the authors'
      code initialises them: the couplings start uniform).
  I * O * (Din * Dout + Din + 1) parameters; with ``couplings='uniform'``
  (the no-routing control, ``self_routing.uniform_routing``: every coupling
  1/O, no routing networks) I * O * Din * Dout.

  The authors' class layer has no pose transforms (``pose_out=False``): its
  parents are activations only, their logarithms the class scores. This
  layer always makes poses.

  (poses [..., I, Din], activations [..., I]) -> (poses [..., O, Dout] in
  the votes' dtype, activations [..., O]; ``route`` adds the coupling
  [..., I, O]). ``epsilon``: the routing's floor (``self_routing``).
  """

  def __init__(self, in_caps: int, in_dim: int, out_caps: int, out_dim: int,
               *, couplings: str = 'self', epsilon: float = sr.MASS_FLOOR,
               transform_init=authors_transform_init, rngs: nnx.Rngs):
    for name, value in (('in_caps', in_caps), ('in_dim', in_dim),
                        ('out_caps', out_caps), ('out_dim', out_dim)):
      check_positive_int(name, value)
    if couplings not in COUPLINGS:
      raise ValueError(f'couplings must be one of {COUPLINGS}, got '
                       f'{couplings!r}.')
    sr.check_epsilon(epsilon)
    self.couplings, self.epsilon = couplings, epsilon
    self.weights = nnx.Param(transform_init(
        rngs.params(), (in_caps, out_caps, in_dim, out_dim)))
    if couplings == 'self':
      self.route_weights = nnx.Param(
          jnp.zeros((in_caps, in_dim, out_caps), jnp.float32))
      self.route_bias = nnx.Param(jnp.zeros((in_caps, out_caps), jnp.float32))

  def route(self, poses: ArrayLike, activations: ArrayLike
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(poses [..., O, Dout], activations [..., O], coupling [..., I, O])."""
    votes = votes_lib.vector_votes(poses, self.weights[...])
    if self.couplings == 'uniform':
      return sr.uniform_routing(votes, activations, epsilon=self.epsilon)
    logits = sr.self_routing_logits(poses, self.route_weights[...],
                                    self.route_bias[...])
    return sr.self_routing(votes, activations, logits, epsilon=self.epsilon)

  def __call__(self, poses: ArrayLike, activations: ArrayLike
               ) -> tuple[jax.Array, jax.Array]:
    out_poses, out_activations, _ = self.route(poses, activations)
    return out_poses, out_activations
