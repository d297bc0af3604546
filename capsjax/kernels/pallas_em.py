"""EM routing of convolutional capsule windows as a Pallas GPU kernel.

The GPU twin of ``em_cpu.route_windows`` (the fused CPU kernel): it
computes what ``routing.em_routing(votes.matrix_votes(poses, w), ...)``
computes for each window, without writing the votes to memory. Each Pallas
program routes one window: it walks the window's children in chunks of
``CHILD_CHUNK`` (a power of two, as Triton's blocks must be), makes the
chunk's votes V_io = M_i W_io from its poses and the shared transforms,
and keeps only the parents' statistics (means, log variances, activation
logits: [O, 16] and [O]) between chunks. A child's assignments R_i depend
on its own votes and those statistics only, so every pass recomputes them
from the previous iteration's statistics instead of storing them: per
iteration one pass sums the mass and the mean, a second the variance
around that mean (two passes, as ``routing.em_m_step``). The final M-step's
assignments are written out as it goes.

Options: both activation forms, ``normalize_cost``, ``center_momentum``,
any ``variance_epsilon`` and inverse-temperature schedule (the options
under which windows route on their own, as the CPU kernel's), first-order
differentiable (no Hessians: route with ``implementation='xla'`` for those). The number
of parent types O is padded to a power of two (the padded parents are
masked out of the E-step softmax and the cost normalisation), the
children to a multiple of the chunk (with zero activations, which add
nothing to any sum).

Backward pass (``jax.custom_vjp``): a second kernel, one program per
window, that stores no votes either. It replays the window's forward pass
keeping each iteration's statistics ([O, 16] and [O]: the children's mass,
sums and squared deviations, and the means, log variances and logits),
then pulls the output cotangents back through the iterations: through each
M-step's arithmetic on those statistics by ``jax.vjp`` traced into the
kernel, and through each E-step by one pass over the children, each
chunk's share again by ``jax.vjp`` of its terms (so the derivatives are
JAX's, traced once per kernel, and only the order of the passes is written
here). A last pass sums each child's vote cotangents
over the iterations and turns them into its pose's gradient and its share
of the shared transforms' gradient, which every window's program adds
atomically to one [I, 4, O, 4] buffer (on a GPU the order of those
float additions, and so their rounding, varies from run to run).
``backward='xla'`` instead recomputes the routing through XLA (``jax.vjp``
of ``routing.em_routing`` on ``votes.matrix_votes``) chunk by chunk of
windows, about ``BACKWARD_CHUNK_BYTES`` of votes at a time.

Lowering: Triton (``num_warps=4``), which runs on pre-Hopper GPUs too.
``interpret=None`` runs the kernels in Pallas' interpret mode on a CPU (how
the tests check them) and compiles them on a GPU. They have been checked in
interpret mode, for lowering to CUDA through Triton and, with the Triton
compiler, for building for sm_80 (see ``CHILD_CHUNK``); their speed on a
GPU has not been measured, so nothing routes with them unless asked
(``kernels.conv_capsule_routing(implementation='pallas')``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from capsjax import routing
from capsjax.kernels import em_cpu
from capsjax.kernels import pallas_dynamic
from capsjax.routing import votes as votes_lib

POSE_SIDE = em_cpu.POSE_SIDE
_DIM = POSE_SIDE * POSE_SIDE
# Children per chunk inside a program: one chunk's votes, [CHILD_CHUNK, O,
# 16], are the largest value a program holds, in registers. At the paper's
# conv capsule layers (288 children, O = 32, float32) Triton 3.8's build for
# sm_80 takes 142 registers a thread and spills none with 8 (ptxas -v; 16:
# 255 registers and spills; sm_90a: 148; benchmarks/em_kernels.py --ptxas).
# Its speed on an H100: BENCHMARKS.md.
CHILD_CHUNK = 8
# The backward kernel holds more per chunk (the chunk's votes, their
# cotangents and the E-step's temporaries): with 4 children it takes 242
# registers there and spills none (sm_90a: 243).
BACKWARD_CHILD_CHUNK = 4
# Votes of the windows one backward chunk recomputes through XLA (its
# temporaries take a few times that).
BACKWARD_CHUNK_BYTES = 2**28
NUM_WARPS = 4
_LOG_2PI = math.log(2.0 * math.pi)


@dataclasses.dataclass(frozen=True)
class _Static:
  """What the kernel is compiled for (hashable: a custom_vjp static)."""
  em_routing: routing.EMRouting  # inverse_temperature: None (passed as data)
  interpret: bool
  child_chunk: int
  backward: str  # 'pallas' or 'xla'
  backward_chunk: int | None


def unsupported(pose_side: int, *, normalizer: bool, released: bool,
                remat_iterations: bool = False) -> str:
  """Why the Pallas kernel cannot route these windows ('' when it can)."""
  if pose_side != POSE_SIDE:
    return f'it takes 4 x 4 poses, not {pose_side} x {pose_side}'
  if normalizer or released:
    return ('an E-step normaliser across windows (released or '
            'normalize_across_positions) couples the windows')
  if remat_iterations:
    return 'remat_iterations applies to the XLA routing only'
  return ''


def _expand_poses(poses: jax.Array, num_in_pad: int) -> jax.Array:
  """[N, I, 4, 4] M -> [N, I_pad, 4, 16] E with E[n, i, q, 4p + r] =
  M[n, i, p, q]: vote entry (p, r) is sum_q E[., q, 4p + r] W[., q, r], so
  a program makes a chunk's votes from whole rows (Triton cannot slice
  values)."""
  num, num_in = poses.shape[:2]
  cols = jnp.swapaxes(poses, -1, -2)  # [N, I, q, p]
  expanded = jnp.broadcast_to(cols[..., None], cols.shape + (POSE_SIDE,))
  expanded = expanded.reshape(num, num_in, POSE_SIDE, _DIM)
  return jnp.pad(expanded, ((0, 0), (0, num_in_pad - num_in), (0, 0), (0, 0)))


def _expand_weights(weights: jax.Array, num_in_pad: int,
                    num_out_pad: int) -> jax.Array:
  """[I, O, 4, 4] W -> [I_pad, 4, O_pad, 16] F with F[i, q, o, 4p + r] =
  W[i, o, q, r] (zero for padded children and parents)."""
  num_in, num_out = weights.shape[:2]
  rows = jnp.swapaxes(weights, 1, 2)  # [I, q, O, r]
  expanded = jnp.broadcast_to(rows[:, :, :, None, :], rows.shape[:3]
                              + (POSE_SIDE, POSE_SIDE))
  expanded = expanded.reshape(num_in, POSE_SIDE, num_out, _DIM)
  return jnp.pad(expanded, ((0, num_in_pad - num_in), (0, 0),
                            (0, num_out_pad - num_out), (0, 0)))


def _chunk_votes(poses_ref, weights_ref, start, chunk: int) -> jax.Array:
  """One chunk's votes [C, O_pad, 16] from the expanded poses and
  transforms (4 broadcast multiply-adds: no matmul unit, exact float32)."""
  rows = pl.ds(start, chunk)
  votes = None
  for q in range(POSE_SIDE):
    term = poses_ref[rows, q, :][:, None, :] * weights_ref[rows, q, :, :]
    votes = term if votes is None else votes + term
  return votes


def _chunk_assignments(votes: jax.Array, params, valid: jax.Array,
                       num_out: int) -> jax.Array:
  """R [C, O_pad] of a chunk's children: the E-step of ``params`` (means
  [O_pad, 16], log variances [O_pad, 16], activation logits [O_pad]), or
  uniform 1/O before the first M-step; 0 for the padded parents."""
  if params is None:
    uniform = jnp.where(valid, 1.0 / num_out, 0.0).astype(votes.dtype)
    return jnp.broadcast_to(uniform[None, :], votes.shape[:2])
  means, log_variances, logits = params
  # The padded parents' statistics are replaced, not just masked below: a
  # zero variance floor would give them log variances of -inf, and their
  # infinities would reach the gradients through the mask.
  log_variances = jnp.where(valid[:, None], log_variances, 0.0)
  sq_dist = jnp.sum(jnp.square(votes - means[None]) *
                    jnp.exp(-log_variances)[None], axis=-1)
  log_norm = jnp.sum(log_variances + _LOG_2PI, axis=-1)
  # log sigmoid(x) = -softplus(-x) = min(x, 0) - log1p(exp(-|x|)).
  log_act = jnp.minimum(logits, 0.0) - jnp.log1p(jnp.exp(-jnp.abs(logits)))
  log_numerators = log_act[None, :] - 0.5 * (sq_dist + log_norm[None, :])
  log_numerators = jnp.where(valid[None, :], log_numerators, -jnp.inf)
  top = jax.lax.stop_gradient(jnp.max(log_numerators, axis=-1,
                                      keepdims=True))
  shifted = log_numerators - top
  log_total = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
  return jnp.exp(shifted - log_total)


def _chunk_terms(votes, acts, params, means, valid, num_out: int):
  """A chunk's share of an M-step: (mass sum_i R_io a_i [O_pad], sums
  sum_i R_io a_i V_io [O_pad, 16], squared deviations sum_i R_io a_i (V_io -
  means)^2 [O_pad, 16] (None without ``means``), R [C, O_pad]), R the
  E-step of ``params``."""
  assignments = _chunk_assignments(votes, params, valid, num_out)
  weights = assignments * acts[:, None]
  squares = None if means is None else jnp.sum(
      weights[:, :, None] * jnp.square(votes - means[None]), axis=0)
  return (jnp.sum(weights, axis=0),
          jnp.sum(weights[:, :, None] * votes, axis=0), squares, assignments)


def _activation_logits(log_variances, mass, beta_u, beta_a, lam, valid,
                       num_out: int, options: routing.EMRouting):
  """The M-step's activation logits [O_pad] (``routing.em_m_step``)."""
  dim_sum = jnp.sum(log_variances, axis=-1)
  if options.activation_form == 'paper':
    cost = (_DIM * beta_u + 0.5 * dim_sum) * mass
  else:
    cost = mass * (dim_sum + beta_u * _DIM * (_LOG_2PI + 1.0))
  if options.normalize_cost:
    cost = jnp.where(valid, cost, 0.0)
    mean = jnp.sum(cost) / num_out
    centred = jnp.where(valid, cost - mean, 0.0)
    std = jnp.sqrt(jnp.sum(jnp.square(centred)) / num_out
                   + routing.COST_STD_EPSILON**2)
    cost = centred / std
  if options.activation_form == 'paper':
    return lam * (beta_a - cost)
  return lam * (-cost - 5000.0 * beta_a)


