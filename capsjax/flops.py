"""Analytical FLOP and byte counts of the routing algorithms, and rooflines.

Shape legend: N is the product of the leading batch dims of the votes (the
batch, times the H' x W' positions of a convolutional capsule layer), I the
input capsules, O the output capsules, D the capsule (pose) dimension, T the
routing iterations.

Conventions (the ones XLA's ``cost_analysis`` uses, so the two compare):
- ``flops`` counts arithmetic: one per elementwise add, multiply, divide,
  compare or negate; a multiply-add in a contraction counts 2 (a sum of I
  products of D-vectors is 2*I*D, ignoring the one add fewer).
- ``transcendentals`` counts exp, log, rsqrt, log1p separately, as XLA does.
- ``bytes`` is compulsory traffic: every input read once, every output written
  once. It is a lower bound: an implementation whose votes do not fit in cache
  re-reads them on every pass (2T - 1 passes for dynamic routing, about 3T for
  EM routing); ``streaming_bytes`` of the cost functions counts that.

Forward + backward: ``backward=True`` counts the forward pass and the
gradient of a scalar of its outputs. The backward pass of a contraction does
one contraction per operand that depends on the inputs, and that of an
elementwise op a few elementwise ops: dynamic routing's backward is counted
term by term (see ``dynamic_routing_cost``; the first iteration's coupling is
a constant), EM routing's as 2x its forward flops (every EM contraction has
two differentiated operands). Derivatives of exp, log and rsqrt reuse the
forward values, so the transcendentals are the forward's. Compulsory bytes
add the gradient of every differentiated input (written once) and the
cotangents of the outputs (read once).

XLA's own count differs from these by design: ``dynamic_routing`` writes the
first iteration's uniform coupling as a constant, which these counts price as
a softmax of zeros (4IO flops and IO exp per example, under 2% of the
total); XLA shares common subexpressions
(EM's squared deviations (V - mu)^2 are computed once for the M-step variance
and the E-step that follows), counts reductions as one op per input element,
and its backward pass recomputes or stores what autodiff chooses. Its
'bytes accessed' sums the operands and results of every fused kernel, which is
far above the compulsory traffic. Expect agreement within a small factor, not
exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple


class Cost(NamedTuple):
  """Counts of one call: arithmetic flops, transcendentals, compulsory bytes."""
  flops: float
  transcendentals: float
  bytes: float
  streaming_bytes: float  # votes re-read on every pass over them


def _split_votes_shape(votes_shape: Sequence[int]) -> tuple[int, int, int, int]:
  shape = tuple(int(s) for s in votes_shape)
  if len(shape) < 3 or min(shape) < 1:
    raise ValueError(
        f'votes_shape must be [..., I, O, D] with positive sizes, got '
        f'{votes_shape!r}.')
  return math.prod(shape[:-3]), shape[-3], shape[-2], shape[-1]


def _check_iterations(num_iterations: int) -> None:
  if not isinstance(num_iterations, int) or num_iterations < 1:
    raise ValueError(
        f'num_iterations must be a positive int, got {num_iterations!r}.')


# ----------------------------------------------------------------------------
# Dynamic routing (Sabour et al. 2017, Procedure 1), as routing.dynamic_routing.


def dynamic_iteration_flops(num_in: int, num_out: int, dim: int, *,
                            update_logits: bool = True,
                            accumulate: bool = True,
                            bias: bool = False) -> tuple[int, int]:
  """(flops, transcendentals) of one routing iteration for one example.

  With I = ``num_in``, O = ``num_out``, D = ``dim``:

    softmax_O(b) [I, O]:        max, subtract, sum, divide: 4*I*O flops and
                                I*O exp
    s = sum_i c_ij u_hat [O, D]: 2*I*O*D
    + bias [O, D]:               O*D (with ``bias``)
    squash(s) [O, D]:            square, sum, scale * s: 3*O*D; add, divide,
                                 multiply: 3*O; O rsqrt
    agreement <u_hat, v> [I, O]: 2*I*O*D   (only with ``update_logits``)
    b + agreement:               I*O       (only with ``update_logits`` and
                                 ``accumulate``)

  The last iteration does not update the logits (its update is unused).
  """
  i_o, o_d, i_o_d = num_in * num_out, num_out * dim, num_in * num_out * dim
  flops = 4 * i_o + 2 * i_o_d + 3 * o_d + 3 * num_out
  if bias:
    flops += o_d
  if update_logits:
    flops += 2 * i_o_d + (i_o if accumulate else 0)
  transcendentals = i_o + num_out
  return flops, transcendentals


def dynamic_routing_cost(votes_shape: Sequence[int], num_iterations: int = 3,
                         *, accumulate: bool = True, bias: bool = False,
                         dtype_bytes: int = 4, backward: bool = False) -> Cost:
  """Cost of ``routing.dynamic_routing(votes, num_iterations)``.

  Forward, for votes [..., I, O, D] with N = prod(...):

    flops = N * (T * (4IO + 2IOD + 3OD + 3O) + (T - 1) * (2IOD + IO))
    (the IO accumulate term only with ``accumulate``; + T*O*D with ``bias``)
    transcendentals = N * T * (IO + O)
    bytes = votes N*I*O*D*b + outputs N*O*D*b + coupling N*I*O*4 (+ bias O*D*4)

  with b = ``dtype_bytes`` (the votes' dtype; coupling is float32).
  ``streaming_bytes`` reads the votes 2T - 1 times.

  Backward (gradient with respect to the votes), per example: (8T - 7)*IOD
  for the contractions (dvotes collects 2T - 1 terms of IOD multiplies plus
  2T - 2 IOD accumulating adds; 2(T - 1) gradient contractions of 2*IOD for
  the non-constant couplings and the outputs) + 2x the forward's elementwise
  flops (forward minus its (4T - 2)*IOD of contractions).

  Args:
    votes_shape: [..., I, O, D].
    num_iterations: T >= 1.
    backward: count forward + the gradient with respect to the votes.
  """
  _check_iterations(num_iterations)
  n, num_in, num_out, dim = _split_votes_shape(votes_shape)
  flops = transcendentals = 0
  for t in range(num_iterations):
    f, tr = dynamic_iteration_flops(
        num_in, num_out, dim, update_logits=t < num_iterations - 1,
        accumulate=accumulate, bias=bias)
    flops, transcendentals = flops + f, transcendentals + tr
  flops, transcendentals = n * flops, n * transcendentals
  votes_bytes = n * num_in * num_out * dim * dtype_bytes
  small = (n * num_out * dim * dtype_bytes + n * num_in * num_out * 4
           + (num_out * dim * 4 if bias else 0))
  passes = 2 * num_iterations - 1
  if not backward:
    return Cost(flops, transcendentals, votes_bytes + small,
                passes * votes_bytes + small)
  # Backward, per example: the 2T - 1 contractions over the votes each add a
  # term c * ds or da * v to dvotes (IOD multiplies, IOD adds to accumulate
  # all but the first); the T - 1 couplings after the first (uniform, a
  # constant) and the T - 1 outputs that meet the agreements get their own
  # gradient contraction (2IOD each). Elementwise work: 2x the forward's.
  t, i_o_d = num_iterations, num_in * num_out * dim
  contractions_forward = n * (4 * t - 2) * i_o_d
  backward_flops = (n * (8 * t - 7) * i_o_d
                    + 2 * (flops - contractions_forward))
  return Cost(flops + backward_flops, transcendentals,
              2 * votes_bytes + 2 * small,
              (2 * passes + 1) * votes_bytes + 2 * small)


# ----------------------------------------------------------------------------
# EM routing (Hinton et al. 2018, Procedure 1), as routing.em_routing with the
# paper's activation form (no cost normalisation, no centre momentum).


def em_m_step_flops(num_in: int, num_out: int, dim: int) -> tuple[int, int]:
  """(flops, transcendentals) of one M-step for one example.

    R_ij a_i = exp(log R) * a [I, O]:   I*O flops, I*O exp
    mass_j = sum_i R_ij a_i [O]:        I*O
    normalised weights [I, O]:          I*O divide (+ O adds of the epsilon)
    mu = weighted sum of V [O, D]:      2*I*O*D
    sigma^2 = weighted sum of (V - mu)^2: subtract, square 2*I*O*D,
                                        contraction 2*I*O*D
    log(sigma^2 + eps) [O, D]:          O*D add, O*D log
    cost = (D beta_u + sum_h log sigma_h) * mass [O]: O*D sum + 4*O
    logit = lambda (beta_a - cost) [O]: 2*O

  Total: 6IOD + 3IO + 2OD + 7O flops, IO + OD transcendentals.
  """
  i_o, o_d, i_o_d = num_in * num_out, num_out * dim, num_in * num_out * dim
  flops = 6 * i_o_d + 3 * i_o + 2 * o_d + 7 * num_out
  return flops, i_o + o_d


def em_e_step_flops(num_in: int, num_out: int, dim: int) -> tuple[int, int]:
  """(flops, transcendentals) of one E-step for one example.

    1 / sigma^2 = exp(-log sigma^2) [O, D]: O*D negate, O*D exp
    sum_h (V - mu)^2 / sigma^2 [I, O]:      subtract, square 2*I*O*D,
                                            contraction 2*I*O*D
    sum_h (log sigma_h^2 + log 2pi) [O]:    2*O*D
    log p = -(dist + norm) / 2 [I, O]:      2*I*O
    log a_j = log_sigmoid(logit) [O]:       3*O flops, 2*O transcendentals
    log a_j + log p_ij [I, O]:              I*O
    log-softmax over O [I, O]:              max, subtract, sum, subtract 4*I*O;
                                            I*O exp and I log

  Total: 4IOD + 7IO + 3OD + 3O flops, IO + OD + I + 2O transcendentals.
  """
  i_o, o_d, i_o_d = num_in * num_out, num_out * dim, num_in * num_out * dim
  flops = 4 * i_o_d + 7 * i_o + 3 * o_d + 3 * num_out
  return flops, i_o + o_d + num_in + 2 * num_out


def em_routing_cost(votes_shape: Sequence[int], num_iterations: int = 3, *,
                    dtype_bytes: int = 4, backward: bool = False) -> Cost:
  """Cost of ``routing.em_routing(votes, activations, ...)``.

  T M-steps and T - 1 E-steps (the last E-step is not computed), then the
  sigmoid of the output logits (2*O flops, O exp) and the exp of the returned
  log R (I*O exp). For votes [..., I, O, D], N = prod(...):

    flops = N * (T * (6IOD + 3IO + 2OD + 7O) + (T - 1) * (4IOD + 7IO + 3OD
            + 3O) + 2O)
    bytes = votes N*I*O*D*b + activations N*I*4 + poses N*O*D*b
            + activations N*O*b + assignments N*I*O*4

  ``streaming_bytes`` reads the votes twice per M-step (mean, variance) and
  once per E-step: 3T - 1 passes.

  Args:
    votes_shape: [..., I, O, D] (a conv capsule layer: [B, H', W', K*K*C, O,
      16]).
    num_iterations: T >= 1.
    dtype_bytes: bytes per vote element (and per output pose/activation).
    backward: count forward + the gradients with respect to the votes and the
      input activations.
  """
  _check_iterations(num_iterations)
  n, num_in, num_out, dim = _split_votes_shape(votes_shape)
  m_flops, m_trans = em_m_step_flops(num_in, num_out, dim)
  e_flops, e_trans = em_e_step_flops(num_in, num_out, dim)
  t = num_iterations
  flops = n * (t * m_flops + (t - 1) * e_flops + 2 * num_out)
  transcendentals = n * (t * m_trans + (t - 1) * e_trans + num_out
                         + num_in * num_out)
  votes_bytes = n * num_in * num_out * dim * dtype_bytes
  small = (n * num_in * 4 + n * num_out * (dim + 1) * dtype_bytes
           + n * num_in * num_out * 4)
  passes = 3 * t - 1
  if backward:
    return Cost(3 * flops, transcendentals,
                2 * votes_bytes + 2 * small + n * num_in * 4,
                (2 * passes + 1) * votes_bytes + 2 * small + n * num_in * 4)
  return Cost(flops, transcendentals, votes_bytes + small,
              passes * votes_bytes + small)


def em_conv_kernel_cost(votes_shape: Sequence[int], num_iterations: int = 3,
                        *, backward: bool = False) -> Cost:
  """Cost of the fused conv capsule kernel (``em_cpu.route_windows``):
  the votes V_io = M_i W_io (4 x 4 products: 4 multiply-adds, 8 flops, per
  vote number, 128 per child and parent, as XLA counts a dot) and
  ``em_routing_cost``'s routing, float32.

  Its compulsory bytes are its inputs and outputs only: the pose and
  activation patches, the transforms, and the routing's outputs (the votes
  live in the core's cache), so ``streaming_bytes`` equals ``bytes``. The
  backward pass (forward + the gradients of the patches, activations and
  transforms) counts the arithmetic of a forward and two of its transposes,
  as ``em_routing_cost``; the kernel also recomputes the forward there.

  Args:
    votes_shape: [..., I, O, 16] of the windows' votes.
    num_iterations: T >= 1.
    backward: as ``em_routing_cost``.
  """
  n, num_in, num_out, dim = _split_votes_shape(votes_shape)
  routing_cost = em_routing_cost(votes_shape, num_iterations,
                                 backward=backward)
  votes_flops = n * num_in * num_out * dim * 8
  patches = n * num_in * (dim + 1) * 4
  transforms = num_in * num_out * dim * 4
  outputs = n * num_out * (dim + 1) * 4 + n * num_in * num_out * 4
  if backward:
    nbytes = 2 * (patches + transforms + outputs)
    return Cost(routing_cost.flops + 3 * votes_flops,
                routing_cost.transcendentals, nbytes, nbytes)
  nbytes = patches + transforms + outputs
  return Cost(routing_cost.flops + votes_flops, routing_cost.transcendentals,
              nbytes, nbytes)


# ----------------------------------------------------------------------------
# Rooflines.


class DevicePeak(NamedTuple):
  """Peak dense throughput (flop/s) per dtype and memory bandwidth (bytes/s)."""
  float32_flops: float
  bfloat16_flops: float
  bandwidth: float


# Vendor datasheet numbers (SXM parts; dense, no sparsity). float32 is the
# non-tensor-core rate: routing's statistics are float32 elementwise work and
# small contractions that do not use the tensor cores.
DEVICE_PEAKS: dict[str, DevicePeak] = {
    'H100': DevicePeak(67e12, 989e12, 3.35e12),
    'H200': DevicePeak(67e12, 989e12, 4.8e12),
}


def device_peak(device_kind: str) -> DevicePeak | None:
  """The ``DEVICE_PEAKS`` entry whose key occurs in ``device_kind``, or None.

  ``device_kind`` is ``jax.devices()[0].device_kind`` (e.g. 'NVIDIA H100 80GB
  HBM3'); CPUs have no entry (measure them: see benchmarks/harness.py).
  """
  for name, peak in DEVICE_PEAKS.items():
    if name.lower() in device_kind.lower():
      return peak
  return None


def roofline_seconds(cost: Cost, peak_flops: float, bandwidth: float) -> float:
  """max(flops / peak_flops, bytes / bandwidth): the time no code can beat.

  Transcendentals are counted with the flops here (one each): on CPUs and
  GPUs an exp or log costs at least one flop-slot, usually several.
  """
  if peak_flops <= 0 or bandwidth <= 0:
    raise ValueError(
        f'peak_flops and bandwidth must be positive, got {peak_flops} and '
        f'{bandwidth}.')
  return max((cost.flops + cost.transcendentals) / peak_flops,
             cost.bytes / bandwidth)


__all__ = (
    'DEVICE_PEAKS',
    'Cost',
    'DevicePeak',
    'device_peak',
    'dynamic_iteration_flops',
    'dynamic_routing_cost',
    'em_e_step_flops',
    'em_m_step_flops',
    'em_routing_cost',
    'roofline_seconds',
)


# ----------------------------------------------------------------------------
# Attention routings (capsjax.routing.attention). Backward, as EM routing's:
# 2x the forward flops (every contraction has two differentiated operands).


def efficient_squash_flops(num_out: int, dim: int) -> tuple[int, int]:
  """(flops, transcendentals) of ``efficient_squash`` on [O, D].

    |s| = sqrt(|s|^2 + eps):      square, sum 2*O*D; add O; O sqrt
    -expm1(-|s|) / |s| * s:       negate, negate, divide 3*O; O expm1;
                                  multiply O*D

  Total: 3OD + 4O flops, 2O transcendentals.
  """
  return 3 * num_out * dim + 4 * num_out, 2 * num_out


def _attention_cost(n: int, num_in: int, num_out: int, dim: int,
                    per_example: tuple[int, int], passes: int,
                    parameter_bytes: int, dtype_bytes: int,
                    backward: bool) -> Cost:
  """Cost from per-example counts; bytes as ``em_routing_cost``'s."""
  flops, transcendentals = n * per_example[0], n * per_example[1]
  votes_bytes = n * num_in * num_out * dim * dtype_bytes
  small = (n * num_out * dim * dtype_bytes + n * num_in * num_out * 4
           + parameter_bytes)
  if backward:
    return Cost(3 * flops, transcendentals, 2 * votes_bytes + 2 * small,
                (2 * passes + 1) * votes_bytes + 2 * small)
  return Cost(flops, transcendentals, votes_bytes + small,
              passes * votes_bytes + small)


def self_attention_routing_cost(votes_shape: Sequence[int], *,
                                log_priors: bool = False,
                                dtype_bytes: int = 4,
                                backward: bool = False) -> Cost:
  """Cost of ``routing.attention.self_attention_routing(votes)``.

  Per example, for votes [I, O, D]:

    sum_k u_ko [O, D]:               I*O*D
    a = <u_io, sum_k u_ko> / sqrt(D): 2*I*O*D + I*O
    softmax_O [I, O]:                4*I*O, I*O exp
    + priors [I, O]:                 I*O (with ``log_priors``)
    s = sum_i c u [O, D]:            2*I*O*D
    efficient_squash [O, D]:         3*O*D + 4*O, 2*O transcendentals

  flops = N * (5IOD + 5IO (+ IO) + 3OD + 4O), transcendentals = N * (IO + 2O),
  bytes = votes N*I*O*D*b + outputs N*O*D*b + coupling N*I*O*4 (+ priors
  I*O*4). ``streaming_bytes`` reads the votes 3 times (sum, agreement,
  weighted sum). ``backward``: 3x the forward flops.
  """
  n, num_in, num_out, dim = _split_votes_shape(votes_shape)
  i_o, i_o_d = num_in * num_out, num_in * num_out * dim
  squash_flops, squash_transcendentals = efficient_squash_flops(num_out, dim)
  flops = 5 * i_o_d + (6 if log_priors else 5) * i_o + squash_flops
  transcendentals = i_o + squash_transcendentals
  return _attention_cost(n, num_in, num_out, dim, (flops, transcendentals), 3,
                         i_o * 4 if log_priors else 0, dtype_bytes, backward)


def inverted_dot_product_routing_cost(
    votes_shape: Sequence[int], num_iterations: int = 2, *,
    layer_norm: bool = True, affine: bool = False, dtype_bytes: int = 4,
    backward: bool = False) -> Cost:
  """Cost of ``routing.attention.inverted_dot_product_routing(votes, T)``.

  Per example, for votes [I, O, D]: T pose updates and T - 1 routing
  updates (the first pass's uniform 1/O is a constant):

    pose update p = sum_i r v [O, D]:  2*I*O*D
    LayerNorm over D [O, D]:           mean O*D + O, centre O*D, square and
                                       sum 2*O*D, divide, add eps 2*O, O rsqrt,
                                       multiply O*D: 5*O*D + 3*O (+ 2*O*D with
                                       ``affine``); none with D = 1
    routing update [I, O]:             agreement 2*I*O*D + I*O (the 1/sqrt(D)),
                                       softmax_O 4*I*O and I*O exp,
                                       renormalisation 2*I*O + I

  flops = N * (T * (2IOD + LN) + (T - 1) * (2IOD + 7IO + I)),
  transcendentals = N * (T * O (with the LayerNorm) + (T - 1) * IO); bytes as
  ``self_attention_routing_cost`` (+ the affine parameters 2*D*4).
  ``streaming_bytes`` reads the votes 2T - 1 times. ``backward``: 3x the
  forward flops.
  """
  _check_iterations(num_iterations)
  n, num_in, num_out, dim = _split_votes_shape(votes_shape)
  t = num_iterations
  i_o, o_d, i_o_d = num_in * num_out, num_out * dim, num_in * num_out * dim
  norm_flops = norm_transcendentals = 0
  if layer_norm and dim > 1:
    norm_flops = 5 * o_d + 3 * num_out + (2 * o_d if affine else 0)
    norm_transcendentals = num_out
  flops = t * (2 * i_o_d + norm_flops) + (t - 1) * (2 * i_o_d + 7 * i_o
                                                    + num_in)
  transcendentals = t * norm_transcendentals + (t - 1) * i_o
  return _attention_cost(n, num_in, num_out, dim, (flops, transcendentals),
                         2 * t - 1, 2 * dim * 4 if affine else 0, dtype_bytes,
                         backward)


__all__ += (
    'efficient_squash_flops',
    'inverted_dot_product_routing_cost',
    'self_attention_routing_cost',
)


# ----------------------------------------------------------------------------
# Self-routing (capsjax.self_routing). Backward, as the attention routings':
# 2x the forward flops.


def self_routing_flops(num_in: int, num_out: int, dim: int, *,
                       in_dim: int | None = None,
                       uniform: bool = False) -> tuple[int, int]:
  """(flops, transcendentals) of self-routing for one example.

  With I = ``num_in``, O = ``num_out``, D = ``dim``:

    routing networks W_i u_i + b_i [I, O]: 2*I*Din*O + I*O (with ``in_dim``
                                    = Din: the logits made from the poses)
    softmax_O(logits) [I, O]:       4*I*O flops, I*O exp (not ``uniform``)
    w = c * a [I, O]:               I*O
    mass_j = sum_i w [O]:           I*O
    a_j = mass / max(sum_i a, eps): I + 1 + O
    u_j = sum_i w u_hat [O, D]:     2*I*O*D
    / max(mass, eps):               O*D + O

  Total: 2IOD + OD + 6IO + I + 2O + 1 flops and IO transcendentals
  (``uniform``: 4IO flops and the IO exp fewer).
  """
  i_o, o_d, i_o_d = num_in * num_out, num_out * dim, num_in * num_out * dim
  flops = 2 * i_o_d + o_d + 2 * i_o + num_in + 2 * num_out + 1
  transcendentals = 0
  if not uniform:
    flops += 4 * i_o
    transcendentals += i_o
  if in_dim is not None:
    flops += 2 * num_in * in_dim * num_out + i_o
  return flops, transcendentals


def self_routing_cost(votes_shape: Sequence[int], *,
                      in_dim: int | None = None, uniform: bool = False,
                      dtype_bytes: int = 4, backward: bool = False) -> Cost:
  """Cost of ``self_routing.self_routing(votes, activations, logits)``
  (``uniform``: of ``self_routing.uniform_routing(votes, activations)``).

  flops = N * self_routing_flops(I, O, D), transcendentals = N * I*O (0 with
  ``uniform``). With ``in_dim`` (Din) the count adds the routing networks,
  ``self_routing_logits`` of the child poses [..., I, Din]: the part of a
  self-routing layer that the other routings do not have.
  bytes = votes N*I*O*D*b + activations N*I*4 + logits N*I*O*4 (with
  ``in_dim``: poses N*I*Din*b and the networks' I*(Din + 1)*O*4 instead;
  neither with ``uniform``) + poses N*O*D*b + activations N*O*4 + coupling
  N*I*O*4. One pass over the votes: ``streaming_bytes`` = ``bytes``.
  ``backward``: 3x the forward flops.

  Args:
    votes_shape: [..., I, O, D].
    in_dim: the child pose dimension Din, to count the routing networks.
    uniform: count ``uniform_routing`` (no routing networks: ``in_dim`` is
      ignored).
    dtype_bytes: bytes per vote element (and per pose).
    backward: count forward + the gradients of the votes, the activations
      and the logits (or poses and networks).
  """
  n, num_in, num_out, dim = _split_votes_shape(votes_shape)
  in_dim = None if uniform else in_dim
  if in_dim is not None and (not isinstance(in_dim, int) or in_dim < 1):
    raise ValueError(f'in_dim must be None or a positive int, got {in_dim!r}.')
  flops, transcendentals = self_routing_flops(num_in, num_out, dim,
                                              in_dim=in_dim, uniform=uniform)
  i_o = num_in * num_out
  routing_inputs = 0
  if in_dim is not None:
    routing_inputs = n * num_in * in_dim * dtype_bytes + i_o * (in_dim + 1) * 4
  elif not uniform:
    routing_inputs = n * i_o * 4
  nbytes = (n * i_o * dim * dtype_bytes + n * num_in * 4 + routing_inputs
            + n * num_out * dim * dtype_bytes + n * num_out * 4 + n * i_o * 4)
  if backward:
    return Cost(3 * n * flops, n * transcendentals, 2 * nbytes, 2 * nbytes)
  return Cost(n * flops, n * transcendentals, nbytes, nbytes)


__all__ += (
    'self_routing_cost',
    'self_routing_flops',
)
