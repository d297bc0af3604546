"""Tests for capsjax.layers: shapes, and values against slow references."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from capsjax import kernels
from capsjax import layers
from capsjax import nn
from capsjax import routing
from capsjax.kernels.conv import lowerings
from capsjax.kernels.conv import onednn
from capsjax.routing import matrix_capsules
from tests.helpers import assert_equals_direct
from tests.helpers import conv_reference
from tests.helpers import direct_reference
from tests.helpers import jit_output_and_grads
from tests.helpers import random_normal


@pytest.mark.parametrize('kernel_size,stride,height,width', [
    # CapsNet conv1: the slow tier's (a third of the test's time; stride 1
    # and kernel 9 are each in the unit tier below).
    pytest.param(9, 1, 28, 28, marks=pytest.mark.slow),
    (3, 1, 7, 9),  # Su's trunk
    (1, 1, 4, 5),  # a 1x1 kernel: no patches to concatenate
    (9, 2, 20, 20),  # PrimaryCaps
    (4, 2, 10, 9),  # even kernel, odd width
    (5, 2, 13, 14),  # odd and even sizes
    (5, 3, 11, 13),  # stride 3, K not a multiple of it
    (2, 3, 8, 7),  # kernel smaller than the stride
    (3, 3, 3, 5),  # kernel = input height
])
@pytest.mark.parametrize('impl', ['space_to_depth', 'patches', 'narrow',
                                  'taps'])
def test_cpu_convs_equal_direct_in_values_and_gradients(
    impl, kernel_size, stride, height, width):
  x = random_normal(0, (2, height, width, 3))
  kernel = random_normal(1, (kernel_size, kernel_size, 3, 4), 0.2)
  out_shape = (2, (height - kernel_size) // stride + 1,
               (width - kernel_size) // stride + 1, 4)
  cotangent = random_normal(2, out_shape)
  out = assert_equals_direct(
      lambda x, k: lowerings.conv2d(x, k, stride, lowering=impl),
      direct_reference(stride), x, kernel, cotangent)
  chex.assert_shape(out, out_shape)


def test_unfused_is_the_identity():
  """The fusion boundary of the kernel gradients returns its input, on
  either branch (a NaN token takes the second)."""
  x = random_normal(0, (2, 3, 4))
  for key in ([1.0], [np.nan, 1.0], []):  # an empty key: an empty batch
    np.testing.assert_array_equal(
        jax.jit(lowerings._unfused)(x, jnp.asarray(key, jnp.float32)), x)  # pylint: disable=protected-access


@pytest.mark.parametrize('impl,stride', [('space_to_depth', 1),
                                         ('taps', 2)])
def test_conv2d_gradients_of_an_empty_batch(impl, stride):
  """The fusion boundary of the kernel gradient is keyed on an array that
  may be empty; the gradients then are those of XLA's convolution."""
  x, kernel = jnp.zeros((0, 8, 8, 4)), random_normal(1, (3, 3, 4, 2))
  grads = jax.jit(jax.grad(
      lambda x, k: lowerings.conv2d(x, k, stride, lowering=impl).sum(),
      argnums=(0, 1)))(x, kernel)
  chex.assert_shape(grads, [(0, 8, 8, 4), (3, 3, 4, 2)])
  np.testing.assert_array_equal(grads[1], 0.0)


def test_patches_conv_is_the_convolution_sum():
  """patches_conv against the definition, in float64 NumPy: y[b, i, j, f] =
  sum_{u, v, c} x[b, i + u, j + v, c] k[u, v, c, f]."""
  x = np.asarray(random_normal(0, (2, 6, 7, 3)), np.float64)
  kernel = np.asarray(random_normal(1, (3, 2, 3, 5)), np.float64)
  ref, _, _ = conv_reference(x, kernel, np.zeros((2, 4, 6, 5)))
  out = jax.jit(lowerings.patches_conv)(x.astype(np.float32),
                                        kernel.astype(np.float32))
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_narrow_conv_kernel_gradient_is_the_correlation_sum():
  """narrow_conv's kernel gradient (one product over channel-major patches)
  against its definition in float64 NumPy: dk[u, v, c, f] =
  sum_{b, i, j} x[b, i + u, j + v, c] dy[b, i, j, f]; a non-square kernel
  and two channels, so a wrong window order or channel interleave shows."""
  x = np.asarray(random_normal(0, (3, 7, 6, 2)), np.float64)
  cotangent = np.asarray(random_normal(2, (3, 5, 3, 4)), np.float64)
  kernel = jnp.zeros((3, 4, 2, 4), jnp.float32)
  _, _, ref = conv_reference(x, kernel, cotangent)
  _, (_, grad) = jit_output_and_grads(lowerings.narrow_conv,
                                      x.astype(np.float32), kernel,
                                      cotangent.astype(np.float32))
  np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('kernel_size,stride,height,width', [
    (9, 2, 20, 20),  # PrimaryCaps
    (4, 3, 12, 11),  # K not a multiple of s; rows past the windows' reach
    (2, 3, 8, 7),  # kernel smaller than the stride: input rows no tap meets
    (3, 1, 6, 5),  # stride 1
])
def test_taps_input_gradient_is_the_transposed_sum(kernel_size, stride,
                                                   height, width):
  """The input gradient of taps_conv against its definition in float64
  NumPy: dx[b, s*y + i, s*x + j, c] += sum_f dy[b, y, x, f] k[i, j, c, f];
  input positions that no window covers get 0."""
  kernel = np.asarray(random_normal(1, (kernel_size, kernel_size, 3, 5)), np.float64)
  out_h = (height - kernel_size) // stride + 1
  out_w = (width - kernel_size) // stride + 1
  cotangent = np.asarray(random_normal(2, (2, out_h, out_w, 5)), np.float64)
  _, ref, _ = conv_reference(np.zeros((2, height, width, 3)), kernel,
                              cotangent, stride)
  x = np.zeros((2, height, width, 3), np.float32)
  _, (grad, _) = jit_output_and_grads(
      functools.partial(lowerings.taps_conv, stride=stride), x,
      kernel.astype(np.float32), cotangent.astype(np.float32))
  np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('impl', lowerings.LOWERINGS)