def _means(mass, sums, previous_means, options: routing.EMRouting):
  """The M-step's means [O_pad, 16] (with the centre momentum)."""
  means = sums / (mass + routing.MASS_EPSILON)[:, None]
  if options.center_momentum:
    means = ((1.0 - options.center_momentum) * means
             + options.center_momentum * previous_means)
  return means


def _finish(mass, sums, squares, previous_means, beta_u, beta_a, lam, *,
            valid, num_out: int, options: routing.EMRouting,
            frozen_means=None):
  """The M-step's (means, log variances, activation logits) from the
  children's sums (``_chunk_terms``).

  ``frozen_means``: the means ``squares`` were taken around, for the
  backward pass: the squares then enter as sum_i w_i (V_i - mu)^2 = squares
  - 2 (sums - mass mu0) (mu - mu0) + mass (mu - mu0)^2 at mu0 =
  ``frozen_means``, the same value with the squares' derivative through the
  means, so the children's sums can treat the means as constants.
  """
  means = _means(mass, sums, previous_means, options)
  if frozen_means is not None:
    shift = means - frozen_means
    squares = (squares - 2.0 * (sums - mass[:, None] * frozen_means) * shift
               + mass[:, None] * jnp.square(shift))
  variances = squares / (mass + routing.MASS_EPSILON)[:, None]
  log_variances = jnp.log(variances + options.variance_epsilon)
  logits = _activation_logits(log_variances, mass, beta_u, beta_a, lam, valid,
                              num_out, options)
  return means, log_variances, logits


