"""The released EM routing and model details against float64 references.

The references below are written from reading the authors' released code
(google-research, capsule_em/em_layers.py: ``update_em_routing``, the class
layer, and ``update_conv_routing``, the conv capsule layers' slow path with
its ``extract_image_patches`` normaliser; ``primary_caps``; simple_model.py's
``conv_pos``) in that code's own layouts. They run on complex numbers too, so
each gradient is checked by the complex-step derivative of the reference
along random directions (exact to rounding, no finite-difference error).
"""

import dataclasses
import functools
import math
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from capsjax import kernels
from capsjax import layers
from capsjax import models
from capsjax import routing
from capsjax.routing import votes as votes_lib
from tests.conftest import unit_tier_keeps

LOG_2PI = math.log(2 * math.pi)
STEP = 1e-30  # the complex step


# ----------------------------------------------------------------------------
# References (NumPy, float64 or complex128).


def _log_sigmoid(x):
  """min(0, x) - log(1 + exp(-|x|)), written analytically for complex x."""
  positive = x.real >= 0
  return np.where(positive, -np.log1p(np.exp(-np.where(positive, x, 0))),
                  x - np.log1p(np.exp(np.where(positive, 0, x))))


def _max(x, axes):
  """max by real part (complex-step safe: the winner's imaginary part
  follows it)."""
  order = np.moveaxis(x, axes, range(-len(axes), 0))
  flat = order.reshape(order.shape[:order.ndim - len(axes)] + (-1,))
  pick = np.argmax(flat.real, axis=-1)[..., None]
  best = np.take_along_axis(flat, pick, axis=-1)[..., 0]
  return np.expand_dims(best, axes)


def _softmax(x, axis):
  e = np.exp(x - _max(x, (axis,)))
  return e / e.sum(axis=axis, keepdims=True)


def _m_and_e_step(vote_conf, wx, center, beta, beta_a, beta_u, min_var,
                  sum_axes, mass_epsilon):
  """One body of the released loop up to the E-step's log numerators.

  wx [..., O, D, ...] with D on axis 3; ``sum_axes`` the child axes.
  """
  def child_sum(x):
    return np.sum(x, axis=sum_axes, keepdims=True)
  masses = child_sum(vote_conf) + mass_epsilon
  center = 0.9 * child_sum(vote_conf * wx) / masses + 0.1 * center
  noise = (wx - center) ** 2
  variance = min_var + child_sum(vote_conf * noise) / masses
  log_variance = np.log(variance)
  dim = wx.shape[3]
  p_i = -np.sum(log_variance, axis=3, keepdims=True)
  win = masses * (p_i - beta_u * dim * (LOG_2PI + 1.0))
  logit = beta * (win - beta_a * 5000)
  sigma_update = (dim * LOG_2PI - p_i) / 2.0
  exp_update = np.sum(noise / (2 * variance), axis=3, keepdims=True)
  return _log_sigmoid(logit) - sigma_update - exp_update, logit, center


def released_class_routing(wx, activations, beta_a, beta_u, lambdas,
                           min_var=5e-4):
  """update_em_routing: wx [B, I, O, D], activations [B, I] ->
  (activations [B, O], poses [B, O, D])."""
  wx = wx[..., None, None]  # [B, I, O, D, 1, 1]
  a = activations[:, :, None, None, None, None]
  beta_a = beta_a[None, None, :, None, None, None]
  beta_u = beta_u[None, None, :, None, None, None]
  update = np.zeros(wx.shape[:3] + (1, 1, 1), wx.dtype)
  center = np.zeros((wx.shape[0], 1) + wx.shape[2:], wx.dtype)
  for beta in lambdas:
    posterior = _softmax(update, axis=2)
    update, logit, center = _m_and_e_step(
        posterior * a, wx, center, beta, beta_a, beta_u, min_var, (1,), 1e-5)
  return (1 / (1 + np.exp(-logit[:, 0, :, 0, 0, 0])),
          center[:, 0, :, :, 0, 0])


def _extract_patches(images, k, stride, rate):
  """tf.extract_image_patches, VALID: [N, H, W, 1] -> [N, H', W', k*k]."""
  span = (k - 1) * rate + 1
  out_h = (images.shape[1] - span) // stride + 1
  out_w = (images.shape[2] - span) // stride + 1
  patches = np.zeros((images.shape[0], out_h, out_w, k * k), images.dtype)
  for a in range(k):
    for b in range(k):
      patches[..., a * k + b] = images[
          :, a * rate:a * rate + stride * (out_h - 1) + 1:stride,
          b * rate:b * rate + stride * (out_w - 1) + 1:stride, 0]
  return patches