@pytest.mark.parametrize('padding', ['VALID', 'SAME'])
@pytest.mark.parametrize('stride', [1, 2])
def test_conv2d_impls_and_padding(impl, padding, stride):
  x = random_normal(0, (2, 11, 10, 3))
  kernel = random_normal(1, (5, 5, 3, 4), 0.2)
  cotangent = random_normal(
      2, jax.eval_shape(direct_reference(stride, padding), x, kernel).shape)
  if impl.startswith('onednn') and not onednn.available():
    with pytest.raises(ValueError, match=f"lowering='{impl}': oneDNN is"):
      lowerings.conv2d(x, kernel, stride, padding, impl)
    return
  assert_equals_direct(
      lambda x, k: lowerings.conv2d(x, k, stride, padding, impl),
      direct_reference(stride, padding), x, kernel, cotangent)


@jax.jit
def _pool_and_grad(x, cotangent):
  out, vjp = jax.vjp(nn.average_pool_2x2, x)
  return out, vjp(cotangent)


@pytest.mark.parametrize('height,width', [(24, 24), (7, 10), (5, 4)])
def test_average_pool_2x2_is_keras_average_pooling(height, width):
  """Against float64 NumPy: y[b, i, j] = mean of x[b, 2i:2i+2, 2j:2j+2],
  an odd last row or column dropped (Keras' floor); its gradient puts a
  quarter of the cotangent on each of the four inputs and 0 on the
  dropped ones."""
  x = np.asarray(random_normal(0, (2, height, width, 3)), np.float64)
  h, w = height // 2, width // 2
  ref = np.zeros((2, h, w, 3))
  for i in range(h):
    for j in range(w):
      ref[:, i, j] = x[:, 2 * i:2 * i + 2, 2 * j:2 * j + 2].mean(axis=(1, 2))
  cotangent = np.asarray(random_normal(1, (2, h, w, 3)), np.float64)
  grad_ref = np.zeros_like(x)
  grad_ref[:, :2 * h, :2 * w] = 0.25 * np.repeat(
      np.repeat(cotangent, 2, axis=1), 2, axis=2)
  out, (grad,) = _pool_and_grad(x.astype(np.float32),
                                cotangent.astype(np.float32))
  chex.assert_shape(out, (2, h, w, 3))
  np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(grad, grad_ref, rtol=1e-6, atol=1e-6)
  # bfloat16 in, bfloat16 out, summed in float32: within bfloat16's
  # rounding of the float64 mean.
  low = jax.jit(nn.average_pool_2x2)(jnp.asarray(x, jnp.bfloat16))
  assert low.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(low, np.float64),
                             ref, rtol=1e-2, atol=1e-2)


def np_fused_batch_norm(x, scale, offset, mean, var, train, momentum=0.99,
                        epsilon=1e-3):
  """float64, from TensorFlow's FusedBatchNorm CPU kernel (training: the
  batch mean and variance over rest_size = B*H*W values per channel; the
  running variance takes the variance times rest_size / (rest_size - 1),
  or / 1 when rest_size is 1; inference: the given statistics)."""
  x = np.asarray(x, np.float64)
  if train:
    rest = x.reshape(-1, x.shape[-1])
    m = rest.sum(0) / len(rest)
    v = ((rest - m) ** 2).sum(0) / len(rest)
    adjust = len(rest) / max(len(rest) - 1, 1)
    factor = 1 - momentum
    new_mean = (1 - factor) * mean + factor * m
    new_var = (1 - factor) * var + factor * adjust * v
  else:
    m, v, new_mean, new_var = mean, var, mean, var
  y = (x - m) / np.sqrt(v + epsilon) * scale + offset
  return y, new_mean, new_var