def _m_step(refs, params, previous_means, lam, valid, *, num_chunks: int,
            chunk: int, num_out: int, options: routing.EMRouting,
            write_assignments: bool):
  """One M-step over the window's children, chunk by chunk, from the
  assignments of ``params``: ((means, log variances, activation logits),
  the children's sums (mass, sums, squares))."""
  poses_ref, acts_ref, weights_ref, bu_ref, ba_ref, assign_ref = refs
  dtype = poses_ref.dtype
  num_out_pad = weights_ref.shape[2]

  def terms(k, means):
    start = pl.multiple_of(k * chunk, chunk)
    votes = _chunk_votes(poses_ref, weights_ref, start, chunk)
    return _chunk_terms(votes, acts_ref[pl.ds(start, chunk)], params, means,
                        valid, num_out)

  def first_pass(k, carry):
    mass, sums, _, assignments = terms(k, None)
    if write_assignments:
      assign_ref[pl.ds(pl.multiple_of(k * chunk, chunk), chunk), :] = (
          assignments)
    return carry[0] + mass, carry[1] + sums

  zeros = jnp.zeros((num_out_pad, _DIM), dtype)
  mass, sums = jax.lax.fori_loop(
      0, num_chunks, first_pass, (jnp.zeros((num_out_pad,), dtype), zeros))
  means = _means(mass, sums, previous_means, options)
  squares = jax.lax.fori_loop(
      0, num_chunks, lambda k, carry: carry + terms(k, means)[2], zeros)
  return _finish(mass, sums, squares, previous_means, bu_ref[...],
                 ba_ref[...], lam, valid=valid, num_out=num_out,
                 options=options), (mass, sums, squares)


