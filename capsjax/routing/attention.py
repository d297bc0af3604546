"""Attention routings: Efficient-CapsNet's self-attention routing and the
inverted dot-product attention routing.

Shape legend as in ``capsjax.routing``: ``...`` are any leading batch
dimensions, I the input (lower) capsules, O the output (higher) capsules, D
the output capsule dimension.

- ``self_attention_routing``: Mazzia, Salvetti, Chiaberge, "Efficient-CapsNet:
  capsule network with self-attention routing", Scientific Reports 2021; as
  the authors' FCCaps layer computes it (EscVM/Efficient-CapsNet,
  utils/layers.py). Non-iterative.
- ``inverted_dot_product_routing``: Tsai, Srivastava, Goh, Salakhutdinov,
  "Capsules with inverted dot-product attention routing", ICLR 2020; as the
  authors' CapsuleFC layer computes it (apple/ml-capsules-inverted-attention-
  routing, src/layers.py), for one layer (the concurrent routing of several
  layers belongs to the model).

Both are pure functions of arrays, jit-able (the iteration count is static),
correct under ``vmap`` and ``grad``, with the conventions of
``capsjax.routing``: float32 and bfloat16 votes are routed in float32
(float64 stays float64), the outputs come back in the votes' dtype and the
couplings in the compute dtype; norms carry a floor so that zero votes give
finite values and gradients.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from capsjax.routing.common import NORM_EPSILON
from capsjax.routing.common import UNROLL_ITERATIONS
from capsjax.routing.common import check_iterations
from capsjax.routing.common import floating_array
from capsjax.routing.common import safe_norm

# torch.nn.LayerNorm's default epsilon, which the inverted dot-product
# routing's reference layer uses (added to the variance under the root).
LAYER_NORM_EPSILON = 1e-5
# The inverted routing's reference code divides the softmax by its own sum
# plus this (a no-op in float32, 1e-10 relative in float64); kept so that the
# float64 results are the reference's.
RENORMALIZE_EPSILON = 1e-10
# Routing statistics, not layers: on GPU/TPU a float32 einsum would otherwise
# run in TF32 or bfloat16 passes.
_SUM = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def _compute_dtype(x: jax.Array) -> jnp.dtype:
  """float32, or the input's dtype when it is wider (float64)."""
  return jnp.promote_types(x.dtype, jnp.float32)


def _check_votes(votes: jax.Array) -> None:
  if votes.ndim < 3:
    raise ValueError(
        f'votes must be [..., in_caps, out_caps, dim], got shape {votes.shape}.')


def efficient_squash(s: ArrayLike, axis: int = -1, *,
                     eps: float = NORM_EPSILON) -> jax.Array:
  """(1 - exp(-|s|)) s / |s|: Efficient-CapsNet's squash.

  The authors write (1 - 1 / (exp(|s|) + 1e-20)) s / (|s| + 1e-20); this is
  the same function without its two hazards: exp(|s|) overflows float32 from
  |s| = 89 (inf / inf in the gradient) and the norm's gradient is 0/0 at
  s = 0. Here |s| = sqrt(|s|^2 + eps) and 1 - exp(-|s|) = -expm1(-|s|),
  exact also for small |s|. Maps lengths into [0, 1); near zero it is the
  identity (s (1 - |s| / 2 + ...)), so a zero vector maps to zero with
  gradient 1. In float32 the squared norm overflows for |s| above about
  1.8e19 (the result is then 0).

  Args:
    s: [..., D] vectors (D along ``axis``).
  Returns:
    [..., D], same dtype as ``s``; computed in float32 (float64 stays).
  """
  s = floating_array(s, 's')
  s_wide = s.astype(_compute_dtype(s))
  norm = safe_norm(s_wide, axis=axis, keepdims=True, eps=eps)
  return (-jnp.expm1(-norm) / norm * s_wide).astype(s.dtype)