def released_conv_routing(wx, activations, beta_a, beta_u, lambdas,
                          min_var=5e-4):
  """update_conv_routing: wx [B, I, O, D, n, n, k, k], activations
  [B, I, 1, 1, n, n, k, k] -> (activations [B, O, n, n], poses
  [B, O, D, n, n])."""
  batch, num_in, num_out, _, n, _, k, _ = wx.shape
  beta_a = beta_a[None, None, :, None, None, None, None, None]
  beta_u = beta_u[None, None, :, None, None, None, None, None]
  posterior = np.full((batch, num_in, num_out, 1, n, n, k, k), 1 / num_out,
                      wx.dtype)
  center = np.zeros((batch, 1, num_out) + wx.shape[3:6] + (1, 1), wx.dtype)
  for beta in lambdas:
    update, logit, center = _m_and_e_step(
        posterior * activations, wx, center, beta, beta_a, beta_u, min_var,
        (1, 6, 7), 1e-7)
    prior_exp = np.exp(update - _max(update, (4, 5, 6, 7)))
    # The released normaliser: the [n*k, n*k] grid of (position, tap),
    # padded by (k-1)^2, patches of k x k at stride k and rate k - 1 sum
    # every (position, tap) with position + tap = c; then each window reads
    # those sums back at its own positions + taps.
    grid = prior_exp.transpose(0, 1, 2, 3, 4, 6, 5, 7).reshape(
        -1, n * k, n * k, 1)
    pad = (k - 1) * (k - 1)
    grid = np.pad(grid, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    sums = _extract_patches(grid, k, k, k - 1).sum(-1, keepdims=True)
    per_window = _extract_patches(sums, k, 1, 1).reshape(
        batch, num_in, num_out, 1, n, n, k, k) + 1e-7
    posterior = prior_exp / per_window
  return (1 / (1 + np.exp(-logit[:, 0, :, 0, :, :, 0, 0])),
          center[:, 0, :, :, :, :, 0, 0])


def released_conv_votes(poses, weights, stride):
  """poses [B, H, W, C, 4, 4], weights [K, K, C, O, 4, 4] -> wx
  [B, C, O, 16, n, n, K, K]: the child at (h*stride + a, w*stride + b) of
  window (h, w) times W[a, b]."""
  k = weights.shape[0]
  n = (poses.shape[1] - k) // stride + 1
  batch, _, _, types, p, _ = poses.shape
  wx = np.zeros((batch, types, weights.shape[3], p * p, n, n, k, k),
                np.result_type(poses, weights))
  for a in range(k):
    for b in range(k):
      child = poses[:, a:a + stride * (n - 1) + 1:stride,
                    b:b + stride * (n - 1) + 1:stride]  # [B, n, n, C, 4, 4]
      v = np.einsum('bhwcxy,coyz->bcoxzhw', child, weights[a, b])
      wx[..., a, b] = v.reshape(batch, types, -1, p * p, n, n)
  return wx


# ----------------------------------------------------------------------------
# Helpers.


def _lambdas(num_iterations, scale=1.0):
  return routing.inverse_temperature_schedule(num_iterations, 0.01 * scale)


def _directions(rng, *shapes):
  return [rng.standard_normal(shape) for shape in shapes]


def _check(jax_fn, ref_fn, args, seed):
  """Values and gradients of a scalar projection of the outputs.

  jax_fn and ref_fn: args -> (activations, poses) in the same layout.
  """
  rng = np.random.default_rng(seed)
  with jax.enable_x64(True):
    want = ref_fn(*args)
    weights = [rng.standard_normal(np.shape(w)) for w in want]

    def scalar(*xs):
      outs = jax_fn(*xs)
      return (sum(jnp.sum(o * w) for o, w in zip(outs, weights, strict=True)),
              outs)

    # The outputs and the gradients from one compiled program.
    (_, got), grads = jax.jit(jax.value_and_grad(
        scalar, argnums=tuple(range(len(args))), has_aux=True))(
            *[jnp.asarray(a) for a in args])
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), w, rtol=1e-10, atol=1e-13)
  for index, (arg, grad) in enumerate(zip(args, grads, strict=True)):
    for direction in _directions(rng, np.shape(arg), np.shape(arg)):
      perturbed = list(args)
      perturbed[index] = arg + 1j * STEP * direction
      outs = ref_fn(*perturbed)
      derivative = sum(np.sum(o.imag * w) for o, w in zip(outs, weights,
                                                          strict=True)) / STEP
      got_derivative = float(np.sum(np.asarray(grad) * direction))
      np.testing.assert_allclose(got_derivative, derivative, rtol=1e-10,
                                 atol=1e-12 * max(1.0, abs(derivative)))