def _kernel(poses_ref, acts_ref, weights_ref, bu_ref, ba_ref, lam_ref,
            out_poses_ref, out_acts_ref, assign_ref, *, num_out: int,
            chunk: int, options: routing.EMRouting):
  """Routes one window: refs as ``_route_pallas`` blocks them."""
  num_out_pad = weights_ref.shape[2]
  valid = jnp.arange(num_out_pad) < num_out
  refs = (poses_ref, acts_ref, weights_ref, bu_ref, ba_ref, assign_ref)
  step = functools.partial(_m_step, refs, valid=valid,
                           num_chunks=acts_ref.shape[0] // chunk, chunk=chunk,
                           num_out=num_out, options=options)
  params = None
  means = jnp.zeros((num_out_pad, _DIM), poses_ref.dtype)
  last = options.num_iterations - 1
  for t in range(options.num_iterations):
    params, _ = step(params, means, lam_ref[t], write_assignments=t == last)
    means = params[0]
  out_poses_ref[...] = means
  out_acts_ref[...] = jax.nn.sigmoid(params[2])


# ----------------------------------------------------------------------------
# The backward kernel: each program replays its window's forward pass
# (keeping each iteration's [O, 16] statistics), pulls the cotangents back
# through the iterations' small M-step arithmetic (``jax.vjp`` of
# ``_finish``, traced into the kernel) with one pass over the children per
# E-step to reach the previous iteration's statistics, then makes one last
# pass that sums each child's vote cotangents over the iterations and turns
# them into the gradients of its pose and of the shared transforms (added
# atomically: every window's program adds to the same [I, 4, O, 4]).


def _replay(refs, lam_ref, valid, step_options: dict, num_iterations: int):
  """The forward pass again: per iteration (the statistics its E-step
  used, or None; the previous means; mass; sums; squares; its means), and
  the final statistics."""
  dtype, num_out_pad = refs[0].dtype, refs[2].shape[2]
  history, params = [], None
  means = jnp.zeros((num_out_pad, _DIM), dtype)
  for t in range(num_iterations):
    new_params, sums = _m_step(refs, params, means, lam_ref[t], valid,
                               write_assignments=False, **step_options)
    history.append((params, means) + sums + (new_params[0],))
    params, means = new_params, new_params[0]
  return history, params


def _statistics_cotangent(refs, gassign_ref, history_t, cotangents_t, final,
                          valid, *, num_chunks: int, chunk: int,
                          num_out: int):
  """Cotangents of the statistics an iteration's E-step used: one pass
  over the children, each chunk's share by ``jax.vjp`` of its terms."""
  poses_ref, acts_ref, weights_ref = refs[:3]
  params, _, _, _, _, frozen_means = history_t

  def body(k, carry):
    start = pl.multiple_of(k * chunk, chunk)
    rows = pl.ds(start, chunk)
    votes = _chunk_votes(poses_ref, weights_ref, start, chunk)
    acts = acts_ref[rows]
    _, pull_back = jax.vjp(lambda p: _chunk_terms(
        votes, acts, p, frozen_means, valid, num_out), params)
    g_assign = (gassign_ref[rows, :] if final
                else jnp.zeros(votes.shape[:2], votes.dtype))
    (grads,) = pull_back(tuple(cotangents_t) + (g_assign,))
    return jax.tree.map(jnp.add, carry, grads)

  return jax.lax.fori_loop(0, num_chunks, body,
                           jax.tree.map(jnp.zeros_like, params))


