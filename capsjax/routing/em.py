"""EM routing (Hinton, Sabour & Frosst 2018, Procedure 1) as pure functions:
the M- and E-steps, the routing options (``EMRouting``) with the paper's,
the authors' and the released code's forms, and ``em_routing``.

Shape legend as in ``capsjax.routing.common`` (D is the pose dimension, 16
for 4x4 poses). Everything here is jit-able with the iteration count
static, iterations run by ``lax.fori_loop``, correct under ``vmap`` and
``grad``; statistics are float32 and the activations, class scores, stay
float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from capsjax.routing.common import UNROLL_ITERATIONS
from capsjax.routing.common import as_float32
from capsjax.routing.common import check_iterations
from capsjax.routing.common import floating_array

# Added to every variance in EM routing (the Gaussians' variance floor). A zero
# variance (all votes equal) would make log sigma = -inf. The authors' released
# code uses 5e-4; pass variance_epsilon=5e-4 to use theirs.
VARIANCE_FLOOR = 1e-4
# Added to the mass sum_i R_ij a_i before it divides: a parent that receives no
# mass (all-zero activations) gets mean 0 and variance = the floor, not 0/0.
MASS_EPSILON = 1e-6
# The released EM code (google-research capsule_em, em_layers.py) adds its
# epsilon to the mass itself and uses that padded mass in the mean, the
# variance and the activation logit: 1e-5 in the class layer
# (update_em_routing), 1e-7 in conv capsule layers (update_conv_routing).
RELEASED_CLASS_MASS_EPSILON = 1e-5
RELEASED_CONV_MASS_EPSILON = 1e-7
# Final inverse temperature of the authors' schedule (their answer in the
# OpenReview thread and their released code).
FINAL_INVERSE_TEMPERATURE = 0.01
# Keeps the std of the normalised cost away from zero (identical costs).
COST_STD_EPSILON = 1e-6
_LOG_2PI = math.log(2.0 * math.pi)

Normalizer = Callable[[jax.Array], jax.Array]


def inverse_temperature_schedule(
    num_iterations: int, final: float = FINAL_INVERSE_TEMPERATURE
) -> tuple[float, ...]:
  """The authors' schedule lambda_t = final * (1 - 0.95^(t+1)), t = 0..T-1."""
  check_iterations(num_iterations)
  return tuple(final * (1.0 - 0.95 ** (t + 1)) for t in range(num_iterations))


def inverse_temperatures(inverse_temperature, num_iterations: int, dtype
                          ) -> jax.Array:
  """[T] lambdas in the routing's compute dtype (float64 under x64)."""
  if inverse_temperature is None:
    values = inverse_temperature_schedule(num_iterations)
  elif isinstance(inverse_temperature, (int, float)):
    values = (float(inverse_temperature),) * num_iterations
  else:
    values = jnp.asarray(inverse_temperature, dtype)
    if values.shape == ():
      return jnp.full((num_iterations,), values)
    if values.shape != (num_iterations,):
      raise ValueError(
          f'inverse_temperature must be None, a float or one value per '
          f'iteration ({num_iterations}), got shape {values.shape}.')
    return values
  return jnp.asarray(values, dtype)


class EMRoutingState(NamedTuple):
  log_assignments: jax.Array  # log R, parent-major: [..., O, I]
  poses: jax.Array  # mu: [..., O, D]
  log_variances: jax.Array  # log sigma^2: [..., O, D]
  activation_logits: jax.Array  # logit of a_j: [..., O]