@pytest.mark.parametrize('shape', [(2, 3, 3, 4), (1, 1, 1, 4)])
def test_batch_norm_is_tf_fused_kernel(shape):
  """Values, running averages and dtypes against the float64 reference;
  finite gradients also for one value per channel (zero batch variance)."""
  rng = np.random.default_rng(0)
  x = 2.0 + 3.0 * rng.standard_normal(shape)
  c = shape[-1]
  stats = (1 + 0.3 * rng.standard_normal(c), 0.2 * rng.standard_normal(c),
           0.5 * rng.standard_normal(c), rng.uniform(0.5, 2.0, c))
  with jax.enable_x64(True):
    args = tuple(map(jnp.asarray, stats))
    for train in (True, False):
      out = jax.jit(functools.partial(nn.batch_norm, train=train,
                                      momentum=0.99, epsilon=1e-3))(
                                          jnp.asarray(x), *args)
      ref = np_fused_batch_norm(x, *stats, train)
      for got, want in zip(out, ref, strict=True):
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # Jitted, as below: one compilation, not one per operation.
    grad = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(nn.batch_norm(
        x, *args, train=True, momentum=0.99, epsilon=1e-3)[0]))))(
            jnp.asarray(x))
    assert np.all(np.isfinite(grad))
    if shape[0] > 1:
      check_grads(jax.jit(lambda x: nn.batch_norm(
          x, *args, train=True, momentum=0.99, epsilon=1e-3)[0]),
                  (jnp.asarray(x),), order=1, modes=['rev'])
      # Not vacuous: flax's running variance (the biased batch variance)
      # is over 1e-3 away on these values.
      biased = 0.99 * stats[3] + 0.01 * x.reshape(-1, c).var(0)
      train_ref = np_fused_batch_norm(x, *stats, True)
      assert np.min(np.abs(train_ref[2] - biased)) > 1e-3
  # A bfloat16 input with float32 statistics: normalised in float32.
  low = jnp.asarray(x, jnp.bfloat16)
  y, mean, var = jax.jit(functools.partial(
      nn.batch_norm, train=True, momentum=0.99, epsilon=1e-3))(
          low, *(jnp.asarray(a, jnp.float32) for a in stats))
  assert y.dtype == mean.dtype == var.dtype == jnp.float32
  ref = np_fused_batch_norm(np.asarray(low, np.float64), *stats, True)
  for got, want in zip((y, mean, var), ref, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_batch_norm_module_updates_its_statistics_only_in_training():
  norm = layers.BatchNorm(3, momentum=0.9, epsilon=1e-3)
  flax_norm = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
  # flax's names: a checkpoint of nnx.BatchNorm loads.
  assert (jax.tree.structure(nnx.to_pure_dict(nnx.state(norm))) ==
          jax.tree.structure(nnx.to_pure_dict(nnx.state(flax_norm))))
  x = random_normal(0, (4, 2, 2, 3))
  # Jitted: one compilation per mode, the statistics' update carried out.
  call = nnx.jit(lambda norm, x, train: norm(x, train=train),
                 static_argnames='train')
  call(norm, x, train=False)
  np.testing.assert_array_equal(norm.var[...], 1.0)
  y = call(norm, x, train=True)
  ref = np_fused_batch_norm(x, np.ones(3), np.zeros(3), np.zeros(3),
                            np.ones(3), True, momentum=0.9)
  np.testing.assert_allclose(y, ref[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(norm.mean[...], ref[1], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(norm.var[...], ref[2], rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match='momentum'):
    layers.BatchNorm(3, momentum=1.0)
  with pytest.raises(ValueError, match='epsilon'):
    layers.BatchNorm(3, epsilon=0.0)


def test_conv2d_rejects_bad_arguments():
  x, kernel = jnp.zeros((1, 8, 8, 3)), jnp.zeros((3, 3, 3, 2))
  with pytest.raises(ValueError, match='lowering'):
    lowerings.conv2d(x, kernel, 2, lowering='fft')
  with pytest.raises(ValueError, match="conv2d's implementations"):
    kernels.conv2d(x, kernel, 2, implementation='pallas')
  with pytest.raises(ValueError, match='padding'):
    lowerings.conv2d(x, kernel, 2, padding='FULL')
  with pytest.raises(ValueError, match='kernel'):
    lowerings.conv2d(x, jnp.zeros((3, 3, 2, 2)), 2)
  with pytest.raises(ValueError, match='larger than the input'):
    lowerings.space_to_depth_conv(x, jnp.zeros((9, 9, 3, 2)), 2)
  with pytest.raises(ValueError, match='larger than the input'):
    lowerings.patches_conv(x, jnp.zeros((9, 9, 3, 2)))
  with pytest.raises(ValueError, match='larger than the input'):
    lowerings.taps_conv(x, jnp.zeros((9, 9, 3, 2)), 2)
  with pytest.raises(ValueError, match='implementation'):
    layers.Conv2D(3, 4, 3, 2, implementation='pallas', rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='positive'):
    layers.Conv2D(3, -4, 3, rngs=nnx.Rngs(0))


def test_conv2d_module_shapes_and_bias():
  dims = chex.Dimensions(B=2, H=13, W=11, C=3, F=5, P=6, Q=5)
  conv = layers.Conv2D(dims.C, dims.F, 3, 2, bias_init=0.5, rngs=nnx.Rngs(0))
  x = random_normal(0, dims['BHWC'])
  out = jax.jit(conv.__call__)(x)
  chex.assert_shape(out, dims['BPQF'])
  np.testing.assert_allclose(
      out, jax.jit(direct_reference(2))(x, conv.kernel[...]) + 0.5, rtol=1e-5,
      atol=1e-5)
  assert conv.output_size(13) == 6 and conv.output_size(11) == 5


@jax.jit
def _add_bias_and_grads(y, bias, cotangent):
  out, vjp = jax.vjp(nn.add_bias, y, bias)
  return out, vjp(cotangent)


def test_bias_gradient_sums_in_float32_for_bfloat16():
  """A bfloat16 bias's gradient is the float64 sum of the cotangent over
  the batch and positions up to one bfloat16 rounding; summed in bfloat16
  (autodiff on XLA:CPU) it drifts by several percent at this size."""
  rng = np.random.default_rng(0)
  dy64 = rng.standard_normal((32, 16, 16, 8))
  dy = jnp.asarray(dy64, jnp.bfloat16)
  expected = np.asarray(dy, np.float64).sum((0, 1, 2))
  y = jnp.zeros(dy.shape, jnp.bfloat16)
  for bias_dtype in (jnp.bfloat16, jnp.float32):
    bias = jnp.zeros((8,), bias_dtype)
    out, (dy_out, dbias) = _add_bias_and_grads(y, bias, dy)
    assert out.dtype == jnp.bfloat16 and dbias.dtype == bias_dtype
    np.testing.assert_array_equal(dy_out, dy)
    np.testing.assert_allclose(np.asarray(dbias, np.float64), expected,
                               rtol=2.0 ** -8)
  # Through the convolution layer in the mixed-precision way: bfloat16
  # copies of the float32 parameters, gradient back in float32.
  graphdef, params = nnx.split(layers.Conv2D(3, 8, 3, rngs=nnx.Rngs(0)))
  x = random_normal(1, (32, 18, 18, 3)).astype(jnp.bfloat16)

  def loss(params):
    conv = nnx.merge(graphdef, jax.tree.map(
        lambda p: p.astype(jnp.bfloat16), params))
    return jnp.sum(conv(x).astype(jnp.float32) * dy64.astype(np.float32))

  grads = jax.jit(jax.grad(loss))(params)
  assert grads['bias'][...].dtype == jnp.float32
  # The cotangent reaches the bfloat16 output rounded: ``expected``.
  np.testing.assert_allclose(grads['bias'][...], expected, rtol=2.0 ** -8)
  # float32 is plain addition, its gradient autodiff's own float32 sum.
  y32, dy32 = np.zeros((4, 3, 2), np.float32), np.asarray(
      dy64[:4, :3, :2, 0], np.float32)
  bias32 = np.asarray([1.0, -2.0], np.float32)
  out32, (_, dbias32) = _add_bias_and_grads(y32, bias32, dy32)
  np.testing.assert_array_equal(out32, np.broadcast_to(bias32, (4, 3, 2)))
  np.testing.assert_allclose(dbias32, dy64[:4, :3, :2, 0].sum((0, 1)),
                             rtol=1e-6)


# ----------------------------------------------------------------------------
# Vector capsules.


def test_primary_capsules_shapes_and_values():
  dims = chex.Dimensions(B=2, H=12, W=12, C=6, T=4, D=8)
  layer = layers.PrimaryCapsules(dims.C, dims.T, dims.D, kernel_size=5,
                                 stride=2, rngs=nnx.Rngs(0))
  x = random_normal(0, dims['BHWC'])
  out = jax.jit(layer.__call__)(x)
  grid = (12 - 5) // 2 + 1  # 4
  chex.assert_shape(out, (dims.B, grid * grid * dims.T, dims.D))
  assert layer.num_capsules(12, 12) == grid * grid * dims.T
  conv = (np.asarray(jax.jit(direct_reference(2))(x, layer.conv.kernel[...]))
          + np.asarray(layer.conv.bias[...]).reshape(1, 1, 1, -1))
  s = conv.reshape(dims.B, grid, grid, dims.T, dims.D).reshape(dims.B, -1,
                                                               dims.D)
  norm2 = np.sum(s**2, -1, keepdims=True)
  expected = norm2 / (1 + norm2) * s / np.sqrt(norm2)
  np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-6)
  assert np.all(np.linalg.norm(out, axis=-1) < 1.0)


@pytest.mark.parametrize('options', [
    {},
    {'accumulate': False, 'squash_constant': 0.5, 'leaky': True,
     'use_bias': False},
    # Su's later routing with unshared weights.
    {'accumulate': False, 'squash_constant': 0.5, 'normalize_agreement': True,
     'use_bias': False},
])
def test_dense_capsules_match_einsum_reference(options):
  dims = chex.Dimensions(B=3, I=12, O=5, E=8, D=6)
  layer = layers.DenseCapsules(dims.I, dims.E, dims.O, dims.D, 3,
                               rngs=nnx.Rngs(1), **options)
  chex.assert_shape(layer.weights[...], dims['IOED'])
  u = np.asarray(random_normal(0, dims['BIE'], 0.5))
  outputs, coupling = jax.jit(layer.__call__)(u)
  chex.assert_shape(outputs, dims['BOD'])
  chex.assert_shape(coupling, dims['BIO'])
  u_hat = np.einsum('bie,ioed->biod', u, np.asarray(layer.weights[...]))
  bias = None if layer.bias is None else np.asarray(layer.bias[...])
  ref_out, ref_coupling = jax.jit(functools.partial(
      routing.dynamic_routing, num_iterations=3,
      accumulate=options.get('accumulate', True),
      leaky=options.get('leaky', False),
      squash_constant=options.get('squash_constant', 1.0),
      normalize_agreement=options.get('normalize_agreement', False)))(
          u_hat, bias=bias)
  np.testing.assert_allclose(outputs, ref_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(coupling, ref_coupling, rtol=1e-5, atol=1e-6)
  if layer.bias is not None:
    np.testing.assert_allclose(layer.bias[...], 0.1)  # The official init.


def test_shared_capsules_match_einsum_reference_for_any_input_count():
  dims = chex.Dimensions(B=2, O=10, E=16, D=4)
  layer = layers.SharedCapsules(dims.E, dims.O, dims.D, 3, accumulate=False,
                                squash_constant=0.5, rngs=nnx.Rngs(2))
  chex.assert_shape(layer.weights[...], dims['OED'])
  for num_in in (7, 30):
    u = np.asarray(random_normal(num_in, (dims.B, num_in, dims.E)))
    outputs, coupling = jax.jit(layer.__call__)(u)
    chex.assert_shape(outputs, dims['BOD'])
    chex.assert_shape(coupling, (dims.B, num_in, dims.O))
    u_hat = np.einsum('bie,oed->biod', u, np.asarray(layer.weights[...]))
    ref_out, ref_coupling = jax.jit(functools.partial(
        routing.dynamic_routing, num_iterations=3, accumulate=False,
        squash_constant=0.5))(u_hat)
    np.testing.assert_allclose(outputs, ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(coupling, ref_coupling, rtol=1e-5, atol=1e-6)
  assert layer.bias is None


def test_vector_capsule_layers_validate_arguments():
  with pytest.raises(ValueError, match='num_iterations'):
    layers.DenseCapsules(4, 8, 2, 16, 0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='out_caps'):
    layers.SharedCapsules(8, -1, 16, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='vector_votes'):
    layers.DenseCapsules(4, 8, 2, 16, rngs=nnx.Rngs(0))(jnp.zeros((1, 5, 8)))


# ----------------------------------------------------------------------------
# Matrix capsules.


def test_matrix_primary_capsules_shapes_and_values():
  dims = chex.Dimensions(B=2, H=5, W=4, C=6, T=3, P=4)
  layer = layers.MatrixPrimaryCapsules(dims.C, dims.T, rngs=nnx.Rngs(0))
  x = np.asarray(random_normal(0, dims['BHWC']))
  poses, acts = jax.jit(layer.__call__)(x)
  chex.assert_shape(poses, dims['BHWTPP'])
  chex.assert_shape(acts, dims['BHWT'])
  ref_poses = (x @ np.asarray(layer.pose_kernel[...])
               + np.asarray(layer.pose_bias[...]))
  np.testing.assert_allclose(poses, ref_poses.reshape(dims['BHWTPP']),
                             rtol=1e-5, atol=1e-5)
  logits = (x @ np.asarray(layer.activation_kernel[...])
            + np.asarray(layer.activation_bias[...]))
  np.testing.assert_allclose(acts, 1 / (1 + np.exp(-logits)), rtol=1e-5,
                             atol=1e-6)


def _conv_caps_inputs(dims, seed=0):
  poses = random_normal(seed, dims['BHWCPP'])
  acts = 1.0 / (1.0 + np.exp(-random_normal(seed + 1, dims['BHWC'], 2.0)))
  return poses, acts


_EM_OPTIONS = [
    {},
    {'center_momentum': 0.1, 'variance_epsilon': 5e-4, 'normalize_cost': True,
     'activation_form': 'authors', 'inverse_temperature': (0.5, 1.0, 2.0)},
]


@pytest.mark.parametrize('options', _EM_OPTIONS)
def test_conv_capsules_match_loop_over_windows(options):
  kernel_size, stride = 3, 2
  dims = chex.Dimensions(B=2, H=7, W=5, C=2, O=3, P=4, Q=3, R=2)
  layer = layers.ConvCapsules(dims.C, dims.O, kernel_size, stride,
                              beta_u_init=0.2, beta_a_init=-0.1,
                              em_routing=routing.EMRouting(**options),
                              rngs=nnx.Rngs(3))
  poses, acts = _conv_caps_inputs(dims)
  out_poses, out_acts = jax.jit(layer.__call__)(poses, acts)
  chex.assert_shape(out_poses, dims['BQROPP'])
  chex.assert_shape(out_acts, dims['BQRO'])
  weights = np.asarray(layer.weights[...])  # [K, K, C, O, P, P]
  poses_np, acts_np = np.asarray(poses), np.asarray(acts)
  reference = jax.jit(functools.partial(routing.em_routing, num_iterations=3,
                                        **options))
  for row in range(dims.Q):
    for col in range(dims.R):
      rows = slice(row * stride, row * stride + kernel_size)
      cols = slice(col * stride, col * stride + kernel_size)
      window = poses_np[:, rows, cols]  # [B, K, K, C, P, P]
      v = np.einsum('bklcpq,klcoqr->bklcopr', window, weights)
      v = v.reshape(dims.B, -1, dims.O, dims.P * dims.P)
      a = acts_np[:, rows, cols].reshape(dims.B, -1)
      ref_poses, ref_acts, _ = reference(v, a, layer.beta_u[...],
                                         layer.beta_a[...])
      np.testing.assert_allclose(
          out_poses[:, row, col].reshape(dims.B, dims.O, -1), ref_poses,
          rtol=1e-4, atol=1e-5)
      np.testing.assert_allclose(out_acts[:, row, col], ref_acts, rtol=1e-4,
                                 atol=1e-6)


def _child_totals(assignments, height, width, kernel_size, stride, num_types):
  """Sum of R over every (window, parent) that each child votes in."""
  a = np.asarray(assignments).sum(-1)  # [B, H', W', I]
  batch, out_h, out_w, _ = a.shape
  a = a.reshape(batch, out_h, out_w, kernel_size, kernel_size, num_types)
  totals = np.zeros((batch, height, width, num_types))
  for row in range(out_h):
    for col in range(out_w):
      totals[:, row * stride:row * stride + kernel_size,
             col * stride:col * stride + kernel_size] += a[:, row, col]
  return totals


def test_conv_capsules_normalize_across_positions():
  kernel_size, stride = 3, 1
  dims = chex.Dimensions(B=2, H=5, W=6, C=2, O=3, P=4)
  layer = layers.ConvCapsules(
      dims.C, dims.O, kernel_size, stride,
      em_routing=routing.EMRouting(normalize_across_positions=True),
      rngs=nnx.Rngs(4))
  poses, acts = _conv_caps_inputs(dims)
  params = (layer.weights[...], layer.beta_u[...], layer.beta_a[...])
  out = jax.jit(lambda p, a: layer(p, a))(poses, acts)
  chex.assert_shape(out[0], (dims.B, 3, 4, dims.O, 4, 4))
  route = jax.jit(matrix_capsules.conv_capsule_routing,
                  static_argnames=('stride', 'normalize_across_positions'))
  _, _, assignments = route(poses, acts, *params, stride=stride,
                            normalize_across_positions=True)
  chex.assert_shape(assignments, (dims.B, 3, 4, 9 * dims.C, dims.O))
  # Each child's assignments sum to 1 over every parent of every window that
  # covers it (here every child is covered), not to 1 within each window.
  totals = _child_totals(assignments, dims.H, dims.W, kernel_size, stride,
                         dims.C)
  np.testing.assert_allclose(totals, 1.0, rtol=1e-5)
  # A child covered by several windows splits itself among them.
  per_window = np.asarray(assignments).sum(-1)
  assert np.min(per_window) < 0.5


def test_conv_capsules_across_positions_equals_local_without_overlap():
  # With stride = K every child is in exactly one window, so normalising over
  # all its parents is normalising within its window.
  dims = chex.Dimensions(B=2, H=4, W=6, C=2, O=3, P=4)
  poses, acts = _conv_caps_inputs(dims, seed=5)
  layer = layers.ConvCapsules(dims.C, dims.O, 2, 2, rngs=nnx.Rngs(5))
  params = (layer.weights[...], layer.beta_u[...], layer.beta_a[...])
  route = jax.jit(matrix_capsules.conv_capsule_routing,
                  static_argnames=('stride', 'normalize_across_positions'))
  local = route(poses, acts, *params, stride=2,
                normalize_across_positions=False)
  across = route(poses, acts, *params, stride=2,
                 normalize_across_positions=True)
  # Different float32 summation orders: absolute tolerance for tiny values.
  for a, b in zip(local, across, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5)


def test_conv_capsules_remat_and_bfloat16_votes():
  dims = chex.Dimensions(B=2, H=5, W=5, C=2, O=3, P=4)
  poses, acts = _conv_caps_inputs(dims, seed=6)
  plain = layers.ConvCapsules(dims.C, dims.O, 3, 2, rngs=nnx.Rngs(6))
  remat = layers.ConvCapsules(dims.C, dims.O, 3, 2, remat=True,
                              rngs=nnx.Rngs(6))
  half = layers.ConvCapsules(dims.C, dims.O, 3, 2, votes_dtype=jnp.bfloat16,
                             rngs=nnx.Rngs(6))

  @nnx.jit
  @functools.partial(nnx.value_and_grad, argnums=(0, 1), has_aux=True)
  def loss_and_grads(conv, poses, acts):
    out_poses, out_acts = conv(poses, acts)
    return jnp.sum(out_poses * out_acts[..., None, None]), (out_poses,
                                                             out_acts)

  (value, (out_p, out_a)), (grads, grad_poses) = loss_and_grads(
      plain, poses, acts)
  (value_r, _), (grads_r, grad_poses_r) = loss_and_grads(remat, poses, acts)
  np.testing.assert_allclose(value, value_r, rtol=1e-5)
  np.testing.assert_allclose(grad_poses, grad_poses_r, rtol=1e-4, atol=1e-6)
  for name in ('weights', 'beta_u', 'beta_a'):
    np.testing.assert_allclose(grads[name][...], grads_r[name][...],
                               rtol=1e-4, atol=1e-6)
  # No NaN for all-zero activations and identical poses (the same program).
  (value_0, _), (grads_0, grad_poses_0) = loss_and_grads(
      plain, np.ones_like(poses), np.zeros_like(acts))
  assert np.isfinite(value_0) and np.all(np.isfinite(grad_poses_0))
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads_0))
  # bfloat16 votes: float32 outputs close to the float32 layer's.
  half_p, half_a = nnx.jit(lambda conv: conv(poses, acts))(half)
  assert half_p.dtype == jnp.float32 and half_a.dtype == jnp.float32
  # Measured: 0.0019 (activations) and 0.025 absolute (poses up to 2.1; the
  # votes are rounded on the scale of the largest) from float32.
  np.testing.assert_allclose(half_a, out_a, atol=2.0**-7)
  np.testing.assert_allclose(half_p, out_p, rtol=2.0**-6, atol=2.0**-5)


_NORMALIZERS = {'window': {}, 'across': {'normalize_across_positions': True},
                'released': {'em_routing': routing.RELEASED_EM}}


# normaliser -> window chunks; the first is also checked against finite
# differences (the others' gradients equal the whole layer's, so they would
# repeat that check).
@pytest.mark.parametrize('normalizer,chunks', [
    ('window', (4, 13)),
    pytest.param('window', (1,), marks=pytest.mark.slow),
    pytest.param('across', (1,), marks=pytest.mark.slow),
    pytest.param('released', (6, 13), marks=pytest.mark.slow)])
def test_conv_capsules_window_chunks_equal_the_whole_layer(normalizer, chunks):
  # 3 x 2 positions of 4 images. Chunks of 1 window, of 4 positions of an
  # image (its 6 padded to 8), of 2 whole images (13 windows: images 0, 2
  # and then 1, 3); with an E-step normaliser whole images only (1 image
  # for 1 and 6 windows). float64, so that only the summation order may
  # differ.
  dims = chex.Dimensions(B=4, H=7, W=5, C=2, O=3, P=4)
  options = _NORMALIZERS[normalizer]
  with jax.enable_x64(True):
    poses, acts = (np.asarray(x, np.float64)
                   for x in _conv_caps_inputs(dims, seed=7))
    layer = layers.ConvCapsules(dims.C, dims.O, 3, 2, beta_u_init=0.2,
                                beta_a_init=-0.1, rngs=nnx.Rngs(7))
    params = tuple(np.asarray(x, np.float64) for x in (
        layer.weights[...], layer.beta_u[...], layer.beta_a[...]))

    def loss_and_grads(window_chunk):
      def loss(poses, acts, *params):
        out_poses, out_acts, assignments = kernels.conv_capsule_routing(
            poses, acts, *params, stride=2, window_chunk=window_chunk,
            **options)
        return (jnp.sum(jnp.sin(out_poses) * out_acts[..., None, None])
                + jnp.sum(jnp.cos(assignments)), (out_poses, out_acts,
                                                  assignments))
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4),
                                        has_aux=True))(poses, acts, *params)

    whole = loss_and_grads(0)
    for chunk in chunks:
      chex.assert_trees_all_close(loss_and_grads(chunk), whole, rtol=1e-10,
                                  atol=1e-12)
    # Chunked gradients match finite differences (jitted: one compilation
    # for every difference, not one per operation).
    check_grads(jax.jit(lambda p, a, w: kernels.conv_capsule_routing(
        p, a, w, *params[1:], stride=2, window_chunk=chunks[0], **options)[:2]),
                (jnp.asarray(poses), jnp.asarray(acts), params[0]), order=1,
                modes=['rev'], atol=1e-4, rtol=1e-4)