def _child_gradients(refs, gassign_ref, out_refs, history, cotangents, valid,
                     *, num_chunks: int, chunk: int, num_out: int):
  """Each child's pose and activation gradients, and its share of the
  transforms' gradient (added atomically), in one pass over the children."""
  poses_ref, acts_ref, weights_ref = refs[:3]
  gposes_ref, gacts_ref, gweights_ref = out_refs
  last = len(history) - 1

  def body(k, carry):
    start = pl.multiple_of(k * chunk, chunk)
    rows = pl.ds(start, chunk)
    votes = _chunk_votes(poses_ref, weights_ref, start, chunk)
    acts = acts_ref[rows]
    g_votes, g_acts = jnp.zeros_like(votes), jnp.zeros_like(acts)
    for t, (params, _, _, _, _, frozen_means) in enumerate(history):
      _, pull_back = jax.vjp(lambda v, a, p=params, m=frozen_means:
                             _chunk_terms(v, a, p, m, valid, num_out),
                             votes, acts)
      g_assign = (gassign_ref[rows, :] if t == last
                  else jnp.zeros(votes.shape[:2], votes.dtype))
      g_v, g_a = pull_back(tuple(cotangents[t]) + (g_assign,))
      g_votes, g_acts = g_votes + g_v, g_acts + g_a
    gacts_ref[rows] = g_acts
    square = (chunk, POSE_SIDE, POSE_SIDE)
    for q in range(POSE_SIDE):
      # dM[i, p, q] = sum_(o, r) dV[i, o, 4p + r] W[i, o, q, r].
      g_rows = jnp.sum(g_votes * weights_ref[rows, q, :, :], axis=1)
      gposes_ref[rows, q, :] = jnp.sum(g_rows.reshape(square), axis=2)
      # dW[i, o, q, r] = sum_p M[i, p, q] dV[i, o, 4p + r], summed over the
      # windows by atomic adds (a slice of one, not the index q: interpret
      # mode needs slices).
      g_weights = (poses_ref[rows, q, :][:, None, :] * g_votes).reshape(
          (chunk, g_votes.shape[1], POSE_SIDE, POSE_SIDE)).sum(axis=2)
      plt.atomic_add(gweights_ref, (rows, pl.ds(q, 1), slice(None),
                                    slice(None)), g_weights[:, None])
    return carry

  jax.lax.fori_loop(0, num_chunks, body, 0)


def _backward_kernel(poses_ref, acts_ref, weights_ref, bu_ref, ba_ref,
                     lam_ref, gmeans_ref, gout_acts_ref, gassign_ref, _,
                     gposes_ref, gacts_ref, gweights_ref, gbu_ref, gba_ref,
                     glam_ref, *, num_out: int, chunk: int,
                     options: routing.EMRouting):
  """The gradients of one window: refs as ``_backward_pallas`` blocks them
  (the unnamed one is the zeros ``gweights_ref`` aliases)."""
  num_out_pad = weights_ref.shape[2]
  valid = jnp.arange(num_out_pad) < num_out
  refs = (poses_ref, acts_ref, weights_ref, bu_ref, ba_ref, None)
  sizes = dict(num_chunks=acts_ref.shape[0] // chunk, chunk=chunk,
               num_out=num_out)
  history, params = _replay(refs, lam_ref, valid, dict(sizes, options=options),
                            options.num_iterations)
  activations = jax.nn.sigmoid(params[2])
  g_params = (gmeans_ref[...], jnp.zeros_like(params[1]),
              gout_acts_ref[...] * activations * (1.0 - activations))
  g_betas = (jnp.zeros_like(params[2]), jnp.zeros_like(params[2]))
  g_lam = jnp.zeros(glam_ref.shape, params[2].dtype)
  cotangents = [None] * options.num_iterations
  for t in reversed(range(options.num_iterations)):
    _, previous_means, mass, sums, squares, frozen_means = history[t]
    _, pull_back = jax.vjp(functools.partial(
        _finish, valid=valid, num_out=num_out, options=options,
        frozen_means=frozen_means), mass, sums, squares, previous_means,
                           bu_ref[...], ba_ref[...], lam_ref[t])
    grads = pull_back(g_params)
    cotangents[t] = grads[:3]
    g_betas = (g_betas[0] + grads[4], g_betas[1] + grads[5])
    g_lam = jnp.where(jnp.arange(g_lam.shape[0]) == t, grads[6], g_lam)
    if t > 0:
      g_prev = _statistics_cotangent(
          refs, gassign_ref, history[t], cotangents[t],
          t == options.num_iterations - 1, valid, **sizes)
      g_params = (g_prev[0] + grads[3], g_prev[1], g_prev[2])
  _child_gradients(refs, gassign_ref, (gposes_ref, gacts_ref, gweights_ref),
                   history, cotangents, valid, **sizes)
  gbu_ref[...], gba_ref[...] = g_betas
  glam_ref[...] = g_lam