def self_attention_routing(
    votes: ArrayLike,
    log_priors: ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Efficient-CapsNet's non-iterative self-attention routing.

      a_io = <u_io, sum_k u_ko> / sqrt(D)    (agreement of input i's vote
                                              with every vote for parent o)
      c_io = softmax_O(a_io) [+ B_io]
      s_o = sum_i c_io u_io;  v_o = efficient_squash(s_o)

  The agreement is the row sum of each parent's vote self-attention matrix
  U_o U_o^T (the authors form the I x I matrix and sum it; the sum of the
  votes is the same number at O(IOD) instead of O(I^2 OD)). The softmax runs
  over the parents, as in the authors' code (axis 1 of [batch, O, I, 1]).

  ``log_priors`` is the learned B of the paper (the authors' FCCaps ``b``,
  [O, I, 1] there, initialised to zeros). The authors' code adds it to the
  couplings after the softmax, not to the logits, and so does this function:
  with priors the couplings no longer sum to 1.

  Args:
    votes: [..., I, O, D] predictions u_o|i.
    log_priors: None, or B, broadcastable to [..., I, O] (one per input and
      output capsule, shared over the batch: [I, O]).
  Returns:
    (outputs, coupling): outputs [..., O, D] = v in the votes' dtype;
    coupling [..., I, O] = c + B, the weights that produced ``outputs``
    (compute dtype; sums to 1 over O without priors).
  """
  votes = floating_array(votes, 'votes')
  _check_votes(votes)
  wide = votes.astype(_compute_dtype(votes))
  dim = votes.shape[-1]
  total = jnp.sum(wide, axis=-3)  # sum_k u_ko: [..., O, D]
  # float32: a routing statistic (the agreements of the self-attention).
  agreement = _SUM('...iod,...od->...io', wide, total) / math.sqrt(dim)
  coupling = jax.nn.softmax(agreement, axis=-1)
  if log_priors is not None:
    # Explicit broadcast: priors shared over the batch ([I, O]) must not rely
    # on implicit rank promotion.
    coupling = coupling + jnp.broadcast_to(
        jnp.asarray(log_priors, wide.dtype), coupling.shape)
  # float32: a routing statistic (the coupled sum of the votes).
  outputs = efficient_squash(_SUM('...io,...iod->...od', coupling, wide))
  return outputs.astype(votes.dtype), coupling


def pose_layer_norm(poses: ArrayLike, scale: ArrayLike | None = None,
                    offset: ArrayLike | None = None, *,
                    eps: float = LAYER_NORM_EPSILON) -> jax.Array:
  """LayerNorm over the pose: (p - mean) / sqrt(var + eps) [* scale + offset].

  The biased variance, taken in two passes (never negative), as
  torch.nn.LayerNorm. A pose with all entries equal (zero votes) maps to 0
  (then ``offset``) with a finite gradient: eps > 0 keeps the root away from
  zero.

  Args:
    poses: [..., D].
    scale, offset: None or broadcastable to [D] (the learned affine
      parameters, one per pose entry shared over the capsules).
  Returns:
    [..., D], same dtype as ``poses``; computed in float32 (float64 stays),
    as the routings.
  """
  poses = floating_array(poses, 'poses')
  wide = poses.astype(_compute_dtype(poses))
  centred = wide - jnp.mean(wide, axis=-1, keepdims=True)
  variance = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
  normalized = centred * jax.lax.rsqrt(variance + eps)
  if scale is not None:
    normalized = normalized * jnp.broadcast_to(
        jnp.asarray(scale, wide.dtype), normalized.shape)
  if offset is not None:
    normalized = normalized + jnp.broadcast_to(
        jnp.asarray(offset, wide.dtype), normalized.shape)
  return normalized.astype(poses.dtype)


def inverted_dot_product_routing(
    votes: ArrayLike,
    num_iterations: int = 2,
    *,
    layer_norm: bool = True,
    scale: ArrayLike | None = None,
    offset: ArrayLike | None = None,
    layer_norm_epsilon: float = LAYER_NORM_EPSILON,
    scale_agreement: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """Inverted dot-product attention routing (Tsai et al. 2020, Procedure 1).

      r = 1/O;  p = LayerNorm(sum_i r_io v_io)
      repeat num_iterations - 1 times:
        a_io = <v_io, p_o> / sqrt(D)
        r_io = softmax_O(a_io)            (parents compete for each child)
        p_o = LayerNorm(sum_i r_io v_io)

  The first pass is the paper's p = 0 start (zero agreement, uniform
  r = 1/O), as the authors' code computes it: the first call of a layer,
  without parent poses, routes uniformly; each of the num_routing - 1 calls
  after it is one agreement step. The authors' code also divides the softmax
  by (its sum + 1e-10), kept here, and skips the LayerNorm for D = 1 poses,
  as here. The 1/sqrt(D) scale is in their code, not in the paper's
  equation (2): ``scale_agreement=False`` drops it. Dropout, which their
  layer applies to the poses before the LayerNorm, belongs to the layer.
  Gradients flow through every iteration.

  Args:
    votes: [..., I, O, D] votes v_o|i.
    num_iterations: static number of passes T >= 1 (the authors'
      ``num_routing``; their README reports T = 2); 1 gives uniform routing.
    layer_norm: normalise each parent pose after every pass (the authors'
      nn.LayerNorm(D)); False leaves the weighted sums as they are.
    scale, offset: the LayerNorm's learned affine parameters, broadcastable
      to [D] (None: 1 and 0, torch's initial values); with ``layer_norm``
      only (ValueError otherwise), and unused for D = 1 poses.
    layer_norm_epsilon: added to the variance (torch's default 1e-5).
    scale_agreement: divide the agreement by sqrt(D).
  Returns:
    (poses, coupling): poses [..., O, D] after the last pass, in the votes'
    dtype; coupling [..., I, O] = the r that produced them (compute dtype;
    sums to 1 over O; uniform 1/O when T = 1).
  """
  check_iterations(num_iterations)
  votes = floating_array(votes, 'votes')
  _check_votes(votes)
  if not layer_norm and (scale is not None or offset is not None):
    raise ValueError('scale and offset are the LayerNorm\'s parameters: '
                     'with layer_norm=False they would be ignored; pass '
                     'layer_norm=True or drop them.')
  wide = votes.astype(_compute_dtype(votes))
  batch_shape, (num_in, num_out, dim) = votes.shape[:-3], votes.shape[-3:]
  temperature = math.sqrt(dim) if scale_agreement else 1.0

  def pose_update(coupling: jax.Array) -> jax.Array:
    """[..., I, O] -> the normalised parent poses [..., O, D]."""
    poses = _SUM('...io,...iod->...od', coupling, wide)
    if not layer_norm or dim == 1:
      return poses
    return pose_layer_norm(poses, scale, offset, eps=layer_norm_epsilon)

  def routing_coefficients(poses: jax.Array) -> jax.Array:
    """Parent poses [..., O, D] -> r [..., I, O], normalised over O."""
    agreement = _SUM('...iod,...od->...io', wide, poses) / temperature
    r = jax.nn.softmax(agreement, axis=-1)
    return r / (jnp.sum(r, axis=-1, keepdims=True) + RENORMALIZE_EPSILON)

  # Written as the number 1/O rather than a softmax of zeros, which XLA:CPU
  # constant-folds slowly (see routing.dynamic_routing).
  coupling = jnp.full(batch_shape + (num_in, num_out), 1.0 / num_out,
                      wide.dtype)
  poses = pose_update(coupling)
  if num_iterations == 1:
    return poses.astype(votes.dtype), coupling
  poses = jax.lax.fori_loop(
      0, num_iterations - 2,
      lambda _, poses: pose_update(routing_coefficients(poses)), poses,
      unroll=UNROLL_ITERATIONS)
  coupling = routing_coefficients(poses)
  return pose_update(coupling).astype(votes.dtype), coupling


__all__ = (
    'efficient_squash',
    'inverted_dot_product_routing',
    'pose_layer_norm',
    'self_attention_routing',
)