# ----------------------------------------------------------------------------
# Routing.


@pytest.mark.parametrize('num_in', [8, 288])
@pytest.mark.parametrize('num_iterations', [1, 2, 3])
def test_released_class_routing(num_in, num_iterations):
  rng = np.random.default_rng(num_in + num_iterations)
  num_out, dim = 5, 16
  wx = rng.standard_normal((2, num_in, num_out, dim))
  acts = rng.uniform(0.05, 0.95, (2, num_in))
  beta_a = rng.uniform(0.5, 1.5, num_out)
  beta_u = rng.uniform(1.0, 3.0, num_out)
  # The class layer's final lambda is a quarter of the others'.
  lambdas = _lambdas(num_iterations, 0.25)

  def ours(wx, acts, beta_a, beta_u):
    poses, out_acts, _ = routing.em_routing(
        wx, acts, beta_u, beta_a, num_iterations, inverse_temperature=lambdas,
        em_routing=routing.RELEASED_EM)
    return out_acts, poses

  _check(ours, lambda *a: released_class_routing(*a, lambdas),
         (wx, acts, beta_a, beta_u), seed=num_in)


@pytest.mark.parametrize('stride, true_stride', [(1, False), (2, False),
                                                 (2, True)])
@pytest.mark.parametrize('num_iterations', unit_tier_keeps([1, 2, 3], 1, 3))
def test_released_conv_routing(stride, true_stride, num_iterations):
  rng = np.random.default_rng(10 * stride + num_iterations)
  k, in_types, out_types = 3, 3, 4
  side = 7 if stride == 2 else 5  # a 3x3 output grid either way
  poses = rng.standard_normal((2, side, side, in_types, 4, 4))
  acts = rng.uniform(0.05, 0.95, (2, side, side, in_types))
  weights = 0.5 * rng.standard_normal((k, k, in_types, out_types, 4, 4))
  beta_a = rng.uniform(0.2, 0.8, out_types)
  beta_u = rng.uniform(0.2, 0.8, out_types)
  lambdas = _lambdas(num_iterations)

  def ours(poses, acts, weights, beta_a, beta_u):
    out_poses, out_acts, _ = kernels.conv_capsule_routing(
        poses, acts, weights, beta_u, beta_a, stride=stride,
        num_iterations=num_iterations, inverse_temperature=lambdas,
        true_stride=true_stride, em_routing=routing.RELEASED_EM)
    n = out_poses.shape[1]
    # -> the released layouts [B, O, n, n] and [B, O, 16, n, n].
    return (jnp.moveaxis(out_acts, 3, 1),
            jnp.moveaxis(out_poses.reshape(2, n, n, out_types, 16), (1, 2),
                         (3, 4)))

  def reference(poses, acts, weights, beta_a, beta_u):
    wx = released_conv_votes(poses, weights, stride)
    n = wx.shape[4]
    # Each window's children's activations, [B, C, 1, 1, n, n, K, K].
    a = np.zeros((2, in_types, 1, 1, n, n, k, k), acts.dtype)
    for i in range(k):
      for j in range(k):
        a[:, :, 0, 0, :, :, i, j] = np.moveaxis(
            acts[:, i:i + stride * (n - 1) + 1:stride,
                 j:j + stride * (n - 1) + 1:stride], 3, 1)
    if true_stride:
      return _true_stride_conv_routing(wx, a, beta_a, beta_u, lambdas,
                                       stride)
    return released_conv_routing(wx, a, beta_a, beta_u, lambdas)

  _check(ours, reference, (poses, acts, weights, beta_a, beta_u),
         seed=stride + num_iterations)


