"""Self-routing (Hahn, Pyeon, Kim, "Self-Routing Capsule Networks", NeurIPS
2019) and uniform routing, its no-routing control.

Shape legend as in ``capsjax.routing``: ``...`` are any leading batch
dimensions, I the input (child) capsules, O the output (parent) capsules, D
the parent pose dimension, Din the child pose dimension.

Self-routing has no iterations and no agreement: each child i has its own
routing network, a single-layer perceptron W_i^route [Din, O], b_i^route
[O] on its own pose u_i, whose softmax over the parents is the child's
coupling c_ij. Each parent is then a mixture of the children's votes, as in
a mixture of experts:

    c_ij = softmax_j(W_i^route u_i + b_i^route)          (couplings)
    a_j  = sum_i c_ij a_i / sum_i a_i                    (parent activation)
    u_j  = sum_i c_ij a_i u_hat_j|i / sum_i c_ij a_i     (parent pose)

with u_hat_j|i = W_ij u_i the votes. As the parents' couplings of a child
sum to 1, sum_j a_j = 1: the parent activations are a distribution over the
parents, and the authors' class layer scores log a_j (under an NLL loss).

The authors' code (coder3000/SR-CapsNet, modules.py, ``SelfRouting2d``)
computes these equations as printed, over the K x K x A children of each
convolution window, so there is no second form to offer. Where it differs
from this module:
- it has no floor: its divisions by sum_i c_ij a_i and sum_i a_i are 0/0
  where every child's activation is 0. Here both divisors are floored
  (``epsilon``, below), so values and gradients stay finite for every
  input;
- it starts W^route and b^route at zero, so the couplings start uniform,
  1/O: at initialisation self-routing is ``uniform_routing``
  (``layers.SelfRoutingCapsules`` starts the same way);
- its class layer makes no poses (``pose_out=False``), only the parent
  activations, whose logarithms are the class scores.

``self_routing`` takes the routing logits W_i^route u_i + b_i^route ready
made (``self_routing_logits`` computes them for dense capsules), so that a
layer may produce them as it likes (per child, or per kernel tap shared
over the positions of a convolutional layer, as the authors' code does).

Conventions of ``capsjax.routing``: pure functions, jit-able, correct under
``vmap`` and ``grad``; float32 and bfloat16 inputs are routed in float32
(float64 stays float64); the poses come back in the votes' dtype, the
activations and couplings in the compute dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from capsjax.routing.common import floating_array

# The floor of both divisors, sum_i a_i and sum_i c_ij a_i: max(divisor,
# MASS_FLOOR). Above it the equations are exact; below it (all children
# inactive, or a parent that receives almost no mass) the quotient goes to
# 0 linearly instead of becoming 0/0, and its gradient stays finite.
MASS_FLOOR = 1e-6
# Routing statistics, not layers: on GPU/TPU a float32 einsum would otherwise
# run in TF32 or bfloat16 passes.
_SUM = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def _compute_dtype(x: jax.Array) -> jnp.dtype:
  """float32, or the input's dtype when it is wider (float64)."""
  return jnp.promote_types(x.dtype, jnp.float32)


def check_epsilon(epsilon: float) -> None:
  if (isinstance(epsilon, bool) or not isinstance(epsilon, (int, float))
      or not epsilon > 0.0):
    raise ValueError(f'epsilon must be a positive number (the floor of the '
                     f'divisors), got {epsilon!r}.')


def _checked_inputs(votes: ArrayLike, activations: ArrayLike
                    ) -> tuple[jax.Array, jax.Array]:
  """(votes, activations) as arrays; ValueError unless [..., I, O, D] and
  [..., I]."""
  votes = floating_array(votes, 'votes')
  activations = jnp.asarray(activations)
  if votes.ndim < 3:
    raise ValueError(
        f'votes must be [..., in_caps, out_caps, dim], got shape {votes.shape}.')
  if activations.shape != votes.shape[:-2]:
    raise ValueError(
        f'activations must be [..., in_caps] = {votes.shape[:-2]} to match '
        f'votes {votes.shape}, got {activations.shape}.')
  return votes, activations


def _mix(votes: jax.Array, activations: jax.Array, coupling: jax.Array,
         epsilon: float) -> tuple[jax.Array, jax.Array]:
  """Parent poses and activations from the couplings.

  Args:
    votes: [..., I, O, D]; activations: [..., I]; coupling: [..., I, O];
      all in the compute dtype.
  Returns:
    (poses [..., O, D], activations [..., O]), compute dtype.
  """
  weights = coupling * activations[..., None]  # c_ij a_i: [..., I, O]
  mass = jnp.sum(weights, axis=-2)  # sum_i c_ij a_i: [..., O]
  total = jnp.sum(activations, axis=-1, keepdims=True)  # sum_i a_i: [..., 1]
  parent_activations = mass / jnp.maximum(total, epsilon)
  poses = _SUM('...io,...iod->...od', weights, votes)
  poses = poses / jnp.maximum(mass, epsilon)[..., None]
  return poses, parent_activations


