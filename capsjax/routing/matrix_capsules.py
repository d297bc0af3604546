"""EM routing of matrix-capsule layers as pure functions: the conv capsule
layer's windows (through XLA in chunks, or through a window router that
``capsjax.kernels`` supplies) and the class capsule layer's positions.
``layers.ConvCapsules`` and ``layers.ClassCapsules`` hold the parameters
and call these (through ``capsjax.kernels.conv_capsule_routing``, which
chooses the implementation).

Shape legend as in ``capsjax.layers``: B the batch, H x W a grid (H' x W'
after a kernel), Cin / Cout capsule types, I input capsules, O output
capsules, P the side of a pose matrix, K a kernel size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from capsjax.routing import em as routing
from capsjax.routing import votes as votes_lib

# On a CPU, conv_capsule_routing routes the windows in chunks whose votes
# take about this many bytes, so that one chunk's votes and their routing
# temporaries (about 6 votes-sized tensors forward and backward) stay in
# the caches instead of streaming the whole layer's through memory each
# pass: 3 windows of the paper EM model's conv capsule layers (288 x 32 x
# 16 float32 votes each; benchmarks/em_memory.py times other sizes).
WINDOW_CHUNK_BYTES = 2**21
# Routes N independent windows: (poses [N, I, P, P], activations [N, I],
# weights [I, O, P, P], beta_u, beta_a, *, em_routing) -> (poses [N, O, P*P],
# activations [N, O], assignments [N, I, O]), as
# em_routing(votes.matrix_votes(poses, weights), ...) computes them.
WindowRouter = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def check_window_chunk(window_chunk) -> None:
  if window_chunk is not None and (
      isinstance(window_chunk, bool) or not isinstance(window_chunk, int)
      or window_chunk < 0):
    raise ValueError(f'window_chunk must be None or an int >= 0, got '
                     f'{window_chunk!r}.')


def window_chunk_size(window_chunk: int | None, votes_per_window: int,
                      dtype) -> int:
  """Windows per chunk: ``window_chunk`` (0: all at once) or, for None,
  the CPU's default (``WINDOW_CHUNK_BYTES`` of votes; all at once on an
  accelerator, where one chunk at a time would leave it idle)."""
  check_window_chunk(window_chunk)
  if window_chunk is not None:
    return window_chunk
  if jax.default_backend() != 'cpu':
    return 0
  return max(1, WINDOW_CHUNK_BYTES
             // (votes_per_window * jnp.dtype(dtype).itemsize))


def _chunk_shape(batch: int, positions: int, window_chunk: int,
                 whole_images: bool) -> tuple[int, int]:
  """(images, positions) per chunk of about ``window_chunk`` windows.

  The images per chunk divide the batch and, where the batch allows, are a
  multiple of the device count: a batch sharded over the devices then
  stays sharded inside every chunk, and the chunks run over unsharded
  axes (mapping over a sharded axis made a 4-device train step 4x
  slower).
  """
  if whole_images or window_chunk >= positions:
    per_image, images = positions, max(1, window_chunk // positions)
  else:
    per_image, images = window_chunk, 1
  devices = jax.device_count()
  step = devices if batch % devices == 0 else 1
  # A multiple of step, at most the batch (itself a multiple of step).
  images = -(-min(images, batch) // step) * step
  while batch % images:
    images += step
  return images, per_image


def _chunked_windows(route, pose_patches: jax.Array, act_patches: jax.Array,
                     images: int, per_image: int):
  """``route`` over [B, positions] windows, chunk by chunk.

  A chunk is ``per_image`` positions of ``images`` images (every
  B/images-th image, so that a sharded batch dim stays the chunk's major
  dim). Each chunk's votes and routing are recomputed in the backward pass
  (``jax.checkpoint`` per chunk), so neither pass holds more than one
  chunk's [images, per_image, I, O, P*P] temporaries, and the forward pass
  keeps only the patches for the backward.

  Args:
    route: (pose patches [b, n, I, P, P], activation patches [b, n, I]) ->
      pytree of [b, n, ...] arrays.
    pose_patches: [B, N, I, P, P]; act_patches: [B, N, I].
    images: images per chunk (divides B); per_image: positions per chunk.
  Returns:
    route's pytree over all [B, N] windows.
  """
  batch, num = pose_patches.shape[:2]
  if images >= batch and per_image >= num:
    return route(pose_patches, act_patches)
  groups, count = batch // images, -(-num // per_image)
  pad = count * per_image - num

  def split(x):
    """[B, N, ...] -> [groups * count, images, per_image, ...]; positions
    padded with zeros (zero activations route to finite outputs, sliced
    off below)."""
    if pad:
      x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    rest = x.shape[2:]
    x = x.reshape((images, groups, count, per_image) + rest)
    x = jnp.moveaxis(x, 0, 2)
    return x.reshape((groups * count, images, per_image) + rest)

  def merge(y):
    rest = y.shape[3:]
    y = jnp.moveaxis(y.reshape((groups, count, images, per_image) + rest), 2,
                     0)
    return y.reshape((batch, count * per_image) + rest)[:, :num]

  out = jax.lax.map(lambda xs: jax.checkpoint(route)(*xs),
                    (split(pose_patches), split(act_patches)))
  return jax.tree.map(merge, out)


def conv_capsule_routing(
    poses: ArrayLike, activations: ArrayLike, weights: ArrayLike,
    beta_u: ArrayLike, beta_a: ArrayLike, *, stride: int,
    em_routing: routing.EMRouting | None = None, votes_dtype=None,
    remat_iterations: bool = False, window_chunk: int | None = None,
    route_windows: WindowRouter | None = None, **fields
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Convolutional capsules with EM routing, as a pure function.

  Every K x K window of children is routed to the out_types parents at its
  output position: votes V = M_i W_(tap, in type, out type), I = K*K*Cin
  children ordered (row tap, column tap, type).

  Args:
    poses: [B, H, W, Cin, P, P]; activations: [B, H, W, Cin].
    weights: [K, K, Cin, Cout, P, P]; beta_u, beta_a: [Cout].
    stride: window stride.
    em_routing: the routing (``routing.EMRouting``; None: the paper's);
      ``fields``, any of its fields by name, override it. Without
      ``normalize_across_positions`` or ``released`` each window routes on
      its own (one em_routing per output position, mapped over [B, H',
      W']); ``normalize_across_positions`` normalises each child's
      assignments over every parent that receives its votes across
      positions (``votes.conv_parent_normalizer``); ``released`` is the
      released code's conv routing (``update_conv_routing``): the mass
      padded by ``mass_epsilon`` (default 1e-7) and its E-step normaliser
      ``votes.released_conv_normalizer``, windows indexed as if the stride
      were 1 unless ``true_stride``.
    votes_dtype: dtype of the votes (e.g. bfloat16 to halve their memory);
      routing statistics stay float32. None keeps the poses' dtype. The
      fused kernel rounds poses and transforms to it and then computes the
      votes and routing in float32 (it stores no votes).
    window_chunk: windows routed at a time: each chunk computes its votes
      from its pose patches and is recomputed in the backward pass
      (``jax.checkpoint``), so no pass holds more than one chunk's votes.
      With an E-step normaliser (``normalize_across_positions``,
      ``released``) the chunks are whole images, as many as fit in
      ``window_chunk`` windows (at least one). 0 routes all windows at
      once; None is 0 on an accelerator and on a CPU the windows whose
      votes take about ``WINDOW_CHUNK_BYTES``.
    route_windows: a function that routes independent windows (the
      ``WindowRouter`` contract: ``capsjax.kernels`` passes its fused CPU
      or Pallas kernel here), used instead of XLA for every window; it
      takes no E-step normaliser (``released``,
      ``normalize_across_positions``) nor ``remat_iterations``, and
      ``window_chunk`` does not apply. None: XLA, in ``window_chunk``
      chunks.
  Returns:
    (poses [B, H', W', Cout, P, P], activations [B, H', W', Cout] in the input
    poses' dtype, assignments [B, H', W', I, Cout] float32).
  """
  em_routing = routing.with_overrides(em_routing, **fields)
  poses, activations = jnp.asarray(poses), jnp.asarray(activations)
  weights = jnp.asarray(weights)
  _check_conv_shapes(poses, activations, weights)
  kernel_size, _, in_types, out_types, p, _ = weights.shape
  out_dtype = poses.dtype
  if votes_dtype is not None:
    poses, weights = poses.astype(votes_dtype), weights.astype(votes_dtype)
  pose_patches, act_patches = _window_patches(poses, activations,
                                              kernel_size, stride)
  em_routing, options = _window_routing_options(
      em_routing, remat_iterations, poses.shape[1:3], pose_patches.shape[1:3],
      kernel_size, stride, in_types)
  num_in = kernel_size * kernel_size * in_types
  flat_weights = weights.reshape(num_in, out_types, p, p)
  normalizer = 'assignment_normalizer' in options
  if route_windows is not None:
    if normalizer or em_routing.released or remat_iterations:
      raise ValueError(
          'conv capsules: a window router routes each window on its own; '
          'it takes no E-step normaliser (released, '
          'normalize_across_positions) and no remat_iterations.')
    out_poses, out_acts, assignments = _route_windows_fused(
        pose_patches, act_patches, flat_weights, beta_u, beta_a, em_routing,
        route_windows)
  else:
    out_poses, out_acts, assignments = _route_windows_xla(
        pose_patches, act_patches, flat_weights, beta_u, beta_a, options,
        window_chunk)
  return (out_poses.astype(out_dtype), out_acts.astype(out_dtype),
          assignments)


