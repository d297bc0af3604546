"""Pure vote transforms, convolutional-capsule patches, coordinate addition.

Shape legend: ``...`` leading batch dims, I input capsules, O output
capsules, Din/Dout vector capsule dimensions, P the side of a pose matrix
(4 for 4x4 poses), H x W a capsule grid, C capsule types, K the kernel size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike


def vector_votes(inputs: ArrayLike, weights: ArrayLike) -> jax.Array:
  """u_hat_j|i = W_ij u_i, one matrix per (input, output) pair.

  Args:
    inputs: [..., I, Din] input capsules u_i.
    weights: [I, O, Din, Dout].
  Returns:
    [..., I, O, Dout] votes.
  """
  inputs, weights = jnp.asarray(inputs), jnp.asarray(weights)
  if weights.ndim != 4 or inputs.shape[-2:] != (weights.shape[0],
                                                weights.shape[2]):
    raise ValueError(
        f'vector_votes: inputs [..., I, Din] = {inputs.shape} do not match '
        f'weights [I, O, Din, Dout] = {weights.shape}.')
  return jnp.einsum('...id,iode->...ioe', inputs, weights)


def shared_vector_votes(inputs: ArrayLike, weights: ArrayLike,
                        dot_general=jax.lax.dot_general) -> jax.Array:
  """u_hat_j|i = W_j u_i with one W_j per output shared by every input.

  The parameter count does not depend on I, so a layer built on this accepts
  any number of input capsules (any image size; Su's shared-weight capsule layer).

  Args:
    inputs: [..., I, Din].
    weights: [O, Din, Dout].
    dot_general: computes the one product [..., I, Din] @ [Din, O * Dout]
      (``jax.lax.dot_general``'s signature), e.g. ``capsjax.kernels.conv.dot_general``,
      which hands a large bfloat16 product to oneDNN on the CPU.
  Returns:
    [..., I, O, Dout] in the promoted dtype of inputs and weights.
  """
  inputs, weights = jnp.asarray(inputs), jnp.asarray(weights)
  if weights.ndim != 3 or inputs.shape[-1] != weights.shape[1]:
    raise ValueError(
        f'shared_vector_votes: inputs [..., I, Din] = {inputs.shape} do not '
        f'match weights [O, Din, Dout] = {weights.shape}.')
  out_caps, in_dim, out_dim = weights.shape
  dtype = jnp.promote_types(inputs.dtype, weights.dtype)
  flat = jnp.moveaxis(weights, 0, 1).reshape(in_dim, out_caps * out_dim)
  votes = dot_general(inputs.astype(dtype), flat.astype(dtype),
                      (((inputs.ndim - 1,), (0,)), ((), ())))
  return votes.reshape(inputs.shape[:-1] + (out_caps, out_dim))


def matrix_votes(poses: ArrayLike, weights: ArrayLike) -> jax.Array:
  """V_ij = M_i W_ij, flattened to P*P numbers for routing.

  Leading dims of ``poses`` beyond I broadcast, so a transform shared over
  positions is ``poses [B, H*W, C, P, P]`` with ``weights [C, O, P, P]``.

  Args:
    poses: [..., I, P, P] pose matrices M_i.
    weights: [I, O, P, P] transforms W_ij.
  Returns:
    [..., I, O, P*P] votes in the promoted dtype of poses and weights (the
    product computed in float32 or wider on a CPU, in that dtype
    elsewhere).
  """
  poses, weights = jnp.asarray(poses), jnp.asarray(weights)
  if (weights.ndim != 4 or poses.ndim < 3 or poses.shape[-3] != weights.shape[0]
      or poses.shape[-1] != weights.shape[2]):
    raise ValueError(
        f'matrix_votes: poses [..., I, P, P] = {poses.shape} do not match '
        f'weights [I, O, P, P] = {weights.shape}.')
  dtype = jnp.promote_types(poses.dtype, weights.dtype)
  # On a CPU the product runs in float32 at least, the votes rounded to
  # ``dtype`` after: XLA:CPU's bfloat16 batched dot was no faster (up to
  # 1.14x slower in the paper EM model's bfloat16 train step). Elsewhere it
  # runs in ``dtype``: on a GPU the float32 product of bfloat16 poses wrote
  # float32 votes, the model's largest tensor, only to round them to
  # bfloat16 (benchmarks/bf16_audit.py).
  compute = (jnp.promote_types(dtype, jnp.float32)
             if jax.default_backend() == 'cpu' else dtype)
  *lead, num_in, p, q = poses.shape
  num_out, r = weights.shape[1], weights.shape[3]
  # One dot batched over the children, I leading: [I, n*P, Q] @ [I, Q, O*R].
  # Written as an einsum, its autodiff transpose made XLA:CPU compute the
  # votes' gradient twice, once in each layout its two products wanted (the
  # poses' and the transforms' gradients): the EM models' train steps were
  # 1.1-1.6x slower (BENCHMARKS.md).
  x = jnp.moveaxis(poses.astype(compute).reshape((-1, num_in, p, q)), 1, 0)
  w = jnp.swapaxes(weights.astype(compute), 1, 2)
  votes = jax.lax.dot_general(
      x.reshape(num_in, -1, q), w.reshape(num_in, q, num_out * r),
      (((2,), (1,)), ((0,), (0,))))  # [I, n*P, O*R]
  votes = jnp.transpose(votes.reshape(num_in, -1, p, num_out, r),
                        (1, 0, 3, 2, 4))  # [n, I, O, P, R]
  return votes.reshape(tuple(lead) + (num_in, num_out, p * r)).astype(dtype)


def output_size(size: int, kernel_size: int, stride: int) -> int:
  """Number of VALID windows of ``kernel_size`` with ``stride`` along ``size``."""
  if kernel_size > size:
    raise ValueError(
        f'kernel size {kernel_size} is larger than the input grid ({size}); '
        f'use a smaller kernel or a larger input.')
  if kernel_size < 1 or stride < 1:
    raise ValueError(f'kernel_size and stride must be >= 1, got '
                     f'{kernel_size} and {stride}.')
  return (size - kernel_size) // stride + 1


def window_indices(size: int, kernel_size: int, stride: int) -> np.ndarray:
  """[out, K] input index of every tap of every VALID window along one axis."""
  out = output_size(size, kernel_size, stride)
  return np.arange(out)[:, None] * stride + np.arange(kernel_size)[None, :]


def conv_capsule_patches(x: ArrayLike, kernel_size: int, stride: int
                         ) -> jax.Array:
  """K x K windows of a capsule grid (VALID padding), for conv capsules.

  Args:
    x: [B, H, W, ...] (the trailing dims are carried along, e.g. C, P, P).
  Returns:
    [B, H', W', K, K, ...] with H' = (H - K) // stride + 1.
  """
  x = jnp.asarray(x)
  if x.ndim < 3:
    raise ValueError(
        f'conv_capsule_patches: x must be [B, H, W, ...], got shape {x.shape}.')
  rows = window_indices(x.shape[1], kernel_size, stride)  # [H', K]
  cols = window_indices(x.shape[2], kernel_size, stride)  # [W', K]
  return x[:, rows[:, None, :, None], cols[None, :, None, :]]


def receptive_field_centres(size: int, kernel_size: int = 1, stride: int = 1
                            ) -> np.ndarray:
  """Scaled centre of each position's receptive field along one axis: [out].

  Position o covers inputs o*stride .. o*stride + K - 1; its centre scaled to
  (0, 1) is (o*stride + K/2) / size.
  """
  out = output_size(size, kernel_size, stride)
  return (np.arange(out) * stride + kernel_size / 2.0) / size


def authors_coordinates(size: int, layer_windows: Sequence[tuple[int, int]]
                        ) -> np.ndarray:
  """The released code's coordinate of each position of the last grid
  along one axis: [out].

  google-research capsule_em (simple_model.py, ``conv_pos``/``add_convs``):
  the input's pixel positions centred on the image and scaled by 1/100,
  (i - size/2) / 100 for i = 0 .. size - 1 (np.mgrid from -size/2 to
  size/2), then averaged over each layer's kernel window in turn: every
  position holds the mean pixel coordinate of its receptive field. A 32x32
  input through the smallNORB model's layers gives (4o - 8) / 100 on its
  last 4x4 grid.

  Args:
    size: the input's side.
    layer_windows: (kernel_size, stride) of every layer from the input to
      the last grid, in order.
  """
  coordinates = (np.arange(size) - size / 2.0) / 100.0
  for kernel_size, stride in layer_windows:
    coordinates = coordinates[window_indices(len(coordinates), kernel_size,
                                             stride)].mean(-1)
  return coordinates


def coordinate_addition(votes: ArrayLike, row_offsets: ArrayLike | None = None,
                        col_offsets: ArrayLike | None = None, *,
                        order: str = 'row_col') -> jax.Array:
  """Add each position's scaled (row, col) to the first two vote entries.

  Hinton et al. 2018, section 3.1: the class layer shares transforms over
  positions, so the position is added back to the vote.

  Args:
    votes: [..., H, W, C, O, D] votes of capsules on an H x W grid.
    row_offsets: [H] scaled row centres; default (h + 0.5) / H.
    col_offsets: [W] scaled column centres; default (w + 0.5) / W.
    order: 'row_col' adds the row to entry 0 and the column to entry 1;
      'col_row' the column to entry 0 and the row to entry 1 (the released
      code of Hinton et al.: its ``conv_pos`` swaps the two channels at each
      of its three calls).
  Returns:
    [..., H, W, C, O, D]; entries 0 and 1 of D shifted.
  """
  if order not in ('row_col', 'col_row'):
    raise ValueError(f"order must be 'row_col' or 'col_row', got {order!r}.")
  votes = jnp.asarray(votes)
  if votes.ndim < 5 or votes.shape[-1] < 2:
    raise ValueError(
        f'coordinate_addition: votes must be [..., H, W, C, O, D] with D >= 2, '
        f'got shape {votes.shape}.')
  height, width = votes.shape[-5], votes.shape[-4]
  if row_offsets is None:
    row_offsets = receptive_field_centres(height)
  if col_offsets is None:
    col_offsets = receptive_field_centres(width)
  rows = jnp.broadcast_to(jnp.asarray(row_offsets, votes.dtype)[:, None],
                          (height, width))
  cols = jnp.broadcast_to(jnp.asarray(col_offsets, votes.dtype)[None, :],
                          (height, width))
  offsets = jnp.zeros((height, width, votes.shape[-1]), votes.dtype)
  first, second = (rows, cols) if order == 'row_col' else (cols, rows)
  offsets = offsets.at[..., 0].set(first).at[..., 1].set(second)
  # Leading 1s for the batch dims: no implicit rank promotion.
  offsets = offsets.reshape((1,) * (votes.ndim - 5) + (height, width, 1, 1, -1))
  return votes + offsets


def conv_parent_normalizer(height: int, width: int, kernel_size: int,
                           stride: int, num_types: int):
  """E-step normaliser over every parent that receives a child's votes.

  In a convolutional capsule layer a child at (h, w) votes in every window
  that covers it. The released code of Hinton et al. normalises the child's
  assignments over all the parents of all those windows (so they sum to 1 per
  child), not within each K x K window separately. This returns the
  normaliser to pass as ``em_routing(..., assignment_normalizer=...)``.

  Args:
    height, width: the child grid H x W; kernel_size K; stride; num_types C.
  Returns:
    A function log_numerators [B, H', W', K*K*C, O] -> log R, same shape,
    with log-sum-exp over every (window, parent) of each child equal to 0.
  """
  rows = window_indices(height, kernel_size, stride)[:, None, :, None]
  cols = window_indices(width, kernel_size, stride)[None, :, None, :]
  coverage = np.zeros((height, width), np.int64)
  np.add.at(coverage, (np.broadcast_to(rows, np.broadcast_shapes(
      rows.shape, cols.shape)), np.broadcast_to(cols, np.broadcast_shapes(
          rows.shape, cols.shape))), 1)
  uncovered = jnp.asarray(coverage == 0, jnp.float32)[None, :, :, None]

  def normalize(log_numerators: jax.Array) -> jax.Array:
    batch, out_h, out_w, num_in, num_out = log_numerators.shape
    if num_in != kernel_size * kernel_size * num_types:
      raise ValueError(
          f'conv_parent_normalizer: expected K*K*C = '
          f'{kernel_size * kernel_size * num_types} inputs per window, got '
          f'{num_in}.')
    local = jax.nn.logsumexp(log_numerators, axis=-1).reshape(
        batch, out_h, out_w, kernel_size, kernel_size, num_types)
    # Per-child max for a stable log-sum-exp across windows.
    child_max = jnp.full((batch, height, width, num_types), -jnp.inf,
                         local.dtype).at[:, rows, cols].max(local)
    child_max = jax.lax.stop_gradient(
        jnp.where(jnp.isfinite(child_max), child_max, 0.0))
    window_max = child_max[:, rows, cols]
    child_sum = jnp.zeros((batch, height, width, num_types), local.dtype).at[
        :, rows, cols].add(jnp.exp(local - window_max))
    # Children no window covers never reach the output; keep their log finite.
    log_child_total = jnp.log(child_sum + uncovered) + child_max
    log_total = log_child_total[:, rows, cols].reshape(batch, out_h, out_w,
                                                       num_in)
    return log_numerators - log_total[..., None]

  return normalize


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _max_sharing_ties(x: jax.Array, axis: tuple[int, ...]) -> jax.Array:
  """``jnp.max(x, axis, keepdims=True)`` whose gradient goes to the
  entries at the max, shared equally among ties (jnp.max's and
  TensorFlow's rule), ties counted within 64 ulps of the max.

  jnp.max finds them by exact equality with the max. XLA may compute x
  again inside the comparison's fused code, rounded differently from the
  max's (vector and scalar code paths, FMA contraction): then no entry
  equals the max and the gradient is 0/0 = NaN (seen with XLA:CPU's LLVM IR
  fusion emitters: results/ci).
  """
  return jnp.max(x, axis=axis, keepdims=True)


@_max_sharing_ties.defjvp
def _max_sharing_ties_jvp(axis, primals, tangents):
  (x,), (dx,) = primals, tangents
  top = jnp.max(x, axis=axis, keepdims=True)
  # 64 ulps of the max (of 1 near 0): above a recomputation's rounding;
  # logits that close to the max share its gradient as exact ties do.
  tolerance = 64 * jnp.finfo(x.dtype).eps * jnp.maximum(jnp.abs(top), 1.0)
  at_top = (x >= top - tolerance).astype(x.dtype)
  return top, (jnp.sum(dx * at_top, axis=axis, keepdims=True)
               / jnp.sum(at_top, axis=axis, keepdims=True))


def released_conv_normalizer(out_height: int, out_width: int,
                             kernel_size: int, stride: int, num_types: int,
                             *, true_stride: bool = False,
                             epsilon: float = 1e-7):
  """The released code's conv-capsule E-step normaliser.

  google-research capsule_em (``update_conv_routing``), for each batch
  entry, child type i and parent type o separately:
    e = exp(u - max u), the max over every output position and tap;
    R(window, tap) = e(window, tap) / (sum e(window', tap') + epsilon),
  the sum over the (window', tap') that index the same child. So each
  (child, parent type) is normalised over the windows that cover the child,
  and a child's assignments sum to about the number of parent types, not 1.
  The released code indexes a window's child as output position + tap, as
  if the stride were 1 (a stride-2 layer groups children that are not the
  same); ``true_stride=True`` uses output position * stride + tap instead.
  Because of ``epsilon`` the max subtraction changes the result, so it is
  kept (and differentiated) as there.

  Args:
    out_height, out_width: the output grid H' x W'; kernel_size K; stride;
      num_types C (the child types).
  Returns:
    A function log_numerators [B, H', W', K*K*C, O] (children ordered (row
    tap, column tap, type)) -> log R, same shape.
  """
  step = stride if true_stride else 1
  rows = (np.arange(out_height)[:, None] * step + np.arange(kernel_size)[None])
  cols = (np.arange(out_width)[:, None] * step + np.arange(kernel_size)[None])
  grid_h, grid_w = int(rows.max()) + 1, int(cols.max()) + 1
  rows = rows[:, None, :, None]  # [H', 1, K, 1]
  cols = cols[None, :, None, :]  # [1, W', 1, K]

  def normalize(log_numerators: jax.Array) -> jax.Array:
    batch, out_h, out_w, num_in, num_out = log_numerators.shape
    if (out_h, out_w, num_in) != (out_height, out_width,
                                  kernel_size * kernel_size * num_types):
      raise ValueError(
          f'released_conv_normalizer: expected [B, {out_height}, {out_width}, '
          f'{kernel_size * kernel_size * num_types}, O] log-numerators, got '
          f'{log_numerators.shape}.')
    u = log_numerators.reshape(batch, out_h, out_w, kernel_size, kernel_size,
                               num_types, num_out)
    shifted = u - _max_sharing_ties(u, (1, 2, 3, 4))
    e = jnp.exp(shifted)
    # [B, H', W', K, K, C, O] -> sums on the child grid [B, Hc, Wc, C, O].
    child_sum = jnp.zeros((batch, grid_h, grid_w, num_types, num_out),
                          e.dtype).at[:, rows, cols].add(e)
    log_total = jnp.log(child_sum[:, rows, cols] + epsilon)
    return (shifted - log_total).reshape(log_numerators.shape)

  return normalize