def _whole(*shape) -> pl.BlockSpec:
  """The whole array, the same block for every window."""
  return pl.BlockSpec(shape, lambda n: (0,) * len(shape))


def _per_window(*shape) -> pl.BlockSpec:
  """Window n's [shape] slice of an [N, shape] array."""
  return pl.BlockSpec((None,) + shape, lambda n: (n,) + (0,) * len(shape))


def _pad_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """``x`` padded with zeros at the end of each dim up to ``shape``."""
  return jnp.pad(x, [(0, size - dim) for dim, size in zip(x.shape, shape,
                                                          strict=True)])


def _kernel_inputs(poses, activations, weights, beta_u, beta_a, lambdas,
                   child_chunk: int):
  """(sizes: (N, I, O, C, I_pad, O_pad, T_pad), the kernels' padded,
  expanded inputs and their block specs) for chunks of ``child_chunk``
  children."""
  num, num_in = activations.shape
  num_out = weights.shape[1]
  chunk = min(child_chunk, pl.next_power_of_2(num_in))
  num_in_pad = -(-num_in // chunk) * chunk
  num_out_pad = pl.next_power_of_2(num_out)
  num_lambdas = pl.next_power_of_2(lambdas.shape[0])
  inputs = (_expand_poses(poses, num_in_pad),
            _pad_to(activations, (num, num_in_pad)),
            _expand_weights(weights, num_in_pad, num_out_pad),
            _pad_to(beta_u, (num_out_pad,)), _pad_to(beta_a, (num_out_pad,)),
            _pad_to(lambdas, (num_lambdas,)))
  specs = [_per_window(num_in_pad, POSE_SIDE, _DIM), _per_window(num_in_pad),
           _whole(num_in_pad, POSE_SIDE, num_out_pad, _DIM),
           _whole(num_out_pad), _whole(num_out_pad), _whole(num_lambdas)]
  sizes = (num, num_in, num_out, chunk, num_in_pad, num_out_pad, num_lambdas)
  return sizes, inputs, specs


def _route_pallas(poses, activations, weights, beta_u, beta_a, lambdas,
                  static: _Static):
  """The forward kernel over N windows: inputs as ``_route``'s."""
  sizes, inputs, in_specs = _kernel_inputs(
      poses, activations, weights, beta_u, beta_a, lambdas,
      static.child_chunk)
  num, num_in, num_out, chunk, num_in_pad, num_out_pad, _ = sizes
  dtype = poses.dtype
  kernel = functools.partial(_kernel, num_out=num_out, chunk=chunk,
                             options=static.em_routing)
  out_poses, out_acts, assignments = pl.pallas_call(
      kernel, grid=(num,), in_specs=in_specs,
      out_specs=[_per_window(num_out_pad, _DIM), _per_window(num_out_pad),
                 _per_window(num_in_pad, num_out_pad)],
      out_shape=[jax.ShapeDtypeStruct((num, num_out_pad, _DIM), dtype),
                 jax.ShapeDtypeStruct((num, num_out_pad), dtype),
                 jax.ShapeDtypeStruct((num, num_in_pad, num_out_pad), dtype)],
      interpret=static.interpret, name='em_conv_windows',
      compiler_params=plt.CompilerParams(num_warps=NUM_WARPS))(*inputs)
  return (out_poses[:, :num_out], out_acts[:, :num_out],
          assignments[:, :num_in, :num_out])


def _backward_pallas(static: _Static, residuals, cotangents):
  """The backward kernel over N windows: ``_route``'s residuals (its
  inputs) and output cotangents -> its inputs' gradients."""
  sizes, inputs, in_specs = _kernel_inputs(
      *residuals, min(static.child_chunk, BACKWARD_CHILD_CHUNK))
  num, num_in, num_out, chunk, num_in_pad, num_out_pad, num_lambdas = sizes
  dtype = residuals[0].dtype
  g_means, g_acts, g_assign = (jnp.asarray(c, dtype) for c in cotangents)
  # dM as [N, I_pad, q, p], dW as [I_pad, q, O_pad, r].
  pose_shape = (num_in_pad, POSE_SIDE, POSE_SIDE)
  weight_shape = (num_in_pad, POSE_SIDE, num_out_pad, POSE_SIDE)
  kernel = functools.partial(_backward_kernel, num_out=num_out, chunk=chunk,
                             options=static.em_routing)
  out_shapes = [(num,) + pose_shape, (num, num_in_pad), weight_shape,
                (num, num_out_pad), (num, num_out_pad), (num, num_lambdas)]
  grads = pl.pallas_call(
      kernel, grid=(num,),
      in_specs=in_specs + [_per_window(num_out_pad, _DIM),
                           _per_window(num_out_pad),
                           _per_window(num_in_pad, num_out_pad),
                           _whole(*weight_shape)],
      out_specs=[_per_window(*pose_shape), in_specs[1], _whole(*weight_shape),
                 _per_window(num_out_pad), _per_window(num_out_pad),
                 _per_window(num_lambdas)],
      out_shape=[jax.ShapeDtypeStruct(s, dtype) for s in out_shapes],
      # The transforms' gradient starts as zeros that every window adds to.
      input_output_aliases={9: 2},
      interpret=static.interpret, name='em_conv_windows_backward',
      compiler_params=plt.CompilerParams(num_warps=NUM_WARPS))(
          *inputs, _pad_to(g_means, (num, num_out_pad, _DIM)),
          _pad_to(g_acts, (num, num_out_pad)),
          _pad_to(g_assign, (num, num_in_pad, num_out_pad)),
          jnp.zeros(weight_shape, dtype))
  return _unexpand_gradients(grads, residuals)


def _unexpand_gradients(grads, residuals):
  """The backward kernel's padded gradients (dM as [N, I_pad, q, p], dW as
  [I_pad, q, O_pad, r], the betas' and lambdas' per window) as gradients
  of ``_route``'s inputs."""
  poses, activations, weights, _, _, lambdas = residuals
  num, num_in = activations.shape
  num_out = weights.shape[1]
  g_poses, g_acts, g_weights, g_bu, g_ba, g_lam = grads
  return (jnp.swapaxes(g_poses[:, :num_in], -1, -2), g_acts[:, :num_in],
          jnp.swapaxes(g_weights[:num_in, :, :num_out], 1, 2),
          g_bu.sum(0)[:num_out], g_ba.sum(0)[:num_out],
          g_lam.sum(0)[:lambdas.shape[0]])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _route(poses, activations, weights, beta_u, beta_a, lambdas,
           static: _Static):
  """poses [N, I, 4, 4], activations [N, I], weights [I, O, 4, 4], beta_u
  and beta_a [O], lambdas [T], one float dtype -> (poses [N, O, 16],
  activations [N, O], assignments [N, I, O])."""
  return _route_pallas(poses, activations, weights, beta_u, beta_a, lambdas,
                       static)


def _route_forward(poses, activations, weights, beta_u, beta_a, lambdas,
                   static):
  return (_route_pallas(poses, activations, weights, beta_u, beta_a, lambdas,
                        static),
          (poses, activations, weights, beta_u, beta_a, lambdas))


def _backward_chunk(static: _Static, num: int, num_in: int, num_out: int,
                    itemsize: int) -> int:
  """Windows per backward chunk: ``static.backward_chunk`` or those whose
  votes take about ``BACKWARD_CHUNK_BYTES``; at most all of them."""
  per_chunk = static.backward_chunk or max(
      1, BACKWARD_CHUNK_BYTES // (num_in * num_out * _DIM * itemsize))
  return max(1, min(per_chunk, num))


def _route_backward(static: _Static, residuals, cotangents):
  if static.backward == 'pallas':
    return _backward_pallas(static, residuals, cotangents)
  return _backward_xla(static, residuals, cotangents)


def _backward_xla(static: _Static, residuals, cotangents):
  """Recomputes the windows' routing through XLA, chunk by chunk, and pulls
  the cotangents back through it (``jax.vjp``)."""
  poses, activations, weights, beta_u, beta_a, lambdas = residuals
  num, num_in = activations.shape
  num_out = weights.shape[1]
  cotangents = tuple(jnp.asarray(c, poses.dtype) for c in cotangents)
  per_chunk = _backward_chunk(static, num, num_in, num_out,
                              poses.dtype.itemsize)
  count = -(-num // per_chunk)

  def split(x, mode):
    """[N, ...] -> [count, per_chunk, ...]: the last chunk padded by copies
    of the last window (finite gradients; their cotangents are zeros)."""
    widths = ((0, count * per_chunk - num),) + ((0, 0),) * (x.ndim - 1)
    return jnp.pad(x, widths, mode=mode).reshape((count, per_chunk)
                                                 + x.shape[1:])

  def route(pose_chunk, act_chunk, weights, beta_u, beta_a, lambdas):
    return routing.em_routing(
        votes_lib.matrix_votes(pose_chunk, weights), act_chunk, beta_u,
        beta_a, em_routing=dataclasses.replace(static.em_routing,
                                               inverse_temperature=lambdas))

  def body(shared_grads, chunk):
    pose_chunk, act_chunk, chunk_cotangents = chunk
    _, pull_back = jax.vjp(route, pose_chunk, act_chunk, weights, beta_u,
                           beta_a, lambdas)
    grads = pull_back(chunk_cotangents)
    return (jax.tree.map(jnp.add, shared_grads, grads[2:]), grads[:2])

  shared = tuple(jnp.zeros_like(x) for x in (weights, beta_u, beta_a,
                                             lambdas))
  shared, (pose_grads, act_grads) = jax.lax.scan(
      body, shared, (split(poses, 'edge'), split(activations, 'edge'),
                     tuple(split(c, 'constant') for c in cotangents)))
  return ((pose_grads.reshape((-1,) + poses.shape[1:])[:num],
           act_grads.reshape(-1, num_in)[:num]) + shared)


_route.defvjp(_route_forward, _route_backward)


def route_windows(poses, activations, weights, beta_u, beta_a,
                  num_iterations: int | None = None, *,
                  em_routing: routing.EMRouting | None = None,
                  interpret: bool | None = None,
                  child_chunk: int = CHILD_CHUNK,
                  backward: str = 'pallas',
                  backward_chunk: int | None = None, **fields
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """EM routing of N independent windows, their votes V_io = M_i W_io.

  Computes ``routing.em_routing(votes.matrix_votes(poses, weights),
  activations, beta_u, beta_a, em_routing=em_routing)`` with a Pallas kernel
  (``em_cpu.route_windows``'s contract).

  Args:
    poses: [N, I, 4, 4] each window's child poses M_i.
    activations: [N, I] their activations.
    weights: [I, O, 4, 4] transforms W_io, shared by the windows.
    beta_u, beta_a: broadcastable to [O].
    num_iterations, em_routing, fields: the routing, as
      ``routing.em_routing``'s ``num_iterations``, ``options`` and
      ``fields`` (not ``released`` nor the conv-only fields).
    interpret: run the kernel in Pallas' interpret mode; None: compiled
      (Triton) on a GPU, interpreted on any other backend.
    child_chunk: children per chunk inside a program (a power of two).
    backward: 'pallas', the backward kernel, or 'xla', the routing
      recomputed through XLA in chunks of windows.
    backward_chunk: windows per chunk of the XLA backward pass; None: those
      whose votes take about ``BACKWARD_CHUNK_BYTES``.
  Returns:
    (poses [N, O, 16], activations [N, O], assignments [N, I, O]), float64
    for float64 inputs, else float32 (bfloat16 inputs are routed in
    float32).
  """
  em_routing = routing.with_overrides(em_routing, num_iterations, **fields)
  if em_routing.released or em_routing.normalize_across_positions:
    raise ValueError('Pallas EM kernel: it routes each window on its own, '
                     'without the released path or normalize_across_positions.')
  if child_chunk < 1 or child_chunk & (child_chunk - 1):
    raise ValueError(f'child_chunk must be a power of two, got {child_chunk}.')
  if backward not in ('pallas', 'xla'):
    raise ValueError(f"backward must be 'pallas' or 'xla', got {backward!r}.")
  poses, activations = jnp.asarray(poses), jnp.asarray(activations)
  weights = jnp.asarray(weights)
  em_cpu.check_window_shapes('Pallas EM kernel', poses, activations,
                                weights)
  dtype = jnp.promote_types(poses.dtype, jnp.float32)
  num_out = weights.shape[1]
  cast = lambda x: jnp.broadcast_to(jnp.asarray(x, dtype), (num_out,))  # noqa: E731
  lambdas = routing.inverse_temperatures(em_routing.inverse_temperature,
                                          em_routing.num_iterations, dtype)
  interpret = pallas_dynamic.interpret_mode(interpret)
  static = _Static(dataclasses.replace(em_routing, inverse_temperature=None),
                   interpret, child_chunk, backward, backward_chunk)
  return _route(poses.astype(dtype), activations.astype(dtype),
                weights.astype(dtype), cast(beta_u), cast(beta_a), lambdas,
                static)