def self_routing(
    votes: ArrayLike,
    activations: ArrayLike,
    routing_logits: ArrayLike,
    *,
    epsilon: float = MASS_FLOOR,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Self-routing (Hahn et al. 2019): one pass, no agreement.

      c_ij = softmax_j(logits_ij)
      a_j  = sum_i c_ij a_i / max(sum_i a_i, epsilon)
      u_j  = sum_i c_ij a_i u_hat_j|i / max(sum_i c_ij a_i, epsilon)

  The softmax runs over the parents: each child splits itself among them.
  Without the floors these are the paper's equations, and the authors'
  code's: while sum_i a_i and a parent's sum_i c_ij a_i are at least
  ``epsilon`` the floors change nothing. A child of activation 0 adds
  nothing to either sum, so it changes no parent. Where every activation is
  0 the parents' poses and activations are 0.

  Args:
    votes: [..., I, O, D] votes u_hat_j|i = W_ij u_i.
    activations: [..., I] child activations a_i >= 0 (in [0, 1] in the
      paper: sigmoids).
    routing_logits: [..., I, O] each child's routing network's output,
      W_i^route u_i + b_i^route (``self_routing_logits``).
    epsilon: the floor of both divisors (> 0).
  Returns:
    (poses, activations, coupling): poses [..., O, D] u_j in the votes'
    dtype; activations [..., O] a_j (compute dtype; in [0, 1] for child
    activations in [0, 1], summing to 1 over O while sum_i a_i >=
    ``epsilon``); coupling [..., I, O] c_ij (compute dtype; sums to 1 over
    O).
  """
  check_epsilon(epsilon)
  votes, activations = _checked_inputs(votes, activations)
  routing_logits = jnp.asarray(routing_logits)
  if routing_logits.shape != votes.shape[:-1]:
    raise ValueError(
        f'routing_logits must be [..., in_caps, out_caps] = '
        f'{votes.shape[:-1]} to match votes {votes.shape}, got '
        f'{routing_logits.shape}.')
  dtype = _compute_dtype(votes)
  # softmax subtracts the largest logit first: finite for any finite logits.
  coupling = jax.nn.softmax(routing_logits.astype(dtype), axis=-1)
  poses, parent_activations = _mix(votes.astype(dtype),
                                   activations.astype(dtype), coupling,
                                   epsilon)
  return poses.astype(votes.dtype), parent_activations, coupling


def uniform_routing(
    votes: ArrayLike,
    activations: ArrayLike,
    *,
    epsilon: float = MASS_FLOOR,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """No routing: self-routing with the routing networks removed.

  Every child couples to every parent with c_ij = 1/O (self-routing with
  all routing logits 0, which is also self-routing at the authors'
  initialisation), so

      a_j = 1/O              (while sum_i a_i >= epsilon; 0 when all a_i = 0)
      u_j = sum_i a_i u_hat_j|i / max(sum_i a_i, O epsilon)

  each parent pose is the activation-weighted mean of its votes (pass
  activations of ones for the plain mean). The parent activations carry no
  information about the input: a head on this control has to read its class
  scores from the poses.

  Args:
    votes: [..., I, O, D]; activations: [..., I] a_i >= 0.
    epsilon: the floor of both divisors (> 0), as ``self_routing``'s.
  Returns:
    (poses [..., O, D] in the votes' dtype, activations [..., O], coupling
    [..., I, O] = 1/O), as ``self_routing``.
  """
  check_epsilon(epsilon)
  votes, activations = _checked_inputs(votes, activations)
  dtype = _compute_dtype(votes)
  # The number 1/O, not a softmax of zeros, which XLA:CPU constant-folds
  # slowly (see routing.dynamic_routing).
  coupling = jnp.full(votes.shape[:-1], 1.0 / votes.shape[-2], dtype)
  poses, parent_activations = _mix(votes.astype(dtype),
                                   activations.astype(dtype), coupling,
                                   epsilon)
  return poses.astype(votes.dtype), parent_activations, coupling


def self_routing_logits(poses: ArrayLike, weights: ArrayLike,
                        bias: ArrayLike) -> jax.Array:
  """Each child's routing network: logits_ij = (W_i^route u_i + b_i^route)_j.

  Args:
    poses: [..., I, Din] child poses u_i.
    weights: [I, Din, O] W^route, one matrix per child.
    bias: [I, O] b^route, one vector per child.
  Returns:
    [..., I, O] routing logits, computed in float32 (float64 stays).
  """
  poses = floating_array(poses, 'poses')
  weights, bias = jnp.asarray(weights), jnp.asarray(bias)
  num_in, in_dim = poses.shape[-2:] if poses.ndim >= 2 else (None, None)
  if (poses.ndim < 2 or weights.ndim != 3
      or weights.shape[:2] != (num_in, in_dim)
      or bias.shape != (num_in, weights.shape[2])):
    raise ValueError(
        f'self_routing_logits: poses [..., I, Din] = {poses.shape}, weights '
        f'[I, Din, O] = {weights.shape} and bias [I, O] = {bias.shape} do '
        f'not match.')
  dtype = _compute_dtype(poses)
  logits = _SUM('...id,ido->...io', poses.astype(dtype), weights.astype(dtype))
  # Explicit broadcast: the bias is shared over the batch.
  return logits + jnp.broadcast_to(bias.astype(dtype), logits.shape)


__all__ = (
    'MASS_FLOOR',
    'self_routing',
    'self_routing_logits',
    'uniform_routing',
)
