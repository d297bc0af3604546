"""Tests for capsjax.routing.votes against NumPy loops and hand-computed values.

Shapes: B batch, I input capsules, O output capsules, Din/Dout vector
capsule dimensions, P the side of a pose matrix, H x W a capsule grid, C
capsule types, K the kernel size.
"""

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from capsjax import routing
from capsjax.routing import votes

# chex dimension names are single letters: N = Din, E = Dout.
DIMS = chex.Dimensions(B=2, I=5, O=3, N=4, E=6, P=4, C=2)


def normal(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# Jitted, each one function for every call and parametrisation: one
# compilation per shape, not one per operation.
_vector_votes = jax.jit(votes.vector_votes)
_shared_vector_votes = jax.jit(votes.shared_vector_votes)
_matrix_votes = jax.jit(votes.matrix_votes)
_conv_capsule_patches = jax.jit(votes.conv_capsule_patches,
                                static_argnums=(1, 2))
_coordinate_addition = jax.jit(votes.coordinate_addition)


# ----------------------------------------------------------------------------
# Vote transforms.


@pytest.mark.parametrize('batch_shape', [(), (2,), (2, 3)])
def test_vector_votes_matches_loop(batch_shape):
  inputs = normal(0, batch_shape + DIMS['IN'])
  weights = normal(1, DIMS['IONE'])
  out = jax.jit(votes.vector_votes)(inputs, weights)
  chex.assert_shape(out, batch_shape + DIMS['IOE'])
  ref = np.zeros(batch_shape + DIMS['IOE'])
  for i, j in itertools.product(range(DIMS.I), range(DIMS.O)):
    ref[..., i, j, :] = inputs[..., i, :] @ weights[i, j].astype(np.float64)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('num_in', [1, 5, 9])
def test_shared_vector_votes_matches_loop_for_any_input_count(num_in):
  inputs = normal(2, (DIMS.B, num_in, DIMS.N))
  weights = normal(3, DIMS['ONE'])
  out = np.asarray(_shared_vector_votes(inputs, weights))
  chex.assert_shape(out, (DIMS.B, num_in) + DIMS['OE'])
  for i, j in itertools.product(range(num_in), range(DIMS.O)):
    np.testing.assert_allclose(out[:, i, j], inputs[:, i] @ weights[j],
                               rtol=1e-5, atol=1e-5)
  # The same as vector_votes with W_ij = W_j for every input.
  tiled = np.broadcast_to(weights, (num_in,) + weights.shape)
  np.testing.assert_allclose(out, _vector_votes(inputs, tiled),
                             rtol=1e-6, atol=1e-6)


def test_matrix_votes_matches_loop():
  poses = normal(4, (DIMS.B,) + DIMS['IPP'])
  weights = normal(5, DIMS['IOPP'])
  out = jax.jit(votes.matrix_votes)(poses, weights)
  chex.assert_shape(out, (DIMS.B,) + DIMS['IO'] + (DIMS.P * DIMS.P,))
  for b, i, j in itertools.product(range(DIMS.B), range(DIMS.I),
                                   range(DIMS.O)):
    expected = (poses[b, i].astype(np.float64) @ weights[i, j]).reshape(-1)
    np.testing.assert_allclose(out[b, i, j], expected, rtol=1e-5, atol=1e-5)


def test_matrix_votes_share_transforms_over_positions():
  # poses [B, H*W, C, P, P] with weights [C, O, P, P]: one transform per type.
  poses = normal(6, (DIMS.B, 9, DIMS.C, DIMS.P, DIMS.P))
  weights = normal(7, DIMS['COPP'])
  out = np.asarray(_matrix_votes(poses, weights))
  chex.assert_shape(out, (DIMS.B, 9) + DIMS['CO'] + (DIMS.P * DIMS.P,))
  ref = np.einsum('bncpq,coqr->bncopr', poses, weights).reshape(out.shape)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  # Position 4 of example 1 equals the unshared call on that capsule alone.
  np.testing.assert_allclose(out[1, 4], _matrix_votes(poses[1, 4], weights),
                             rtol=1e-6, atol=1e-6)


def test_matrix_votes_gradients_match_float64_reference():
  # dL/dM_i = sum_j G_ij W_ij^T and dL/dW_ij = sum over the leading dims of
  # M_i^T G_ij, for a cotangent G; poses with two leading dims and
  # non-square P x Q times Q x R transforms, so no axis can be swapped for
  # another unnoticed.
  rng = np.random.default_rng(11)
  poses = rng.normal(size=(2, 3, 5, 3, 4))  # [B, N, I, P, Q]
  weights = rng.normal(size=(5, 6, 4, 2))  # [I, O, Q, R]
  cotangent = rng.normal(size=(2, 3, 5, 6, 3 * 2))
  g = cotangent.reshape(2, 3, 5, 6, 3, 2)
  expected_poses = np.zeros_like(poses)
  expected_weights = np.zeros_like(weights)
  for b, n, i, j in itertools.product(range(2), range(3), range(5), range(6)):
    expected_poses[b, n, i] += g[b, n, i, j] @ weights[i, j].T
    expected_weights[i, j] += poses[b, n, i].T @ g[b, n, i, j]
  with jax.enable_x64(True):
    grads = jax.jit(jax.grad(
        lambda m, w: jnp.sum(votes.matrix_votes(m, w) * cotangent),
        argnums=(0, 1)))(poses, weights)
  np.testing.assert_allclose(grads[0], expected_poses, rtol=1e-12,
                             atol=1e-12)
  np.testing.assert_allclose(grads[1], expected_weights, rtol=1e-12,
                             atol=1e-12)


def test_vote_transforms_reject_bad_shapes():
  with pytest.raises(ValueError, match='vector_votes'):
    votes.vector_votes(np.zeros((2, 5, 4)), np.zeros((5, 3, 3, 6)))
  with pytest.raises(ValueError, match='vector_votes'):
    votes.vector_votes(np.zeros((2, 4, 4)), np.zeros((5, 3, 4, 6)))
  with pytest.raises(ValueError, match='vector_votes'):
    votes.vector_votes(np.zeros((2, 5, 4)), np.zeros((3, 4, 6)))
  with pytest.raises(ValueError, match='shared_vector_votes'):
    votes.shared_vector_votes(np.zeros((2, 5, 4)), np.zeros((3, 5, 6)))
  with pytest.raises(ValueError, match='shared_vector_votes'):
    votes.shared_vector_votes(np.zeros((2, 5, 4)), np.zeros((5, 3, 4, 6)))
  with pytest.raises(ValueError, match='matrix_votes'):
    votes.matrix_votes(np.zeros((2, 5, 4, 4)), np.zeros((6, 3, 4, 4)))
  with pytest.raises(ValueError, match='matrix_votes'):
    votes.matrix_votes(np.zeros((2, 5, 3, 3)), np.zeros((5, 3, 4, 4)))
  with pytest.raises(ValueError, match='matrix_votes'):
    votes.matrix_votes(np.zeros((4, 4)), np.zeros((5, 3, 4, 4)))


# ----------------------------------------------------------------------------
# Windows and receptive fields.


def test_output_size_and_window_indices():
  assert votes.output_size(6, 3, 1) == 4
  assert votes.output_size(6, 3, 2) == 2
  assert votes.output_size(7, 3, 2) == 3
  assert votes.output_size(5, 5, 1) == 1
  assert votes.output_size(7, 2, 3) == 2
  np.testing.assert_array_equal(votes.window_indices(7, 3, 2),
                                [[0, 1, 2], [2, 3, 4], [4, 5, 6]])
  np.testing.assert_array_equal(votes.window_indices(7, 2, 3),
                                [[0, 1], [3, 4]])
  with pytest.raises(ValueError, match='kernel'):
    votes.output_size(2, 3, 1)
  with pytest.raises(ValueError):
    votes.output_size(5, 3, 0)
  with pytest.raises(ValueError):
    votes.output_size(5, 0, 1)


def test_receptive_field_centres():
  np.testing.assert_allclose(votes.receptive_field_centres(4),
                             [0.125, 0.375, 0.625, 0.875])
  # Windows 0..2 and 2..4 of a 6-long axis: centres 1.5/6 and 3.5/6.
  np.testing.assert_allclose(votes.receptive_field_centres(6, 3, 2),
                             [0.25, 3.5 / 6])


PATCH_CASES = [(5, 5, 3, 1), (7, 6, 3, 2), (6, 7, 2, 3), (4, 4, 4, 1)]


@pytest.mark.parametrize('height,width,kernel,stride', PATCH_CASES)
def test_conv_capsule_patches_matches_loop(height, width, kernel, stride):
  x = normal(8, (DIMS.B, height, width, DIMS.C, 2, 3))
  out = np.asarray(_conv_capsule_patches(x, kernel, stride))
  out_h = (height - kernel) // stride + 1
  out_w = (width - kernel) // stride + 1
  chex.assert_shape(out, (DIMS.B, out_h, out_w, kernel, kernel, DIMS.C, 2, 3))
  for oh, ow, kh, kw in itertools.product(range(out_h), range(out_w),
                                          range(kernel), range(kernel)):
    np.testing.assert_array_equal(
        out[:, oh, ow, kh, kw], x[:, oh * stride + kh, ow * stride + kw])


def test_conv_capsule_patches_rejects_bad_shapes():
  with pytest.raises(ValueError, match='kernel'):
    votes.conv_capsule_patches(np.zeros((1, 2, 5, 3)), 3, 1)
  with pytest.raises(ValueError):
    votes.conv_capsule_patches(np.zeros((4, 4)), 3, 1)


# ----------------------------------------------------------------------------
# Coordinate addition.


def test_coordinate_addition_default_offsets():
  height, width = 2, 3
  base = normal(9, (DIMS.B, height, width) + DIMS['CO'] + (5,))
  out = np.asarray(_coordinate_addition(base))
  rows = [0.25, 0.75]  # (h + 0.5) / 2
  cols = [1 / 6, 0.5, 5 / 6]  # (w + 0.5) / 3
  expected = base.copy()
  for h, w in itertools.product(range(height), range(width)):
    expected[:, h, w, :, :, 0] += rows[h]
    expected[:, h, w, :, :, 1] += cols[w]
  np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(out[..., 2:], base[..., 2:])


@pytest.mark.parametrize('batch_shape', [(), (2,), (2, 1)])
def test_coordinate_addition_custom_offsets(batch_shape):
  zeros = np.zeros(batch_shape + (2, 2, 1, 1, 16), np.float32)
  out = np.asarray(_coordinate_addition(zeros, [0.1, 0.2], [0.3, 0.4]))
  chex.assert_shape(out, zeros.shape)
  np.testing.assert_allclose(out[..., 0, 1, 0, 0, :3], np.broadcast_to(
      [0.1, 0.4, 0.0], batch_shape + (3,)))
  np.testing.assert_allclose(out[..., 1, 0, 0, 0, :3], np.broadcast_to(
      [0.2, 0.3, 0.0], batch_shape + (3,)))
  assert np.all(out[..., 2:] == 0.0)


def test_coordinate_addition_rejects_bad_shapes():
  with pytest.raises(ValueError):
    votes.coordinate_addition(np.zeros((2, 3, 1, 1)))
  with pytest.raises(ValueError):
    votes.coordinate_addition(np.zeros((2, 3, 1, 1, 1)))


# ----------------------------------------------------------------------------
# The E-step normaliser of convolutional capsule layers.


def np_conv_normalize(log_numerators, height, width, kernel, stride,
                      num_types):
  """Brute force: each child over every (window, parent) that it votes in."""
  x = np.asarray(log_numerators, np.float64)
  batch, out_h, out_w, _, num_out = x.shape
  x = x.reshape(batch, out_h, out_w, kernel, kernel, num_types, num_out)
  total = np.zeros((batch, height, width, num_types))
  for oh, ow, kh, kw in itertools.product(range(out_h), range(out_w),
                                          range(kernel), range(kernel)):
    total[:, oh * stride + kh, ow * stride + kw] += np.exp(
        x[:, oh, ow, kh, kw]).sum(-1)
  out = np.empty_like(x)
  for oh, ow, kh, kw in itertools.product(range(out_h), range(out_w),
                                          range(kernel), range(kernel)):
    out[:, oh, ow, kh, kw] = x[:, oh, ow, kh, kw] - np.log(
        total[:, oh * stride + kh, ow * stride + kw])[..., None]
  return out.reshape(batch, out_h, out_w, -1, num_out)


def child_totals(log_r, height, width, kernel, stride, num_types):
  """sum of exp(log R) over every window and parent, per child (b, h, w, c)."""
  r = np.exp(np.asarray(log_r, np.float64))
  batch, out_h, out_w, _, num_out = r.shape
  r = r.reshape(batch, out_h, out_w, kernel, kernel, num_types, num_out)
  totals = np.zeros((batch, height, width, num_types))
  covered = np.zeros((height, width), bool)
  for oh, ow, kh, kw in itertools.product(range(out_h), range(out_w),
                                          range(kernel), range(kernel)):
    h, w = oh * stride + kh, ow * stride + kw
    totals[:, h, w] += r[:, oh, ow, kh, kw].sum(-1)
    covered[h, w] = True
  return totals, covered


@pytest.mark.parametrize('height,width,kernel,stride', PATCH_CASES)
def test_conv_parent_normalizer_matches_brute_force(height, width, kernel,
                                                    stride):
  num_out = 3
  out_h = (height - kernel) // stride + 1
  out_w = (width - kernel) // stride + 1
  log_numerators = 3.0 * normal(
      10, (DIMS.B, out_h, out_w, kernel * kernel * DIMS.C, num_out))
  normalize = votes.conv_parent_normalizer(height, width, kernel, stride,
                                           DIMS.C)
  jitted = jax.jit(normalize)
  log_r = jitted(log_numerators)
  chex.assert_shape(log_r, log_numerators.shape)
  np.testing.assert_allclose(
      log_r, np_conv_normalize(log_numerators, height, width, kernel, stride,
                               DIMS.C), rtol=1e-5, atol=1e-5)
  totals, covered = child_totals(log_r, height, width, kernel, stride, DIMS.C)
  np.testing.assert_allclose(totals[:, covered], 1.0, rtol=1e-5)
  np.testing.assert_array_equal(totals[:, ~covered], 0.0)
  # Shift invariance, and stable far from 0 (a naive exp would underflow).
  np.testing.assert_allclose(jitted(log_numerators - 500.0), log_r,
                             rtol=1e-5, atol=1e-4)


def test_conv_parent_normalizer_is_not_per_window():
  """With overlapping windows a child's R sums to 1 over ALL its windows."""
  height = width = 5
  kernel, stride, num_out = 3, 1, 2
  log_numerators = normal(11, (1, 3, 3, kernel * kernel * DIMS.C, num_out))
  log_r = np.asarray(jax.jit(votes.conv_parent_normalizer(
      height, width, kernel, stride, DIMS.C))(log_numerators))
  per_window = np.exp(log_r).sum(-1).reshape(3, 3, kernel, kernel, DIMS.C)
  # Child (0, 0) is only in window (0, 0), at tap (0, 0): all of it there.
  np.testing.assert_allclose(per_window[0, 0, 0, 0], 1.0, rtol=1e-5)
  # Child (2, 2) is in all 9 windows, at tap (2 - oh, 2 - ow) of window
  # (oh, ow): it splits itself among them.
  centre = np.stack([per_window[oh, ow, 2 - oh, 2 - ow]
                     for oh in range(3) for ow in range(3)])
  np.testing.assert_allclose(centre.sum(0), 1.0, rtol=1e-5)
  assert np.all(centre < 0.9)
  # The per-window softmax is a different normaliser.
  per_window_softmax = log_numerators - np.log(
      np.exp(log_numerators).sum(-1, keepdims=True))
  assert np.max(np.abs(log_r - per_window_softmax)) > 0.5


def test_conv_parent_normalizer_gradients():
  normalize = votes.conv_parent_normalizer(4, 4, 2, 2, 1)  # no overlap
  x = normal(12, (1, 2, 2, 4, 3)).astype(np.float64)
  with jax.enable_x64(True):
    weights = jnp.asarray(normal(13, x.shape), jnp.float64)
    check_grads(jax.jit(lambda v: jnp.sum(normalize(v) * weights)),
                (jnp.asarray(x),), order=1, modes=['rev'])
  # Strides that skip children: those never reach the output; still finite.
  normalize = votes.conv_parent_normalizer(6, 7, 2, 3, DIMS.C)
  grad = jax.jit(jax.grad(lambda v: jnp.sum(normalize(v)[..., 0])))(
      normal(14, (DIMS.B, 2, 2, 4 * DIMS.C, 3)))
  assert np.all(np.isfinite(grad))


def test_conv_parent_normalizer_rejects_wrong_window_size():
  normalize = votes.conv_parent_normalizer(5, 5, 3, 1, DIMS.C)
  with pytest.raises(ValueError, match='K\\*K\\*C'):
    normalize(np.zeros((1, 3, 3, 9 * DIMS.C + 1, 2)))


def test_em_routing_in_a_conv_capsule_layer():
  """Patches -> votes -> EM routing with the cross-window normaliser."""
  height, width, kernel, stride = 5, 5, 3, 1
  num_out, pose = 2, DIMS.P
  grid = normal(15, (DIMS.B, height, width, DIMS.C, pose, pose))
  grid_activations = np.random.default_rng(16).uniform(
      0.1, 1.0, (DIMS.B, height, width, DIMS.C)).astype(np.float32)
  num_in = kernel * kernel * DIMS.C
  weights = 0.5 * normal(17, (num_in, num_out, pose, pose))
  normalize = votes.conv_parent_normalizer(height, width, kernel, stride,
                                           DIMS.C)

  @functools.partial(jax.jit, static_argnames='num_iterations')
  def layer(grid, grid_activations, num_iterations):
    patches = votes.conv_capsule_patches(grid, kernel, stride)
    activations = votes.conv_capsule_patches(grid_activations, kernel, stride)
    out_h, out_w = patches.shape[1:3]
    poses = patches.reshape((DIMS.B, out_h, out_w, num_in, pose, pose))
    layer_votes = votes.matrix_votes(poses, weights)
    return routing.em_routing(
        layer_votes, activations.reshape((DIMS.B, out_h, out_w, num_in)),
        np.zeros(num_out), np.zeros(num_out), num_iterations,
        assignment_normalizer=normalize)

  poses, out_activations, assignments = layer(grid, grid_activations, 3)
  chex.assert_shape(poses, (DIMS.B, 3, 3, num_out, pose * pose))
  chex.assert_shape(out_activations, (DIMS.B, 3, 3, num_out))
  chex.assert_shape(assignments, (DIMS.B, 3, 3, num_in, num_out))
  assert np.all(np.isfinite(poses)) and np.all(np.isfinite(out_activations))
  # An assignment that underflows to 0 has log -inf: it adds 0 to its total.
  with np.errstate(divide='ignore'):
    log_assignments = np.log(assignments)
  totals, covered = child_totals(log_assignments, height, width, kernel,
                                 stride, DIMS.C)
  assert np.all(covered)
  np.testing.assert_allclose(totals, 1.0, rtol=1e-4)


def test_authors_coordinates_are_receptive_field_centres_in_pixels():
  # By hand, from the released code: pixel i sits at (i - size/2) / 100 and
  # each layer averages its window. Conv1 5x5/2, ConvCaps1 3x3/2, ConvCaps2
  # 3x3/1: last-grid position o averages pixels 4o .. 4o + 16 around
  # 4o + 8, i.e. (4o + 8 - size/2) / 100.
  windows = ((5, 2), (3, 2), (3, 1))
  np.testing.assert_allclose(votes.authors_coordinates(32, windows),
                             [(4 * o + 8 - 16) / 100 for o in range(4)])
  np.testing.assert_allclose(votes.authors_coordinates(28, windows),
                             [(4 * o + 8 - 14) / 100 for o in range(3)])
  # A stride-1 window of 3 over 5 pixels at (i - 2.5) / 100: the mean of
  # each 3.
  np.testing.assert_allclose(votes.authors_coordinates(5, ((3, 1),)),
                             [-0.015, -0.005, 0.005])
  np.testing.assert_allclose(votes.authors_coordinates(4, ()),
                             [-0.02, -0.01, 0.0, 0.01])
