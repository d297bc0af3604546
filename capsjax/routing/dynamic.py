"""Dynamic routing (Sabour, Frosst & Hinton 2017, Procedure 1) and Su's
variants, as pure functions of the votes.

Shape legend as in ``capsjax.routing.common``. Everything here is jit-able
with the iteration count static, iterations run by ``lax.fori_loop``,
correct under ``vmap`` and ``grad``. This is the routing as XLA computes
it; ``capsjax.kernels.dynamic_routing`` chooses between it and the Pallas
kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from capsjax.routing.common import UNROLL_ITERATIONS
from capsjax.routing.common import as_float32
from capsjax.routing.common import check_iterations
from capsjax.routing.common import floating_array
from capsjax.routing.common import safe_norm
from capsjax.routing.common import squash


class DynamicRoutingState(NamedTuple):
  logits: jax.Array  # b: [..., I, O]
  outputs: jax.Array  # v: [..., O, D]


def coupling_coefficients(logits: ArrayLike, *, leaky: bool = False
                          ) -> jax.Array:
  """c_i = softmax over the OUTPUT capsules of b_i.

  The softmax runs over the output axis: each input capsule splits itself
  among the outputs. (Normalising over the input axis is the classic bug of
  open ports.) ``leaky=True`` is the official code's extra zero logit that
  absorbs orphan votes: softmax over [0, b_i1 .. b_iO], first entry dropped,
  so the coefficients of an input sum to less than 1.

  Args:
    logits: [..., I, O]
  Returns:
    [..., I, O]
  """
  logits = jnp.asarray(logits)
  if not leaky:
    return jax.nn.softmax(logits, axis=-1)
  log_total = jnp.logaddexp(0.0, jax.nn.logsumexp(logits, axis=-1,
                                                  keepdims=True))
  return jnp.exp(logits - log_total)


def _weighted_sum(votes: jax.Array, coupling: jax.Array,
                  bias: jax.Array | None) -> jax.Array:
  """s_j = sum_i c_ij u_hat_j|i [+ bias_j]: [..., I, O, D] -> [..., O, D]."""
  # float32: a routing statistic (s_j, the coupled sum of the votes).
  s = jnp.einsum('...io,...iod->...od', coupling, votes)
  if bias is not None:
    # Explicit broadcast: a bias shared over the batch ([O, D]) must not rely
    # on implicit rank promotion (tests run with jax_numpy_rank_promotion=raise).
    s = s + jnp.broadcast_to(bias, s.shape)
  return s


def dynamic_routing(
    votes: ArrayLike,
    num_iterations: int = 3,
    *,
    accumulate: bool = True,
    leaky: bool = False,
    squash_constant: float = 1.0,
    bias: ArrayLike | None = None,
    normalize_agreement: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Routing by agreement (Sabour et al. 2017, Procedure 1).

      b = 0
      repeat num_iterations times:
        c = softmax_O(b); s = sum_i c u_hat [+ bias]; v = squash(s)
        b = b + <u_hat, v>     (accumulate=False: b = <u_hat, v>;
                                normalize_agreement: s / |s| in place of v)

  The logit update after the last iteration is not computed (it would not be
  used). Gradients flow through every iteration, as in the official code.

  Args:
    votes: [..., I, O, D] predictions u_hat_j|i, any leading batch dims.
    num_iterations: static number of routing iterations (>= 1); 1 gives
      uniform coupling 1/O.
    accumulate: True is the paper's b += <u_hat, v>; False is Su's
      non-accumulating fixed-point update b = <u_hat, v> (Su Jianlin's 2018
      capsule post).
    leaky: add the official code's zero "orphan" logit.
    squash_constant: the constant in |s|^2 / (constant + |s|^2).
    bias: optional [..., O, D] (broadcastable) added to s before the squash,
      as the official code's learned bias.
    normalize_agreement: measure agreement against the unit vector s / |s|
      instead of v = squash(s), so that the logits do not depend on the
      lengths of the outputs; only the final s is squashed. With
      ``accumulate=False`` and ``squash_constant=0.5`` this is Su's later
      routing (bojone/Capsule, March 2018), for which he reports about 95%
      against 91% in the two-digit transfer test.
  Returns:
    (outputs, coupling): outputs [..., O, D] = v after the last iteration, in
    the votes' dtype; coupling [..., I, O] = the c that produced ``outputs``
    (float32; sums to 1 over O unless ``leaky``).
  """
  check_iterations(num_iterations)
  votes = floating_array(votes, 'votes')
  if votes.ndim < 3:
    raise ValueError(
        f'votes must be [..., in_caps, out_caps, dim], got shape {votes.shape}.')
  out_dtype = votes.dtype
  votes32 = as_float32(votes)
  # Everything in the votes' compute dtype, so the loop carry keeps one dtype.
  bias32 = None if bias is None else jnp.asarray(bias, votes32.dtype)

  def agreement_target(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(v = squash(s), the vector the votes agree with): [..., O, D] each."""
    outputs = squash(s, constant=squash_constant)
    if normalize_agreement:  # s / |s|: 0 at s = 0, with a finite gradient
      return outputs, s / safe_norm(s, axis=-1, keepdims=True)
    return outputs, outputs

  def step(_, state: DynamicRoutingState) -> DynamicRoutingState:
    coupling = coupling_coefficients(state.logits, leaky=leaky)
    outputs, target = agreement_target(_weighted_sum(votes32, coupling, bias32))
    # float32: a routing statistic (the agreements, summed into the logits).
    agreement = jnp.einsum('...iod,...od->...io', votes32, target)
    logits = state.logits + agreement if accumulate else agreement
    return DynamicRoutingState(logits, outputs)

  batch_shape, (num_in, num_out) = votes.shape[:-3], votes.shape[-3:-1]
  # The first iteration's coupling, softmax(b = 0), is uniform: 1/O, or
  # 1/(O + 1) with the orphan logit. It is written as that number: XLA:CPU
  # constant-folds a softmax of zeros at compile time, which took 1-29 s
  # per [B, I, O] softmax here (BENCHMARKS.md).
  uniform = 1.0 / (num_out + int(leaky))
  coupling = jnp.full(batch_shape + (num_in, num_out), uniform, votes32.dtype)
  outputs, target = agreement_target(_weighted_sum(votes32, coupling, bias32))
  if num_iterations == 1:
    return outputs.astype(out_dtype), coupling
  # b = 0 + <u_hat, v> in both update rules. The loop carry has the compute
  # dtype (float64 under jax_enable_x64).
  # float32: a routing statistic (the first agreements, the logits).
  agreement = jnp.einsum('...iod,...od->...io', votes32, target)
  state = DynamicRoutingState(agreement, outputs)
  state = jax.lax.fori_loop(0, num_iterations - 2, step, state,
                            unroll=UNROLL_ITERATIONS)
  coupling = coupling_coefficients(state.logits, leaky=leaky)
  outputs = squash(_weighted_sum(votes32, coupling, bias32),
                   constant=squash_constant)
  return outputs.astype(out_dtype), coupling
