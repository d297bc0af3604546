"""Matrix-capsule layers with EM routing (Hinton et al. 2018) (shape
legend: ``capsjax.layers``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from capsjax import kernels
from capsjax import nn
from capsjax import routing
from capsjax.kernels import implementations
from capsjax.layers.common import DEFAULT_KERNEL_INIT
from capsjax.layers.common import check_positive_int
from capsjax.routing import matrix_capsules
from capsjax.routing import votes as votes_lib

# ----------------------------------------------------------------------------
# Matrix capsules (Hinton et al. 2018).


class MatrixPrimaryCapsules(nnx.Module):
  """1x1 convolution to pose matrices and sigmoid activations.

  [B, H, W, in_features] -> (poses [B, H, W, num_types, P, P],
  activations [B, H, W, num_types]).

  ``form='paper'``: a pose kernel and an activation kernel with biases
  (LeCun normal, zero biases), activations sigmoid(x W_a + b_a).
  The released forms follow google-research capsule_em's ``primary_caps``:
  no biases, activations sigmoid(logit - 1), one kernel [in_features,
  num_types * P*P + num_types], the concatenation of a pose kernel (TF
  truncated normal, std 0.5) and an activation kernel (std 3.0), drawn the
  same way here. They differ in how the output channels are read:
  ``form='released'`` (that code from 2020 on) splits them first, the
  first num_types * P*P channels the poses (type by type) and the last
  num_types the activation logits, so the std-3.0 columns are the logits;
  ``form='released_2019'`` (the code first released, which the published
  checkpoint came with) reads them type by type in groups of P*P + 1, P*P
  pose entries then the logit, so the std-3.0 columns are the last
  num_types columns, not the logits (for 32 types the poses and logits of
  the last two types).
  """

  def __init__(self, in_features: int, num_types: int, pose_size: int = 4, *,
               form: str = 'paper', rngs: nnx.Rngs):
    for name, value in (('in_features', in_features),
                        ('num_types', num_types), ('pose_size', pose_size)):
      check_positive_int(name, value)
    if form not in ('paper', 'released', 'released_2019'):
      raise ValueError(f"form must be 'paper', 'released' or "
                       f"'released_2019', got {form!r}.")
    self.num_types, self.pose_size, self.form = num_types, pose_size, form
    poses = num_types * pose_size * pose_size
    if form != 'paper':
      pose_key, activation_key = rngs.params(), rngs.params()
      self.kernel = nnx.Param(jnp.concatenate([
          nn.truncated_normal_init(0.5)(pose_key, (in_features, poses)),
          nn.truncated_normal_init(3.0)(activation_key,
                                        (in_features, num_types)),
      ], axis=-1))
      return
    self.pose_kernel = nnx.Param(DEFAULT_KERNEL_INIT(
        rngs.params(), (in_features, poses)))
    self.pose_bias = nnx.Param(jnp.zeros((poses,), jnp.float32))
    self.activation_kernel = nnx.Param(DEFAULT_KERNEL_INIT(
        rngs.params(), (in_features, num_types)))
    self.activation_bias = nnx.Param(jnp.zeros((num_types,), jnp.float32))

  def __call__(self, x: ArrayLike) -> tuple[jax.Array, jax.Array]:
    x = jnp.asarray(x)
    p = self.pose_size
    if self.form != 'paper':
      y = jnp.einsum('...c,cf->...f', x, self.kernel[...])
      lead, types = x.shape[:-1], self.num_types
      if self.form == 'released':
        poses, logits = y[..., :types * p * p], y[..., types * p * p:]
      else:
        y = y.reshape(lead + (types, p * p + 1))
        poses, logits = y[..., :p * p], y[..., p * p]
      poses = poses.reshape(lead + (types, p, p))
      return poses, jax.nn.sigmoid(logits - 1.0)
    poses = nn.dense(x, self.pose_kernel[...], self.pose_bias[...])
    poses = poses.reshape(x.shape[:-1] + (self.num_types, p, p))
    logits = nn.dense(x, self.activation_kernel[...], self.activation_bias[...])
    return poses, jax.nn.sigmoid(logits)


def _check_em_routing(em_routing) -> routing.EMRouting:
  if not isinstance(em_routing, routing.EMRouting):
    raise ValueError(f'em_routing must be a routing.EMRouting (presets: '
                     f'routing.EM_ROUTING_PRESETS), got {em_routing!r}.')
  return em_routing



class ConvCapsules(nnx.Module):
  """Convolutional capsule layer with EM routing (ConvCaps1 / ConvCaps2).

  W [K, K, in_types, out_types, P, P]: one transform per kernel tap and (in
  type, out type) pair, shared over positions; beta_u, beta_a [out_types]
  shared over positions (the authors' answer in the review thread).

  (poses [B, H, W, in_types, P, P], activations [B, H, W, in_types]) ->
  (poses [B, H', W', out_types, P, P], activations [B, H', W', out_types]),
  H' = (H - K) // stride + 1.

  ``remat=True`` wraps patches, votes and routing in ``jax.checkpoint`` so the
  backward pass recomputes the votes (the largest tensor of the network:
  [B, H', W', K*K*Cin, Cout, P*P]) instead of storing them.
  ``remat_iterations=True`` checkpoints each routing iteration instead
  (``routing.em_routing``): only the assignments are kept between
  iterations (BENCHMARKS.md compares the two).
  ``votes_dtype=jnp.bfloat16`` stores votes in bfloat16; routing statistics
  stay float32. ``window_chunk``: windows routed at a time, their votes
  recomputed in the backward pass
  (``matrix_capsules.conv_capsule_routing``; None: chunks of about
  ``matrix_capsules.WINDOW_CHUNK_BYTES`` of votes on a CPU, all at once on
  an accelerator). ``implementation``: ``kernels.conv_capsule_routing``'s
  (None: the fused CPU kernel where it applies).
  """

  def __init__(self, in_types: int, out_types: int, kernel_size: int = 3,
               stride: int = 2, *, pose_size: int = 4,
               em_routing: routing.EMRouting = routing.PAPER_EM,
               remat: bool = False, remat_iterations: bool = False,
               window_chunk: int | None = None,
               implementation: str | None = None,
               votes_dtype=None, transform_std: float | None = None,
               transform_init: str = 'normal',
               beta_u_init: float = 0.0, beta_a_init: float = 0.0,
               rngs: nnx.Rngs):
    for name, value in (('in_types', in_types), ('out_types', out_types),
                        ('kernel_size', kernel_size), ('stride', stride),
                        ('pose_size', pose_size)):
      check_positive_int(name, value)
    self.kernel_size, self.stride = kernel_size, stride
    self.em_routing = _check_em_routing(em_routing)
    self.remat, self.remat_iterations = remat, remat_iterations
    matrix_capsules.check_window_chunk(window_chunk)
    self.window_chunk = window_chunk
    implementations.check(implementation, 'conv_capsule_routing')
    self.implementation = implementation
    self.votes_dtype = None if votes_dtype is None else jnp.dtype(votes_dtype)
    self.weights = nnx.Param(nn.capsule_transform_init(
        rngs.params(), (kernel_size, kernel_size, in_types, out_types,
                        pose_size, pose_size), pose_size, transform_std,
        transform_init))
    self.beta_u = nnx.Param(jnp.full((out_types,), beta_u_init, jnp.float32))
    self.beta_a = nnx.Param(jnp.full((out_types,), beta_a_init, jnp.float32))

  def output_size(self, size: int) -> int:
    """H' for an input grid side H (ValueError if the kernel does not fit)."""
    return votes_lib.output_size(size, self.kernel_size, self.stride)

  def __call__(self, poses: ArrayLike, activations: ArrayLike
               ) -> tuple[jax.Array, jax.Array]:
    fn = functools.partial(
        kernels.conv_capsule_routing, stride=self.stride,
        em_routing=self.em_routing, votes_dtype=self.votes_dtype,
        remat_iterations=self.remat_iterations,
        window_chunk=self.window_chunk, implementation=self.implementation)
    if self.remat:
      fn = jax.checkpoint(fn)
    out_poses, out_acts, _ = fn(poses, activations, self.weights[...],
                                self.beta_u[...], self.beta_a[...])
    return out_poses, out_acts



class ClassCapsules(nnx.Module):
  """Class capsule layer: transforms shared over positions, coordinate addition.

  W [in_types, num_classes, P, P] shared by every position; beta_u, beta_a
  [num_classes]. Votes [B, H, W, Cin, O, P*P] (+ coordinate addition) are
  routed as H*W*Cin input capsules.

  (poses [B, H, W, in_types, P, P], activations [B, H, W, in_types]) ->
  (poses [B, num_classes, P, P], activations [B, num_classes]).
  ``coordinate_offsets`` (rows, cols): what coordinate addition adds (see
  ``matrix_capsules.class_capsule_routing``); None: the grid's (h + 0.5) / H.
  """

  def __init__(self, in_types: int, num_classes: int, *, pose_size: int = 4,
               coordinate_addition: bool = True,
               coordinate_offsets: tuple[Sequence[float], Sequence[float]]
               | None = None,
               em_routing: routing.EMRouting = routing.PAPER_EM,
               coordinate_order: str = 'row_col', votes_dtype=None,
               transform_std: float | None = None,
               transform_init: str = 'normal', beta_u_init: float = 0.0,
               beta_a_init: float = 0.0, rngs: nnx.Rngs):
    for name, value in (('in_types', in_types), ('num_classes', num_classes),
                        ('pose_size', pose_size)):
      check_positive_int(name, value)
    self.coordinate_addition = coordinate_addition
    # Tuples of floats: static, hashable module attributes.
    self.coordinate_offsets = None if coordinate_offsets is None else tuple(
        tuple(float(x) for x in axis) for axis in coordinate_offsets)
    self.em_routing = _check_em_routing(em_routing)
    if coordinate_order not in ('row_col', 'col_row'):
      raise ValueError(f"coordinate_order must be 'row_col' or 'col_row', got "
                       f'{coordinate_order!r}.')
    self.coordinate_order = coordinate_order
    self.votes_dtype = None if votes_dtype is None else jnp.dtype(votes_dtype)
    self.weights = nnx.Param(nn.capsule_transform_init(
        rngs.params(), (in_types, num_classes, pose_size, pose_size),
        pose_size, transform_std, transform_init))
    self.beta_u = nnx.Param(jnp.full((num_classes,), beta_u_init, jnp.float32))
    self.beta_a = nnx.Param(jnp.full((num_classes,), beta_a_init, jnp.float32))

  def route(self, poses: ArrayLike, activations: ArrayLike
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(poses [B, K, P, P], activations [B, K], assignments [B, H*W*Cin, K])
    (see ``matrix_capsules.class_capsule_routing``)."""
    return matrix_capsules.class_capsule_routing(
        poses, activations, self.weights[...], self.beta_u[...],
        self.beta_a[...], coordinate_addition=self.coordinate_addition,
        coordinate_offsets=self.coordinate_offsets,
        coordinate_order=self.coordinate_order, votes_dtype=self.votes_dtype,
        em_routing=self.em_routing)

  def __call__(self, poses: ArrayLike, activations: ArrayLike
               ) -> tuple[jax.Array, jax.Array]:
    out_poses, out_acts, _ = self.route(poses, activations)
    return out_poses, out_acts