def _check_conv_shapes(poses: jax.Array, activations: jax.Array,
                       weights: jax.Array) -> None:
  """ValueError unless poses are [B, H, W, Cin, P, P], activations
  [B, H, W, Cin] and weights [K, K, Cin, Cout, P, P]."""
  if poses.ndim != 6 or activations.shape != poses.shape[:4]:
    raise ValueError(
        f'conv capsules: poses must be [B, H, W, C, P, P] and activations '
        f'[B, H, W, C], got {poses.shape} and {activations.shape}.')
  _, _, in_types, _, p, _ = weights.shape
  if poses.shape[3:] != (in_types, p, p):
    raise ValueError(
        f'conv capsules: poses {poses.shape} do not match weights [K, K, Cin, '
        f'Cout, P, P] = {weights.shape}.')


def _window_patches(poses: jax.Array, activations: jax.Array,
                    kernel_size: int, stride: int
                    ) -> tuple[jax.Array, jax.Array]:
  """Every K x K window's children: poses [B, H, W, Cin, P, P], activations
  [B, H, W, Cin] -> (pose patches [B, H', W', I, P, P], activation patches
  [B, H', W', I]), I = K*K*Cin ordered (row tap, column tap, type)."""
  in_types, p = poses.shape[3], poses.shape[-1]
  num_in = kernel_size * kernel_size * in_types
  pose_patches = votes_lib.conv_capsule_patches(poses, kernel_size, stride)
  batch, out_h, out_w = pose_patches.shape[:3]
  pose_patches = pose_patches.reshape(batch, out_h, out_w, num_in, p, p)
  act_patches = votes_lib.conv_capsule_patches(
      activations, kernel_size, stride).reshape(batch, out_h, out_w, num_in)
  return pose_patches, act_patches