def test_window_chunk_size_default_and_validation():
  # Chunks of about WINDOW_CHUNK_BYTES of votes on a CPU.
  votes = 288 * 32 * 16  # one window of the paper EM model's conv layers
  expected = (max(1, matrix_capsules.WINDOW_CHUNK_BYTES // (4 * votes))
              if jax.default_backend() == 'cpu' else 0)
  assert matrix_capsules.window_chunk_size(None, votes, jnp.float32) == expected
  assert matrix_capsules.window_chunk_size(0, votes, jnp.float32) == 0
  assert matrix_capsules.window_chunk_size(5, votes, jnp.float32) == 5
  with pytest.raises(ValueError, match='window_chunk'):
    layers.ConvCapsules(2, 3, window_chunk=-1, rngs=nnx.Rngs(0))


def test_conv_capsules_validate_arguments():
  with pytest.raises(ValueError, match='num_iterations'):
    routing.EMRouting(num_iterations=0)
  with pytest.raises(ValueError, match='activation_form'):
    routing.EMRouting(activation_form='hinton')
  with pytest.raises(ValueError, match='one value per iteration'):
    routing.EMRouting(inverse_temperature=(1.0, 2.0))
  with pytest.raises(ValueError, match='routing.EMRouting'):
    layers.ConvCapsules(2, 3, em_routing={'num_iterations': 2},
                        rngs=nnx.Rngs(0))
  layer = layers.ConvCapsules(2, 3, kernel_size=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='larger than the input'):
    layer(jnp.zeros((1, 2, 2, 2, 4, 4)), jnp.zeros((1, 2, 2, 2)))
  with pytest.raises(ValueError, match='do not match'):
    layer(jnp.zeros((1, 5, 5, 3, 4, 4)), jnp.zeros((1, 5, 5, 3)))


def test_matrix_layers_authors_init():
  conv = layers.ConvCapsules(8, 8, rngs=nnx.Rngs(0),
                             **layers.AUTHORS_CONV_INIT)
  np.testing.assert_allclose(conv.beta_a[...], 0.5)
  np.testing.assert_allclose(conv.beta_u[...], 0.5)
  # TF's truncated normal (cut at 2 std): std 0.88 of the normal's.
  weights = np.asarray(conv.weights[...])
  assert abs(float(weights.std()) - 0.88 * 0.3) < 0.02
  assert np.abs(weights).max() <= 0.6
  cls = layers.ClassCapsules(8, 5, rngs=nnx.Rngs(0),
                             **layers.AUTHORS_CLASS_INIT)
  np.testing.assert_allclose(cls.beta_a[...], 1.0)
  np.testing.assert_allclose(cls.beta_u[...], 2.0)
  assert abs(float(np.std(cls.weights[...])) - 0.88 * 0.01) < 0.002
  assert np.abs(np.asarray(cls.weights[...])).max() <= 0.02
  plain = layers.ConvCapsules(8, 8, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(plain.beta_a[...], 0.0)
  assert abs(float(np.std(plain.weights[...])) - 0.5) < 0.03


def test_class_capsules_coordinate_addition_by_hand():
  dims = chex.Dimensions(B=2, H=3, W=2, C=2, O=4, P=4)
  layer = layers.ClassCapsules(dims.C, dims.O, beta_u_init=0.1,
                               beta_a_init=0.2, rngs=nnx.Rngs(7))
  assert layer.coordinate_addition
  poses, acts = _conv_caps_inputs(dims, seed=7)
  out_poses, out_acts = jax.jit(layer.__call__)(poses, acts)
  chex.assert_shape(out_poses, dims['BOPP'])
  chex.assert_shape(out_acts, dims['BO'])
  weights = np.asarray(layer.weights[...])  # [C, O, P, P]
  v = np.zeros((dims.B, dims.H, dims.W, dims.C, dims.O, 16), np.float32)
  for h in range(dims.H):
    for w in range(dims.W):
      for c in range(dims.C):
        for o in range(dims.O):
          v[:, h, w, c, o] = (poses[:, h, w, c] @ weights[c, o]).reshape(
              dims.B, 16)
          # The scaled centre of cell (h, w), on vote entries 0 and 1.
          v[:, h, w, c, o, 0] += (h + 0.5) / dims.H
          v[:, h, w, c, o, 1] += (w + 0.5) / dims.W
  ref_poses, ref_acts, _ = jax.jit(routing.em_routing, static_argnums=4)(
      v.reshape(dims.B, -1, dims.O, 16), acts.reshape(dims.B, -1),
      layer.beta_u[...], layer.beta_a[...], 3)
  np.testing.assert_allclose(out_poses.reshape(dims.B, dims.O, 16), ref_poses,
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out_acts, ref_acts, rtol=1e-4, atol=1e-6)


def test_class_capsules_add_the_offsets_they_are_given():
  dims = chex.Dimensions(B=2, H=3, W=2, C=2, O=4, P=4)
  rows, cols = (-0.06, -0.02, 0.02), (0.5, -0.5)
  layer = layers.ClassCapsules(dims.C, dims.O, coordinate_offsets=(rows, cols),
                               rngs=nnx.Rngs(7))
  grid = layers.ClassCapsules(dims.C, dims.O, rngs=nnx.Rngs(7))
  poses, acts = _conv_caps_inputs(dims, seed=7)
  weights = np.asarray(layer.weights[...])
  v = np.einsum('bhwcij,cojk->bhwcoik', poses, weights).reshape(
      dims.B, dims.H, dims.W, dims.C, dims.O, 16)
  v[..., 0] += np.asarray(rows)[None, :, None, None, None]
  v[..., 1] += np.asarray(cols)[None, None, :, None, None]
  ref_poses, ref_acts, _ = jax.jit(routing.em_routing, static_argnums=4)(
      v.reshape(dims.B, -1, dims.O, 16), acts.reshape(dims.B, -1),
      layer.beta_u[...], layer.beta_a[...], 3)
  out_poses, out_acts = jax.jit(layer.__call__)(poses, acts)
  np.testing.assert_allclose(out_poses.reshape(dims.B, dims.O, 16), ref_poses,
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out_acts, ref_acts, rtol=1e-4, atol=1e-6)
  # Other offsets than the grid's: other outputs from the same parameters.
  assert not np.allclose(out_poses, jax.jit(grid.__call__)(poses, acts)[0],
                         atol=1e-3)