def _true_stride_conv_routing(wx, a, beta_a, beta_u, lambdas, stride):
  """The released conv routing with the children indexed at position *
  stride + tap: the normaliser sums each child's (window, tap) entries."""
  batch, num_in, num_out, _, n, _, k, _ = wx.shape
  beta_a = beta_a[None, None, :, None, None, None, None, None]
  beta_u = beta_u[None, None, :, None, None, None, None, None]
  posterior = np.full((batch, num_in, num_out, 1, n, n, k, k), 1 / num_out,
                      wx.dtype)
  center = np.zeros((batch, 1, num_out) + wx.shape[3:6] + (1, 1), wx.dtype)
  size = (n - 1) * stride + k
  for beta in lambdas:
    update, logit, center = _m_and_e_step(
        posterior * a, wx, center, beta, beta_a, beta_u, 5e-4, (1, 6, 7),
        1e-7)
    prior_exp = np.exp(update - _max(update, (4, 5, 6, 7)))
    sums = np.zeros(prior_exp.shape[:4] + (size, size), prior_exp.dtype)
    for h in range(n):
      for w in range(n):
        sums[..., h * stride:h * stride + k, w * stride:w * stride + k] += (
            prior_exp[..., h, w, :, :])
    per_window = np.zeros_like(prior_exp)
    for h in range(n):
      for w in range(n):
        per_window[..., h, w, :, :] = sums[
            ..., h * stride:h * stride + k, w * stride:w * stride + k]
    posterior = prior_exp / (per_window + 1e-7)
  return (1 / (1 + np.exp(-logit[:, 0, :, 0, :, :, 0, 0])),
          center[:, 0, :, :, :, :, 0, 0])


def test_released_conv_assignments_sum_to_the_number_of_parent_types():
  """A child covered by windows gets about one unit per parent type."""
  rng = np.random.default_rng(0)
  normalize = votes_lib.released_conv_normalizer(3, 3, 3, 1, 2)
  # Jitted: one compilation, not one per operation.
  log_r = np.asarray(jax.jit(normalize)(rng.standard_normal((1, 3, 3, 18, 4))))
  r = np.exp(log_r).reshape(1, 3, 3, 3, 3, 2, 4)
  # The centre child (2, 2) of a 5x5 grid is covered by all 9 windows.
  total = sum(r[0, h, w, 2 - h, 2 - w] for h in range(3) for w in range(3))
  np.testing.assert_allclose(total, np.ones((2, 4)), rtol=1e-5)


def test_the_normalizers_max_shares_its_gradient_among_near_ties():
  """The released normaliser differentiates its max (as the released code
  does): the gradient goes to the entries at the max, ties sharing it, as
  jnp.max's does; entries within a few ulps count as ties, so that fused
  code that recomputes them with another rounding cannot leave none (0/0)."""
  rng = np.random.default_rng(2)
  normalize = votes_lib.released_conv_normalizer(3, 3, 3, 1, 2)
  loss = lambda x: jnp.sum(jnp.sin(normalize(x)))  # noqa: E731
  with jax.enable_x64(True):
    for x in (rng.standard_normal((1, 3, 3, 18, 4)),  # one max per group
              np.ones((1, 3, 3, 18, 4))):  # every entry tied
      grad = jax.jit(jax.grad(loss))(x)
      with mock.patch.object(votes_lib, '_max_sharing_ties',
                             lambda x, axis: jnp.max(x, axis, keepdims=True)):
        want = jax.jit(jax.grad(loss))(x)  # jnp.max's own gradient
      np.testing.assert_allclose(grad, want, rtol=1e-12, atol=1e-15)
      assert np.all(np.isfinite(grad))
    top = jax.grad(lambda x: jnp.sum(votes_lib._max_sharing_ties(x, (0,))))  # pylint: disable=protected-access
    near = np.array([1.0, 1.0 - 4 * np.finfo(np.float64).eps, 0.5])
    np.testing.assert_array_equal(top(near), [0.5, 0.5, 0.0])
    np.testing.assert_array_equal(top(np.array([1.0, 0.999, 0.5])), [1, 0, 0])