def _window_routing_options(
    em_routing: routing.EMRouting, remat_iterations: bool,
    grid: tuple[int, int], out_grid: tuple[int, int], kernel_size: int,
    stride: int, in_types: int) -> tuple[routing.EMRouting, dict]:
  """(em_routing, ``routing.em_routing``'s keywords) for the windows of an
  H x W grid (``grid``) routed to H' x W' positions (``out_grid``): the
  E-step normaliser, if any, and the released code's default mass epsilon
  where ``released`` leaves it None."""
  options = dict(remat_iterations=remat_iterations)
  if em_routing.released:
    options.update(assignment_normalizer=votes_lib.released_conv_normalizer(
        *out_grid, kernel_size, stride, in_types,
        true_stride=em_routing.true_stride))
    if em_routing.mass_epsilon is None:
      em_routing = dataclasses.replace(
          em_routing, mass_epsilon=routing.RELEASED_CONV_MASS_EPSILON)
  elif em_routing.normalize_across_positions:
    options.update(assignment_normalizer=votes_lib.conv_parent_normalizer(
        *grid, kernel_size, stride, in_types))
  options.update(em_routing=em_routing)
  return em_routing, options


def _route_windows_fused(
    pose_patches: jax.Array, act_patches: jax.Array, flat_weights: jax.Array,
    beta_u: ArrayLike, beta_a: ArrayLike, em_routing: routing.EMRouting,
    route_windows: WindowRouter) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Every window through ``route_windows`` (a fused kernel).

  Patches [B, H', W', I, P, P] and [B, H', W', I], flat_weights [I, O, P, P]
  -> (poses [B, H', W', O, P, P], activations [B, H', W', O], assignments
  [B, H', W', I, O]).
  """
  batch, out_h, out_w, num_in, p, _ = pose_patches.shape
  out_types = flat_weights.shape[1]
  out_poses, out_acts, assignments = route_windows(
      pose_patches.reshape(-1, num_in, p, p),
      act_patches.reshape(-1, num_in), flat_weights, beta_u, beta_a,
      em_routing=em_routing)
  return (out_poses.reshape(batch, out_h, out_w, out_types, p, p),
          out_acts.reshape(batch, out_h, out_w, out_types),
          assignments.reshape(batch, out_h, out_w, num_in, out_types))


def _route_windows_xla(
    pose_patches: jax.Array, act_patches: jax.Array, flat_weights: jax.Array,
    beta_u: ArrayLike, beta_a: ArrayLike, options: dict,
    window_chunk: int | None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Every window through ``routing.em_routing`` in XLA, in chunks of about
  ``window_chunk`` windows (``window_chunk_size``).

  Patches [B, H', W', I, P, P] and [B, H', W', I], flat_weights [I, O, P, P],
  ``options`` ``routing.em_routing``'s keywords -> (poses [B, H', W', O, P,
  P], activations [B, H', W', O], assignments [B, H', W', I, O]).
  """
  batch, out_h, out_w, num_in, p, _ = pose_patches.shape
  out_types = flat_weights.shape[1]
  # An E-step normaliser couples the windows of an image: it routes whole
  # images. Without one every window routes on its own (em_routing maps
  # over the leading dims exactly as a vmap over windows would; a nested
  # vmap over H', W' cost 1.5x more on CPU).
  whole_images = 'assignment_normalizer' in options

  def route(pose_windows, act_windows):
    """[b, H'*W', I, P, P], [b, H'*W', I] -> routing outputs [b, H'*W', ...]."""
    if whole_images:
      pose_windows = pose_windows.reshape((-1, out_h, out_w)
                                          + pose_windows.shape[2:])
      act_windows = act_windows.reshape(-1, out_h, out_w, num_in)
    out = routing.em_routing(
        votes_lib.matrix_votes(pose_windows, flat_weights), act_windows,
        beta_u, beta_a, **options)
    return tuple(x.reshape((-1, out_h * out_w) + x.shape[3:]) if whole_images
                 else x for x in out)

  positions = out_h * out_w
  window_chunk = window_chunk_size(
      window_chunk, num_in * out_types * p * p,
      jnp.promote_types(pose_patches.dtype, jnp.float32))
  images, per_image = (batch, positions) if not window_chunk else (
      _chunk_shape(batch, positions, window_chunk, whole_images))
  out_poses, out_acts, assignments = _chunked_windows(
      route, pose_patches.reshape((batch, positions, num_in, p, p)),
      act_patches.reshape(batch, positions, num_in), images, per_image)
  return (out_poses.reshape(batch, out_h, out_w, out_types, p, p),
          out_acts.reshape(batch, out_h, out_w, out_types),
          assignments.reshape(batch, out_h, out_w, num_in, out_types))


