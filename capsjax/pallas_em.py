"""EM routing of convolutional capsule windows as a Pallas GPU kernel.

The GPU twin of ``em_kernel.route_windows`` (the fused CPU kernel): it
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
under which windows route on their own, as the CPU kernel's). The number
of parent types O is padded to a power of two (the padded parents are
masked out of the E-step softmax and the cost normalisation), the
children to a multiple of the chunk (with zero activations, which add
nothing to any sum).

Backward pass: not a hand-written kernel. A ``jax.custom_vjp`` recomputes
the routing through XLA (``jax.vjp`` of ``routing.em_routing`` on
``votes.matrix_votes``) chunk by chunk of windows (``lax.scan``), so it
holds about ``BACKWARD_CHUNK_BYTES`` of votes at a time, not the layer's.

Lowering: Triton (``num_warps=4``), which runs on pre-Hopper GPUs too.
``interpret=None`` runs the kernel in Pallas' interpret mode on a CPU (how
the tests check it) and compiles it on a GPU. It has been checked in
interpret mode and for lowering to CUDA through Triton; its speed on a GPU
has not been measured, so nothing routes with it unless asked
(``conv_capsule_routing(impl='pallas')``).
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
from capsjax import votes as votes_lib

POSE_SIDE = 4
_DIM = POSE_SIDE * POSE_SIDE
# Children per chunk inside a program: one chunk's votes, [CHILD_CHUNK, O,
# 16], are the largest value a program holds, in registers. At the paper's
# conv capsule layers (288 children, O = 32, float32) Triton 3.8's build for
# sm_80 takes 142 registers a thread and spills none with 8 (ptxas -v; 16:
# 255 registers and spills). Compile statistics only: not timed on a GPU.
CHILD_CHUNK = 8
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
  sq_dist = jnp.sum(jnp.square(votes - means[None]) *
                    jnp.exp(-log_variances)[None], axis=-1)
  log_norm = jnp.sum(log_variances + _LOG_2PI, axis=-1)
  # log sigmoid(x) = -softplus(-x) = min(x, 0) - log1p(exp(-|x|)).
  log_act = jnp.minimum(logits, 0.0) - jnp.log1p(jnp.exp(-jnp.abs(logits)))
  log_numerators = log_act[None, :] - 0.5 * (sq_dist + log_norm[None, :])
  log_numerators = jnp.where(valid[None, :], log_numerators, -jnp.inf)
  top = jnp.max(log_numerators, axis=-1, keepdims=True)
  shifted = log_numerators - top
  log_total = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
  return jnp.exp(shifted - log_total)


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


def _m_step(refs, params, previous_means, lam, valid, *, num_chunks: int,
            chunk: int, num_out: int, options: routing.EMRouting,
            write_assignments: bool):
  """One M-step over the window's children, chunk by chunk: (means, log
  variances, activation logits) from the assignments of ``params``."""
  poses_ref, acts_ref, weights_ref, bu_ref, ba_ref, assign_ref = refs
  dtype = poses_ref.dtype
  num_out_pad = weights_ref.shape[2]

  def weighted(k, write: bool):
    """(chunk's votes, R_io a_i [C, O_pad]) of chunk k; ``write`` stores its
    R as the routing's assignments."""
    start = pl.multiple_of(k * chunk, chunk)
    votes = _chunk_votes(poses_ref, weights_ref, start, chunk)
    assignments = _chunk_assignments(votes, params, valid, num_out)
    if write:
      assign_ref[pl.ds(start, chunk), :] = assignments
    return votes, assignments * acts_ref[pl.ds(start, chunk)][:, None]

  def first_pass(k, carry):
    votes, weights = weighted(k, write_assignments)
    return (carry[0] + jnp.sum(weights, axis=0),
            carry[1] + jnp.sum(weights[:, :, None] * votes, axis=0))

  zeros = jnp.zeros((num_out_pad, _DIM), dtype)
  mass, sums = jax.lax.fori_loop(
      0, num_chunks, first_pass, (jnp.zeros((num_out_pad,), dtype), zeros))
  divisor = (mass + routing.MASS_EPSILON)[:, None]
  means = sums / divisor
  if options.center_momentum:
    means = ((1.0 - options.center_momentum) * means
             + options.center_momentum * previous_means)

  def second_pass(k, carry):
    votes, weights = weighted(k, False)  # the first pass wrote R
    return carry + jnp.sum(weights[:, :, None]
                           * jnp.square(votes - means[None]), axis=0)

  variances = jax.lax.fori_loop(0, num_chunks, second_pass, zeros) / divisor
  log_variances = jnp.log(variances + options.variance_epsilon)
  logits = _activation_logits(log_variances, mass, bu_ref[...], ba_ref[...],
                              lam, valid, num_out, options)
  return means, log_variances, logits


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
    params = step(params, means, lam_ref[t], write_assignments=t == last)
    means = params[0]
  out_poses_ref[...] = means
  out_acts_ref[...] = jax.nn.sigmoid(params[2])


def _route_pallas(poses, activations, weights, beta_u, beta_a, lambdas,
                  static: _Static):
  """The forward kernel over N windows: inputs as ``_route``'s."""
  num, num_in = activations.shape
  num_out = weights.shape[1]
  chunk = min(static.child_chunk, pl.next_power_of_2(num_in))
  num_in_pad = -(-num_in // chunk) * chunk
  num_out_pad = pl.next_power_of_2(num_out)
  num_lambdas = pl.next_power_of_2(lambdas.shape[0])
  dtype = poses.dtype
  pad = lambda x, size: jnp.pad(x, (0, size - x.shape[0]))  # noqa: E731
  whole = lambda *shape: pl.BlockSpec(shape, lambda n: (0,) * len(shape))  # noqa: E731
  per_window = lambda *shape: pl.BlockSpec(  # noqa: E731
      (None,) + shape, lambda n: (n,) + (0,) * len(shape))
  kernel = functools.partial(_kernel, num_out=num_out, chunk=chunk,
                             options=static.em_routing)
  out_poses, out_acts, assignments = pl.pallas_call(
      kernel, grid=(num,),
      in_specs=[per_window(num_in_pad, POSE_SIDE, _DIM),
                per_window(num_in_pad),
                whole(num_in_pad, POSE_SIDE, num_out_pad, _DIM),
                whole(num_out_pad), whole(num_out_pad), whole(num_lambdas)],
      out_specs=[per_window(num_out_pad, _DIM), per_window(num_out_pad),
                 per_window(num_in_pad, num_out_pad)],
      out_shape=[jax.ShapeDtypeStruct((num, num_out_pad, _DIM), dtype),
                 jax.ShapeDtypeStruct((num, num_out_pad), dtype),
                 jax.ShapeDtypeStruct((num, num_in_pad, num_out_pad), dtype)],
      interpret=static.interpret, name='em_conv_windows',
      compiler_params=plt.CompilerParams(num_warps=NUM_WARPS))(
          _expand_poses(poses, num_in_pad),
          jnp.pad(activations, ((0, 0), (0, num_in_pad - num_in))),
          _expand_weights(weights, num_in_pad, num_out_pad),
          pad(beta_u, num_out_pad), pad(beta_a, num_out_pad),
          pad(lambdas, num_lambdas))
  return (out_poses[:, :num_out], out_acts[:, :num_out],
          assignments[:, :num_in, :num_out])


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
        beta_a, options=dataclasses.replace(static.em_routing,
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
                  backward_chunk: int | None = None, **fields
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """EM routing of N independent windows, their votes V_io = M_i W_io.

  Computes ``routing.em_routing(votes.matrix_votes(poses, weights),
  activations, beta_u, beta_a, options=em_routing)`` with a Pallas kernel
  (``em_kernel.route_windows``'s contract).

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
  poses, activations = jnp.asarray(poses), jnp.asarray(activations)
  weights = jnp.asarray(weights)
  _check_shapes(poses, activations, weights)
  dtype = jnp.promote_types(poses.dtype, jnp.float32)
  num_out = weights.shape[1]
  cast = lambda x: jnp.broadcast_to(jnp.asarray(x, dtype), (num_out,))  # noqa: E731
  lambdas = routing._inverse_temperatures(em_routing.inverse_temperature,
                                          em_routing.num_iterations, dtype)
  if interpret is None:
    interpret = jax.default_backend() != 'gpu'
  static = _Static(dataclasses.replace(em_routing, inverse_temperature=None),
                   bool(interpret), child_chunk, backward_chunk)
  return _route(poses.astype(dtype), activations.astype(dtype),
                weights.astype(dtype), cast(beta_u), cast(beta_a), lambdas,
                static)


def _check_shapes(poses: jax.Array, activations: jax.Array,
                  weights: jax.Array) -> None:
  """ValueError unless poses are [N, I, 4, 4], activations [N, I] and
  weights [I, O, 4, 4]."""
  if (poses.ndim != 4 or poses.shape[2:] != (POSE_SIDE, POSE_SIDE)
      or activations.shape != poses.shape[:2] or weights.ndim != 4
      or weights.shape[0] != poses.shape[1]
      or weights.shape[2:] != (POSE_SIDE, POSE_SIDE)):
    raise ValueError(
        f'Pallas EM kernel: poses [N, I, 4, 4] = {poses.shape}, activations '
        f'[N, I] = {activations.shape} and weights [I, O, 4, 4] = '
        f'{weights.shape} do not match.')