def test_released_preset_differs_from_the_paper_form():
  rng = np.random.default_rng(1)
  wx = rng.standard_normal((2, 8, 5, 16)).astype(np.float32)
  acts = rng.uniform(0.05, 0.95, (2, 8)).astype(np.float32)
  betas = np.full(5, 0.5, np.float32)
  lambdas = _lambdas(3)
  # Jitted: one compilation per form, not one per operation.
  route = jax.jit(functools.partial(routing.em_routing, num_iterations=3,
                                    inverse_temperature=lambdas),
                  static_argnames='em_routing')
  released = route(wx, acts, betas, betas, em_routing=routing.RELEASED_EM)
  plain = route(wx, acts, betas, betas, em_routing=routing.AUTHORS_EM)
  assert routing.AUTHORS_EM == dataclasses.replace(routing.RELEASED_EM,
                                                   released=False)
  assert np.max(np.abs(np.asarray(released[0]) - np.asarray(plain[0]))) > 1e-6
  with pytest.raises(ValueError, match='released=True only'):
    routing.em_routing(wx, acts, betas, betas, 3, mass_epsilon=1e-7)


def test_released_routing_is_finite_on_degenerate_inputs():
  """All-zero activations and identical votes: finite values and
  gradients."""
  poses = np.ones((1, 5, 5, 2, 4, 4), np.float32)
  acts = np.zeros((1, 5, 5, 2), np.float32)
  weights = np.ones((3, 3, 2, 3, 4, 4), np.float32)
  betas = np.zeros(3, np.float32)

  def loss(poses, acts, weights):
    out_poses, out_acts, _ = kernels.conv_capsule_routing(
        poses, acts, weights, betas, betas, stride=2, num_iterations=3,
        inverse_temperature=_lambdas(3), em_routing=routing.RELEASED_EM)
    return jnp.sum(out_poses) + jnp.sum(out_acts)

  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
      poses, acts, weights)
  assert np.isfinite(value)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))


# ----------------------------------------------------------------------------
# Model details.


def _conv_pos_reference(height, width):
  """simple_model.py's coordinate channels: np.mgrid rows and columns,
  centred and /100, then the two channels swapped by each of conv_pos's
  three calls (an odd number: the column ends on channel 0)."""
  rows, cols = np.mgrid[0:height, 0:width]
  grid = np.stack([(rows - height / 2) / 100, (cols - width / 2) / 100], -1)
  for _ in range(3):
    grid = grid[..., ::-1]
  return grid


def test_released_coordinates_put_the_column_on_entry_zero():
  votes = np.zeros((1, 3, 4, 1, 1, 16))
  rows = np.array([0.1, 0.2, 0.3])
  cols = np.array([1.0, 2.0, 3.0, 4.0])
  # Jitted: one compilation per order, not one per operation.
  coordinate_addition = jax.jit(votes_lib.coordinate_addition,
                                static_argnames='order')
  out = np.asarray(coordinate_addition(votes, rows, cols, order='col_row'))
  np.testing.assert_allclose(out[0, :, :, 0, 0, 0], np.tile(cols, (3, 1)))
  np.testing.assert_allclose(out[0, :, :, 0, 0, 1],
                             np.tile(rows[:, None], (1, 4)))
  assert not out[..., 2:].any()
  # The released channels on an input grid: channel 0 varies along columns.
  grid = _conv_pos_reference(3, 4)
  np.testing.assert_allclose(grid[..., 0], np.tile((np.arange(4) - 2) / 100,
                                                   (3, 1)))
  default = np.asarray(coordinate_addition(votes, rows, cols))
  np.testing.assert_allclose(default[0, :, :, 0, 0, 0],
                             np.tile(rows[:, None], (1, 4)))


def _primary_caps_reference(x, kernel, types, form):
  """primary_caps in its own NCHW layout: a 1x1 convolution by the
  concatenated [pose | activation] kernel, then either (capsule_em from
  2020 on) a split of the channels into the 16T pose channels and the T
  logits, each then reshaped type-major, or (the first release) a reshape
  to [types, 17] and a split of each type's 17 channels into 16 and 1.
  Returns (poses [B, H, W, T, 4, 4], activations [B, H, W, T])."""
  conv = np.transpose(x, (0, 3, 1, 2))  # NHWC -> NCHW
  batch, _, height, width = conv.shape
  caps = np.einsum('bchw,cf->bfhw', conv, kernel)
  if form == 'released':
    center, logit = caps[:, :16 * types], caps[:, 16 * types:]
    center = center.reshape(batch, types, 16, height, width)
    logit = logit.reshape(batch, types, 1, height, width)
  else:
    caps = caps.reshape(batch, types, 17, height, width)
    center, logit = caps[:, :, :16], caps[:, :, 16:]
  activation = 1 / (1 + np.exp(-(logit - 1.0)))
  poses = np.transpose(center, (0, 3, 4, 1, 2)).reshape(
      batch, height, width, types, 4, 4)
  return poses, np.transpose(activation[:, :, 0], (0, 2, 3, 1))