def class_capsule_routing(
    poses: ArrayLike, activations: ArrayLike, weights: ArrayLike,
    beta_u: ArrayLike, beta_a: ArrayLike, *, coordinate_addition: bool = True,
    coordinate_offsets: tuple[Sequence[float], Sequence[float]] | None = None,
    coordinate_order: str = 'row_col', votes_dtype=None,
    em_routing: routing.EMRouting | None = None, **fields
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Class capsules: transforms shared over positions, one EM routing.

  Args:
    poses: [B, H, W, Cin, P, P]; activations: [B, H, W, Cin].
    weights: [Cin, O, P, P]; beta_u, beta_a: [O].
    coordinate_addition: add each position's scaled (row, col) centre,
      (h + 0.5) / H and (w + 0.5) / W, to vote entries 0 and 1
      (``votes.coordinate_addition``).
    coordinate_offsets: (row offsets [H], column offsets [W]) to add
      instead (e.g. ``votes.authors_coordinates``); None: the grid's.
    coordinate_order: 'row_col' puts the row on vote entry 0 and the column
      on entry 1; 'col_row' the other way round (the released code, whose
      ``conv_pos`` swaps its two channels at each of its three calls).
    em_routing, fields: the routing, as ``routing.em_routing``'s
      ``options`` and ``fields`` (the released class layer pads the mass
      by 1e-5).
  Returns:
    (poses [B, O, P, P] in the input poses' dtype, activations [B, O]
    float32 (the class scores), assignments [B, H*W*Cin, O] float32), inputs
    ordered (row, col, type).
  """
  poses, activations = jnp.asarray(poses), jnp.asarray(activations)
  weights = jnp.asarray(weights)
  if poses.ndim != 6 or activations.shape != poses.shape[:4]:
    raise ValueError(
        f'class capsules: poses must be [B, H, W, C, P, P] and activations '
        f'[B, H, W, C], got {poses.shape} and {activations.shape}.')
  out_dtype = poses.dtype
  if votes_dtype is not None:
    poses, weights = poses.astype(votes_dtype), weights.astype(votes_dtype)
  batch = poses.shape[0]
  num_out, p = weights.shape[1], weights.shape[2]
  v = votes_lib.matrix_votes(poses, weights)  # [B, H, W, Cin, O, P*P]
  if coordinate_addition:
    v = votes_lib.coordinate_addition(v, *(coordinate_offsets or (None, None)),
                                      order=coordinate_order)
  v = v.reshape(batch, -1, num_out, p * p)
  out_poses, out_acts, assignments = routing.em_routing(
      v, activations.reshape(batch, -1), beta_u, beta_a,
      em_routing=routing.with_overrides(em_routing, **fields))
  # The class activations are the class scores: float32 (routing.em_routing).
  return (out_poses.reshape(batch, num_out, p, p).astype(out_dtype),
          out_acts, assignments)