# EM routing works parent-major: votes [..., O, I, D], assignments [..., O, I].
# Every weighted sum over the children is then a batched matrix-vector
# product whose batch dims (..., O) already lead, so XLA runs it without a
# layout copy of the votes; child-major votes [..., I, O, D] made XLA:CPU
# either copy them into that order or materialise the [..., I, O] weights
# broadcast over D (1.25x slower train step of the paper EM model;
# BENCHMARKS.md). HIGHEST: these are statistics, not layers; on GPU/TPU a
# float32 einsum would otherwise run in TF32 or bfloat16 passes.
_SUM = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def em_m_step(
    votes: jax.Array,
    activations: jax.Array,
    log_assignments: jax.Array,
    beta_u: jax.Array,
    beta_a: jax.Array,
    inverse_temperature: jax.Array,
    previous_poses: jax.Array,
    *,
    variance_epsilon: float = VARIANCE_FLOOR,
    normalize_cost: bool = False,
    center_momentum: float = 0.0,
    activation_form: str = 'paper',
    padded_mass_epsilon: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One M-step: fit each parent's diagonal Gaussian and its activation.

  Args:
    votes: [..., O, I, D] float32, parent-major.
    activations: [..., I] float32 input activations a_i.
    log_assignments: [..., O, I] log R.
    beta_u, beta_a: broadcastable to [O].
    inverse_temperature: scalar lambda.
    previous_poses: [..., O, D] the last mean (used with center_momentum).
    padded_mass_epsilon: None adds ``MASS_EPSILON`` to the divisor of the
      mean and variance only; a float adds it to the mass sum_i R_ij a_i
      itself, which the mean, the variance and the cost then use (the
      released code's form).
  Returns:
    (poses mu [..., O, D], log_variances [..., O, D], activation_logits [..., O]).
  """
  weights = jnp.exp(log_assignments) * activations[..., None, :]  # R_ij a_i
  mass = jnp.sum(weights, axis=-1)  # [..., O]
  # One beta per output type, shared over the batch: broadcast explicitly
  # rather than by implicit rank promotion.
  beta_u = jnp.broadcast_to(beta_u, mass.shape)
  beta_a = jnp.broadcast_to(beta_a, mass.shape)
  if padded_mass_epsilon is None:
    normalized = weights / (mass[..., None] + MASS_EPSILON)
  else:
    mass = mass + padded_mass_epsilon
    normalized = weights / mass[..., None]
  # float32: a routing statistic (each parent's mean of the votes).
  poses = _SUM('...oi,...oid->...od', normalized, votes)
  if center_momentum:
    # The released code's centre update mu = 0.9 new + 0.1 old (old = 0 at
    # the first iteration, as there).
    poses = (1.0 - center_momentum) * poses + center_momentum * previous_poses
  # Two-pass variance: E[(V - mu)^2] never goes negative, E[V^2] - mu^2 can.
  # float32: a routing statistic (each parent's variance of the votes).
  variances = _SUM('...oi,...oid->...od', normalized,
                   jnp.square(votes - poses[..., None, :]))
  log_variances = jnp.log(variances + variance_epsilon)
  dim = votes.shape[-1]
  if activation_form == 'paper':
    # cost_h = (beta_u + log sigma_h) * sum_i R_ij a_i, log sigma = log var / 2.
    cost = (dim * beta_u + 0.5 * jnp.sum(log_variances, axis=-1)) * mass
  elif activation_form == 'authors':
    # The released code: mass * (sum_h log var_h + beta_u D (log 2pi + 1)),
    # and -5000 beta_a in place of +beta_a below.
    cost = mass * (jnp.sum(log_variances, axis=-1)
                   + beta_u * dim * (_LOG_2PI + 1.0))
  else:
    raise ValueError(
        f"activation_form must be 'paper' or 'authors', got {activation_form!r}.")
  if normalize_cost:
    # A popular variant of open EM implementations: a_cost = (mean_O cost -
    # cost) / std_O cost; not in the paper.
    mean = jnp.mean(cost, axis=-1, keepdims=True)
    # The epsilon goes under the square root: sqrt has an infinite gradient
    # at 0, and the costs are all equal for one output capsule or when no
    # input is active (all-zero activations).
    std = jnp.sqrt(jnp.mean(jnp.square(cost - mean), axis=-1, keepdims=True)
                   + COST_STD_EPSILON**2)
    cost = (cost - mean) / std
  if activation_form == 'paper':
    activation_logits = inverse_temperature * (beta_a - cost)
  else:
    activation_logits = inverse_temperature * (-cost - 5000.0 * beta_a)
  return poses, log_variances, activation_logits


def em_e_step(votes: jax.Array, poses: jax.Array, log_variances: jax.Array,
              activation_logits: jax.Array,
              normalizer: Normalizer | None = None) -> jax.Array:
  """One E-step: R_ij proportional to a_j p_j(V_ij), in log space.

  Args:
    votes: [..., O, I, D] parent-major; poses, log_variances: [..., O, D];
    activation_logits: [..., O].
    normalizer: maps log-numerators [..., I, O] to log R (None: softmax over
      the O parents).
  Returns:
    log R: [..., O, I].
  """
  # float32: a routing statistic (the E-step's scaled squared distances).
  sq_dist = _SUM('...oid,...od->...oi',
                 jnp.square(votes - poses[..., None, :]),
                 jnp.exp(-log_variances))
  log_p = -0.5 * (sq_dist + jnp.sum(log_variances + _LOG_2PI, axis=-1)[
      ..., None])
  # log a_j = log sigmoid(logit): finite even where a_j underflows to 0.
  log_numerators = jax.nn.log_sigmoid(activation_logits)[..., None] + log_p
  if normalizer is None:
    return jax.nn.log_softmax(log_numerators, axis=-2)
  # Normalisers see the public child-major layout; [..., I, O] is small.
  return jnp.swapaxes(normalizer(jnp.swapaxes(log_numerators, -1, -2)),
                      -1, -2)


@dataclasses.dataclass(frozen=True)
class EMRouting:
  """What EM routing computes, as one frozen, hashable value: the routing
  functions, the capsule layers, the fused kernel and
  ``models.MatrixCapsNet`` take it whole. ``EM_ROUTING_PRESETS`` names the
  usual sets; ``em_routing_preset(name, **fields)`` (or
  ``dataclasses.replace``) changes fields.

  Fields:
    num_iterations: static number of iterations T >= 1.
    inverse_temperature: None for the authors' schedule lambda_t = 0.01
      (1 - 0.95^(t+1)); a float for a constant lambda; or T values (stored
      as a tuple of floats; a jax array, e.g. traced, is kept as given).
    variance_epsilon: the variance floor added to every sigma^2.
    normalize_cost: replace the cost by (cost - mean_O) / std_O before the
      logistic (a popular variant of open implementations; not in the paper).
    center_momentum: m in mu_t = (1 - m) mu_new + m mu_{t-1} (released code:
      0.1, with mu_{-1} = 0). 0 is the paper.
    activation_form: 'paper' (lambda (beta_a - sum_h cost_h)) or 'authors',
      the released code's logit lambda (-mass (sum_h log sigma_h^2 + beta_u
      D (log 2pi + 1)) - 5000 beta_a).
    released: the released code's slow path where it differs beyond the
      options above: the mass sum_i R_ij a_i is padded by ``mass_epsilon``
      and that padded mass enters the mean, the variance and the activation
      logit (False adds ``MASS_EPSILON`` to the mean's and variance's
      divisor only); conv capsule layers also take its E-step normaliser
      (``votes.released_conv_normalizer``: each (child, parent type) over
      the windows covering the child, windows indexed as if the stride
      were 1).
    mass_epsilon: the padding with ``released``; None: the layer's, 1e-5 in
      the class layer and ``em_routing`` (``RELEASED_CLASS_MASS_EPSILON``),
      1e-7 in conv capsule layers (``RELEASED_CONV_MASS_EPSILON``).
    normalize_across_positions: conv capsule layers: normalise each child's
      assignments over every parent that receives its votes across
      positions (``votes.conv_parent_normalizer``) instead of within each
      window.
    true_stride: conv capsule layers with ``released``: index the windows'
      children with the layer's stride (a correction of the released code;
      no effect at stride 1).
  ``em_routing`` routes given votes: it takes an E-step normaliser as an
  argument and does not read the two conv-only fields.
  """

  num_iterations: int = 3
  inverse_temperature: float | tuple[float, ...] | jax.Array | None = None
  variance_epsilon: float = VARIANCE_FLOOR
  normalize_cost: bool = False
  center_momentum: float = 0.0
  activation_form: str = 'paper'
  released: bool = False
  mass_epsilon: float | None = None
  normalize_across_positions: bool = False
  true_stride: bool = False

  def __post_init__(self):
    check_iterations(self.num_iterations)
    if self.activation_form not in ('paper', 'authors'):
      raise ValueError(f"activation_form must be 'paper' or 'authors', got "
                       f'{self.activation_form!r}.')
    if not self.variance_epsilon >= 0:
      raise ValueError(
          f'variance_epsilon must be >= 0, got {self.variance_epsilon!r}.')
    if not 0.0 <= self.center_momentum < 1.0:
      raise ValueError(
          f'center_momentum must be in [0, 1), got {self.center_momentum!r}.')
    if not self.released and (self.mass_epsilon is not None
                              or self.true_stride):
      raise ValueError('mass_epsilon and true_stride apply with released=True '
                       'only.')
    if self.released and self.normalize_across_positions:
      raise ValueError('released=True brings its own E-step normaliser; '
                       'leave normalize_across_positions False.')
    # Frozen: __post_init__ stores the checked value with object.__setattr__.
    object.__setattr__(self, 'inverse_temperature', _static_inverse_temperature(
        self.inverse_temperature, self.num_iterations))


def _static_inverse_temperature(inverse_temperature, num_iterations: int):
  """None, a float or a tuple of T floats: static, hashable routing options
  (a jax array is returned as it is: it may be traced)."""
  if inverse_temperature is None or isinstance(inverse_temperature,
                                               jax.Array):
    return inverse_temperature
  try:
    values = np.asarray(inverse_temperature, np.float64)
  except (TypeError, ValueError):
    values = None
  if values is None or values.ndim > 1 or not np.all(np.isfinite(values)):
    raise ValueError(
        f'inverse_temperature must be None (the authors\' schedule), a '
        f'number or one number per iteration, got {inverse_temperature!r}.')
  if values.ndim == 0:
    return float(values)
  if len(values) != num_iterations:
    raise ValueError(
        f'inverse_temperature needs one value per iteration '
        f'({num_iterations}), got {len(values)}.')
  return tuple(float(t) for t in values)


# The paper's text (Hinton et al. 2018, Procedure 1): 3 iterations, the
# authors' lambda schedule (final 0.01), capsjax's variance floor (the paper
# prints none).
PAPER_EM = EMRouting()
# The authors' formulas in the paper's procedure: the released code's
# activation logit, centre momentum and variance floor, each window routed
# on its own (so the fused conv kernel can route it).
AUTHORS_EM = EMRouting(variance_epsilon=5e-4, center_momentum=0.1,
                       activation_form='authors')
# The released EM code's routing (google-research capsule_em, the slow path
# of em_layers.py): the authors' formulas plus its padded mass and, in conv
# capsule layers, its E-step normaliser. The caller passes the released
# inverse temperatures (``inverse_temperature_schedule``, final lambda 0.01,
# a quarter of it in the class layer: ``models.MatrixCapsNet``'s
# ``class_lambda_scale``).
RELEASED_EM = dataclasses.replace(AUTHORS_EM, released=True)
# capsjax's options, the EM configs' default (docs/em_routing_options.md):
# 2 iterations, the cost normalised, a constant lambda = 1.
CAPSJAX_EM = EMRouting(num_iterations=2, inverse_temperature=1.0,
                       normalize_cost=True)
EM_ROUTING_PRESETS = {'paper': PAPER_EM, 'authors': AUTHORS_EM,
                      'released': RELEASED_EM, 'capsjax': CAPSJAX_EM}


def em_routing_preset(name: str, **fields) -> EMRouting:
  """The preset ``name`` of ``EM_ROUTING_PRESETS`` with ``fields`` replaced."""
  if name not in EM_ROUTING_PRESETS:
    raise ValueError(f'unknown EM routing preset {name!r}; known: '
                     f'{", ".join(EM_ROUTING_PRESETS)}.')
  return dataclasses.replace(EM_ROUTING_PRESETS[name], **fields)


def em_routing_with(em_routing: str | EMRouting,
                    overrides: Mapping[str, Any] | None = None) -> EMRouting:
  """``em_routing`` (a preset's name or an ``EMRouting``) with the fields of
  ``overrides`` that are set: a None leaves the preset's value, as configs
  list every field unset (the models and the PyTorch reference read them
  so)."""
  if isinstance(em_routing, str):
    em_routing = em_routing_preset(em_routing)
  elif not isinstance(em_routing, EMRouting):
    raise ValueError(f'em_routing must be a preset name ('
                     f'{", ".join(EM_ROUTING_PRESETS)}) or a '
                     f'routing.EMRouting, got {em_routing!r}.')
  return dataclasses.replace(em_routing, **{
      key: value for key, value in dict(overrides or {}).items()
      if value is not None})


def with_overrides(options: EMRouting | None, num_iterations: int | None = None,
                   **fields) -> EMRouting:
  """``options`` (None: ``PAPER_EM``) with ``num_iterations`` (unless None)
  and ``fields`` replaced: how routing functions read their keyword
  arguments."""
  if num_iterations is not None:
    fields['num_iterations'] = num_iterations
  options = PAPER_EM if options is None else options
  return dataclasses.replace(options, **fields) if fields else options


def em_routing(
    votes: ArrayLike,
    activations: ArrayLike,
    beta_u: ArrayLike,
    beta_a: ArrayLike,
    num_iterations: int | None = None,
    *,
    em_routing: EMRouting | None = None,
    assignment_normalizer: Normalizer | None = None,
    remat_iterations: bool = False,
    **fields,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """EM routing between capsule layers (Hinton et al. 2018, Procedure 1).

      R = 1/O
      for t in 0..T-1:
        M-step with lambda_t: mu, sigma^2, a_j from R * a_i
        E-step (all but the last t): R_ij = softmax_j(log a_j + log p_ij)

  M-step: mu_j = sum_i R_ij a_i V_ij / sum_i R_ij a_i, sigma_j^2 the weighted
  variance + ``variance_epsilon``, cost_h = (beta_u + log sigma_h) sum_i R_ij
  a_i, a_j = sigmoid(lambda_t (beta_a - sum_h cost_h)). E-step with the full
  diagonal-Gaussian log-density, in log space.

  Args:
    votes: [..., I, O, D] votes V_ij (D = 16 for 4x4 poses; any D works).
    activations: [..., I] input activations a_i in [0, 1].
    beta_u, beta_a: learned biases, broadcastable to [O] (one per output
      capsule type).
    num_iterations: T, overriding ``em_routing.num_iterations`` (None keeps
      it).
    em_routing: the routing (``EMRouting``; None: ``PAPER_EM``, the paper's
      text; the same keyword as the conv capsule layers' and the window
      kernels'); ``fields``, any ``EMRouting`` field by name, override it.
    assignment_normalizer: maps the E-step's log-numerators [..., I, O] to
      log R. Default: log-softmax over O. Convolutional capsule layers pass
      one that normalises each child over every parent that receives its
      votes across positions (the released code).
    remat_iterations: ``jax.checkpoint`` each iteration: the backward pass
      keeps only the [..., I, O] assignments between iterations and
      recomputes each iteration's [..., I, O, D] temporaries when it gets
      there, instead of storing every iteration's (same values and gradients;
      less memory, more compute).
  Returns:
    (poses, out_activations, assignments): poses [..., O, D] = mu of the final
    M-step (votes' dtype); out_activations [..., O] (float32);
    assignments [..., I, O] = the R used by the final M-step before it is
    multiplied by the input activations (float32; uniform 1/O when T = 1).
  """
  options = with_overrides(em_routing, num_iterations, **fields)
  num_iterations = options.num_iterations
  votes = floating_array(votes, 'votes')
  activations = jnp.asarray(activations)
  if votes.ndim < 3:
    raise ValueError(
        f'votes must be [..., in_caps, out_caps, pose_dim], got shape '
        f'{votes.shape}.')
  if activations.shape != votes.shape[:-2]:
    raise ValueError(
        f'activations must be [..., in_caps] = {votes.shape[:-2]} to match '
        f'votes {votes.shape}, got {activations.shape}.')
  out_dtype = votes.dtype
  votes32 = as_float32(votes)
  # Everything in the votes' compute dtype, so the loop carry keeps one dtype.
  activations32 = activations.astype(votes32.dtype)
  beta_u32 = jnp.asarray(beta_u, votes32.dtype)
  beta_a32 = jnp.asarray(beta_a, votes32.dtype)
  lambdas = inverse_temperatures(options.inverse_temperature, num_iterations,
                                  votes32.dtype)
  votes32 = jnp.swapaxes(votes32, -3, -2)  # parent-major: [..., O, I, D]
  padded = None
  if options.released:
    padded = (RELEASED_CLASS_MASS_EPSILON if options.mass_epsilon is None
              else float(options.mass_epsilon))
  m_step = lambda log_r, lam, prev: em_m_step(  # noqa: E731
      votes32, activations32, log_r, beta_u32, beta_a32, lam, prev,
      variance_epsilon=options.variance_epsilon,
      normalize_cost=options.normalize_cost,
      center_momentum=options.center_momentum,
      activation_form=options.activation_form, padded_mass_epsilon=padded)

  def iteration(t, state: EMRoutingState) -> EMRoutingState:
    poses, log_variances, activation_logits = m_step(
        state.log_assignments, lambdas[t], state.poses)
    log_assignments = em_e_step(votes32, poses, log_variances,
                                activation_logits, assignment_normalizer)
    return EMRoutingState(log_assignments, poses, log_variances,
                          activation_logits)

  batch_shape, (num_in, num_out, dim) = votes.shape[:-3], votes.shape[-3:]
  # The loop carry has the compute dtype (float64 under jax_enable_x64).
  dtype = votes32.dtype
  init = EMRoutingState(
      log_assignments=jnp.full(batch_shape + (num_out, num_in),
                               -math.log(num_out), dtype),
      poses=jnp.zeros(batch_shape + (num_out, dim), dtype),
      log_variances=jnp.zeros(batch_shape + (num_out, dim), dtype),
      activation_logits=jnp.zeros(batch_shape + (num_out,), dtype))
  if remat_iterations:
    iteration = jax.checkpoint(iteration)
  state = jax.lax.fori_loop(0, num_iterations - 1, iteration, init,
                            unroll=UNROLL_ITERATIONS)
  poses, _, activation_logits = m_step(
      state.log_assignments, lambdas[num_iterations - 1], state.poses)
  # Activations stay float32 like the assignments: rounded to bfloat16,
  # class activations near 1 would tie and the argmax pick the lowest class.
  return (poses.astype(out_dtype), jax.nn.sigmoid(activation_logits),
          jnp.swapaxes(jnp.exp(state.log_assignments), -1, -2))