# A layer's call, jitted: one compilation, not one per operation.
_call = nnx.jit(lambda layer, x: layer(x))


@pytest.mark.parametrize('form', ['released', 'released_2019'])
def test_released_primary_capsules(form):
  """primary_caps: one 1x1 kernel, sigmoid(logit - 1), no biases, its
  channels read as the code from 2020 on ('released') or as first released
  ('released_2019'); the kernel drawn as the released concatenation."""
  types = 4
  layer = layers.MatrixPrimaryCapsules(6, types, form=form, rngs=nnx.Rngs(0))
  kernel = np.asarray(layer.kernel[...], np.float64)
  assert kernel.shape == (6, types * 17)
  assert not hasattr(layer, 'pose_bias') and not hasattr(layer, 'activation_bias')
  # The first 4*16 columns std 0.5, the last 4 std 3.0 (truncated at 2 std).
  assert np.abs(kernel[:, :64]).max() <= 1.0 < np.abs(kernel[:, 64:]).max()
  assert np.abs(kernel[:, 64:]).max() <= 6.0
  rng = np.random.default_rng(2)
  x = rng.standard_normal((2, 3, 5, 6))
  kernel = rng.standard_normal((6, types * 17))
  want_poses, want_acts = _primary_caps_reference(x, kernel, types, form)
  with jax.enable_x64(True):
    layer.kernel.set_value(jnp.asarray(kernel))
    poses, acts = _call(layer, jnp.asarray(x))
    assert poses.dtype == acts.dtype == jnp.float64
  np.testing.assert_allclose(np.asarray(poses), want_poses, rtol=1e-12,
                             atol=1e-12)
  np.testing.assert_allclose(np.asarray(acts), want_acts, rtol=1e-12,
                             atol=1e-12)
  # The other layout reads other channels: the test tells them apart.
  other = 'released_2019' if form == 'released' else 'released'
  other_poses, other_acts = _primary_caps_reference(x, kernel, types, other)
  assert np.abs(other_poses - want_poses).max() > 0.1
  assert np.abs(other_acts - want_acts).max() > 0.1


def test_primary_forms_read_the_kernel_columns():
  """Which kernel column feeds which output: 'released' takes type t's
  logit from column 16T + t (the std-3.0 activation kernel),
  'released_2019' from column 17t + 16."""
  types = 3
  x = np.eye(1)[None, None]  # one pixel, one input channel equal to 1
  for form, logit_columns, pose_columns in (
      ('released', [48, 49, 50], [16 * t + np.arange(16) for t in range(3)]),
      ('released_2019', [16, 33, 50],
       [17 * t + np.arange(16) for t in range(3)])):
    layer = layers.MatrixPrimaryCapsules(1, types, form=form,
                                         rngs=nnx.Rngs(0))
    with jax.enable_x64(True):
      # Column j holds j / 100 (small enough that the sigmoid inverts).
      layer.kernel.set_value(
          jnp.asarray(np.arange(types * 17, dtype=np.float64)[None] / 100))
      poses, acts = _call(layer, jnp.asarray(x))
    logits = np.log(np.asarray(acts) / (1 - np.asarray(acts))) + 1
    np.testing.assert_allclose(logits[0, 0, 0] * 100, logit_columns,
                               atol=1e-9)
    for t in range(types):
      np.testing.assert_allclose(
          np.asarray(poses)[0, 0, 0, t].reshape(-1) * 100, pose_columns[t],
          atol=1e-9)
  with pytest.raises(ValueError, match='released_2019'):
    layers.MatrixPrimaryCapsules(1, types, form='released_2020',
                                 rngs=nnx.Rngs(0))


def _mean_pool_reference(grid, kernel_size, stride):
  """add_convs' averaging: a VALID kernel_size x kernel_size mean."""
  height = (grid.shape[0] - kernel_size) // stride + 1
  width = (grid.shape[1] - kernel_size) // stride + 1
  out = np.zeros((height, width) + grid.shape[2:])
  for i in range(height):
    for j in range(width):
      out[i, j] = grid[i * stride:i * stride + kernel_size,
                       j * stride:j * stride + kernel_size].mean((0, 1))
  return out


def test_released_coordinate_form_adds_the_authors_pixel_centres(
    monkeypatch):
  """A model with coordinate_form='released' adds to its class votes the
  released code's receptive-field centres (conv_pos's channels averaged
  over every layer's window), column on entry 0 and row on entry 1, not
  the grid's (h + 0.5) / H. Zero class transforms leave only the added
  coordinates in the votes, caught on their way into the routing."""
  model = models.create_model(
      'matrix_capsnet', rngs=nnx.Rngs(0), input_shape=(32, 40, 1), A=4, B=2,
      C=2, D=2, num_classes=3, primary_form='released',
      coordinate_form='released')
  model.class_caps.weights.set_value(
      jnp.zeros_like(model.class_caps.weights[...]))
  seen = []
  em_routing = routing.em_routing

  def spy(votes, *args, **kwargs):
    seen.append(votes)
    return em_routing(votes, *args, **kwargs)

  monkeypatch.setattr(routing.em, 'em_routing', spy)

  # Jitted (one compilation, not one per operation): the class layer's
  # votes, the last routed, come out of the compiled forward.
  def class_votes(model, images):
    model(images)
    return seen[-1]

  votes = np.asarray(nnx.jit(class_votes)(
      model, np.random.default_rng(0).uniform(size=(2, 32, 40, 1)).astype(
          np.float32)))
  votes = votes.reshape(2, 4, 6, 2, 3, 16)  # rows, cols, types, classes
  want = _conv_pos_reference(32, 40)
  for kernel_size, stride in ((5, 2), (3, 2), (3, 1)):
    want = _mean_pool_reference(want, kernel_size, stride)
  assert want.shape == (4, 6, 2)
  expected = np.broadcast_to(want[None, :, :, None, None, :],
                             (2, 4, 6, 2, 3, 2))
  np.testing.assert_allclose(votes[..., :2], expected, rtol=1e-6, atol=1e-7)
  assert not votes[..., 2:].any()
  # Position (h, w) sees input pixels centred on (4h + 8, 4w + 8): entry 0
  # (4w + 8 - 40/2) / 100 along the columns, entry 1 (4h + 8 - 32/2) / 100.
  np.testing.assert_allclose(want[..., 0], np.tile(
      (4 * np.arange(6) - 12) / 100, (4, 1)), atol=1e-12)
  np.testing.assert_allclose(want[..., 1], np.tile(
      (4 * np.arange(4)[:, None] - 8) / 100, (1, 6)), atol=1e-12)
  # The grid's centres would have failed the comparison above.
  rows, cols = (np.arange(4) + 0.5) / 4, (np.arange(6) + 0.5) / 6
  assert np.abs(votes[0, :, :, 0, 0, 0] - cols[None, :]).max() > 0.1
  assert np.abs(votes[0, :, :, 0, 0, 1] - rows[:, None]).max() > 0.1


def test_released_model_options():
  model = models.create_model(
      'matrix_capsnet', rngs=nnx.Rngs(0), A=8, B=4, C=4, D=4, init='authors',
      primary_form='released', em_routing='released',
      coordinate_form='released')
  assert model.caps1.em_routing.released
  assert model.class_caps.em_routing.released
  assert model.caps2.em_routing == routing.RELEASED_EM
  assert model.class_caps.coordinate_order == 'col_row'
  np.testing.assert_array_equal(np.asarray(model.conv1.bias[...]),
                                np.float32(0.1))
  conv1 = np.asarray(model.conv1.kernel[...])
  assert np.abs(conv1).max() <= 0.1
  transforms = np.asarray(model.caps1.weights[...])
  assert np.abs(transforms).max() <= 0.6  # truncated at 2 x 0.3
  out = nnx.jit(lambda m, x: m(x))(model, np.zeros((2, 32, 32, 1),
                                                   np.float32))
  assert np.all(np.isfinite(np.asarray(out['class_scores'])))
  with pytest.raises(ValueError, match='released=True only'):
    models.create_model('matrix_capsnet', rngs=nnx.Rngs(0), A=8, B=4, C=4,
                        D=4, em_routing_overrides={'true_stride': True})
  # Options of configs written before em_routing: the same model.
  flat = models.create_model(
      'matrix_capsnet', rngs=nnx.Rngs(0), A=8, B=4, C=4, D=4, init='authors',
      primary_form='released', released_routing=True,
      coordinate_form='released', activation_form='authors',
      center_momentum=0.1, variance_epsilon=5e-4)
  assert flat.caps2.em_routing == routing.RELEASED_EM
