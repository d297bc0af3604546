"""bfloat16 convolutions through oneDNN (capsjax.kernels.conv.onednn) and their
fallback to XLA on a CPU without bfloat16 instructions.

Tolerance: the references are float64 convolutions of the bfloat16-rounded
operands, so the only errors are oneDNN's float32 accumulation and one
final rounding to bfloat16 (8 significant bits, a relative error of at
most 2^-9, bounded here by BF16_EPS = 2^-8). The float32 sums add at most
about n * 2^-24 of the sum of the terms' magnitudes for n terms, bounded by
ACCUMULATION = 2^-14 of that sum (n <= 1024 here). So every value must lie
within BF16_EPS * |reference| + ACCUMULATION * (sum of |terms|).

XLA's bfloat16 lowerings (the fallback) round partial sums to bfloat16 too
(a product per kernel tap, added in place), up to one rounding of at most
BF16_EPS * (sum of |terms|) per tap: their bound is taps * BF16_EPS *
(sum of |terms|) on top of the same.
"""


import functools

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capsjax import kernels
from capsjax import losses
from capsjax.kernels import conv
from capsjax.kernels.conv import lowerings
from capsjax.kernels.conv import onednn
from capsjax.kernels.conv import products
from capsjax.routing import votes
from capsjax.training import state as state_lib
from tests.helpers import conv_reference
from tests.helpers import created_model
from tests.helpers import jit_output_and_grads
from tests.helpers import random_normal

BF16_EPS = 2.0**-8
ACCUMULATION = 2.0**-14

pytestmark = pytest.mark.skipif(
    not onednn.wheels_installed(),
    reason="oneDNN's wheels are not installed (pip install -e '.[onednn]')")

_TARGETS = ('OnednnConvForward', 'OnednnConvInputGrad', 'OnednnConvKernelGrad')


def _native_bf16_or_skip():
  native, why = onednn.bf16_status()
  if not native:
    pytest.skip(f'bfloat16 convolutions take {why}')


def _refused_without_bf16_kernels(dtype, call) -> bool:
  """On a CPU where oneDNN has no bfloat16 kernels (AVX2 and below), a
  bfloat16 call is refused before XLA with a ValueError naming the CPU and
  the way out; returns whether it was (so the caller stops)."""
  if jnp.dtype(dtype) != jnp.bfloat16 or onednn.native_bf16():
    return False
  with pytest.raises(ValueError, match='no bfloat16 instructions for oneDNN'):
    call()
  return True


def _bf16(seed, shape, scale=1.0):
  """Random bfloat16 values and the same values as float64."""
  x = jnp.asarray(random_normal(seed, shape, scale), jnp.bfloat16)
  return x, np.asarray(x, np.float64)


def _pads(size, kernel_size, stride, padding):
  return lowerings._conv_padding(size, kernel_size, stride, padding)  # pylint: disable=protected-access


def _assert_within_bf16(value, reference, magnitude, name, partial_sums=0):
  value = np.asarray(value, np.float64)
  bound = (BF16_EPS * np.abs(reference) +
           (ACCUMULATION + partial_sums * BF16_EPS) * magnitude)
  worst = np.max(np.abs(value - reference) - bound)
  assert worst <= 0, f'{name}: {worst} past the bfloat16 bound'


def _check_against_reference(x_shape, kernel_shape, stride, padding,
                             kernel_scale=0.1, partial_sums=0):
  """conv2d in bfloat16 (forward, input and kernel gradients) against the
  float64 reference of its bfloat16-rounded operands, allowing
  ``partial_sums`` bfloat16 roundings of partial sums (module docstring);
  returns the HLO of the forward and gradients."""
  x, x64 = _bf16(0, x_shape)
  kernel, k64 = _bf16(1, kernel_shape, kernel_scale)
  pads = (_pads(x_shape[1], kernel_shape[0], stride, padding),
          _pads(x_shape[2], kernel_shape[1], stride, padding))
  out_shape = onednn.output_shape(x_shape, kernel_shape, stride, pads)
  cotangent, dy64 = _bf16(2, out_shape)
  fn = lambda x, k: kernels.conv2d(x, k, stride, padding)
  run = jit_output_and_grads
  out, (gx, gk) = run(fn, x, kernel, cotangent)
  assert out.dtype == gx.dtype == gk.dtype == jnp.bfloat16
  assert out.shape == out_shape
  refs = conv_reference(x64, k64, dy64, stride, pads)
  sizes = conv_reference(np.abs(x64), np.abs(k64), np.abs(dy64), stride, pads)
  for name, value, ref, size in zip(('output', 'input gradient',
                                     'kernel gradient'), (out, gx, gk), refs,
                                    sizes, strict=True):
    _assert_within_bf16(value, ref, size, name, partial_sums)
  return run.lower(fn, x, kernel, cotangent).as_text()


@pytest.mark.parametrize('x_shape,kernel_shape,stride,padding', [
    ((3, 7, 9, 5), (3, 2, 5, 4), 1, 'VALID'),
    ((3, 7, 9, 5), (3, 2, 5, 4), 1, 'SAME'),
    ((3, 7, 9, 5), (3, 2, 5, 4), 2, 'VALID'),
    ((3, 7, 9, 5), (3, 2, 5, 4), 2, 'SAME'),
    ((2, 28, 28, 1), (9, 9, 1, 256), 1, 'VALID'),  # the CapsNet's Conv1
    ((2, 20, 20, 256), (9, 9, 256, 256), 2, 'VALID'),  # its PrimaryCaps
], ids=['stride1-valid', 'stride1-same', 'stride2-valid', 'stride2-same',
        'conv1', 'primarycaps'])
def test_bfloat16_convolution_and_gradients_by_onednn(
    x_shape, kernel_shape, stride, padding):
  _native_bf16_or_skip()
  hlo = _check_against_reference(x_shape, kernel_shape, stride, padding,
                                 kernel_scale=0.3 if x_shape[-1] < 8 else 0.05)
  # Below AMX a strided layer's kernel gradient is one product over its
  # patches (oneDNN's own kernel is slow there).
  by_product = stride > 1 and 'amx' not in onednn.cpu_isa()
  kernel_grad = ('OnednnConvKernelGradByProduct' if by_product else
                 'OnednnConvKernelGrad(')
  for target in ('OnednnConvForward(', 'OnednnConvInputGrad(', kernel_grad):
    assert target.rstrip('(') in hlo, target
  assert ('OnednnConvKernelGradByProduct' in hlo) == by_product


@pytest.mark.parametrize('padding', [onednn.VALID, ((1, 2), (2, 0))])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_kernel_gradient_by_product_is_the_kernel_gradient(dtype, padding):
  """The patches product (built inside the call, zeros over the padding)
  against the float64 reference, both dtypes, summed in float32."""
  if not onednn.available():
    pytest.skip(f'oneDNN is {onednn.status()}')
  x, x64 = _bf16(0, (3, 11, 9, 6))
  kernel_shape = (3, 4, 6, 5)
  out_shape = onednn.output_shape(x.shape, kernel_shape, 2, padding)
  cotangent, dy64 = _bf16(2, out_shape)
  call = lambda: jax.jit(onednn._kernel_gradient_by_product,  # pylint: disable=protected-access
                         static_argnums=(2, 3, 4))(
      x.astype(dtype), cotangent.astype(dtype), kernel_shape, 2, padding)
  if _refused_without_bf16_kernels(dtype, call):
    return
  grad = call()
  assert grad.dtype == jnp.float32 and grad.shape == kernel_shape
  _, _, ref = conv_reference(x64, np.zeros(kernel_shape), dy64, 2, padding)
  _, _, size = conv_reference(np.abs(x64), np.zeros(kernel_shape),
                              np.abs(dy64), 2, padding)
  # float32 sums of exact products (bfloat16 squared fits float32).
  assert np.max(np.abs(np.asarray(grad, np.float64) - ref) -
                ACCUMULATION * size) <= 0


@pytest.mark.parametrize('transpose_a,transpose_b', [
    (False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize('dtype,out_dtype', [
    (jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
    (jnp.bfloat16, jnp.bfloat16)])
def test_matmul(transpose_a, transpose_b, dtype, out_dtype):
  if not onednn.available():
    pytest.skip(f'oneDNN is {onednn.status()}')
  a, a64 = _bf16(0, (7, 5) if transpose_a else (5, 7))
  b, b64 = _bf16(1, (3, 7) if transpose_b else (7, 3))
  call = lambda: onednn.matmul(a.astype(dtype), b.astype(dtype), transpose_a,
                               transpose_b, out_dtype)
  if _refused_without_bf16_kernels(dtype, call):
    return
  y = call()
  assert y.dtype == out_dtype and y.shape == (5, 3)
  op = lambda m, t: m.T if t else m
  ref = op(a64, transpose_a) @ op(b64, transpose_b)
  size = np.abs(op(a64, transpose_a)) @ np.abs(op(b64, transpose_b))
  if out_dtype == jnp.bfloat16:
    _assert_within_bf16(y, ref, size, 'product')
  else:  # float32 sums of exact products
    assert np.max(np.abs(np.asarray(y, np.float64) - ref) -
                  ACCUMULATION * size) <= 0
  with pytest.raises(ValueError, match='do not multiply'):
    onednn.matmul(a.astype(dtype), b.astype(dtype), not transpose_a,
                  transpose_b)


def test_native_bfloat16_kernels_are_optimised_ones():
  """oneDNN's bfloat16 kernels for the CPU's instructions, not its
  reference ones, for the CapsNet's layers and Su's 3x3 layer."""
  _native_bf16_or_skip()
  assert conv.backend().startswith(
      f'oneDNN (float32 by {onednn.cpu_isa()} kernels; bfloat16 by oneDNN (')
  for x_shape, kernel_shape, stride in [
      ((2, 28, 28, 1), (9, 9, 1, 256), 1),
      ((2, 20, 20, 256), (9, 9, 256, 256), 2),
      ((2, 12, 12, 64), (3, 3, 64, 64), 1)]:
    kernels = onednn.kernels(x_shape, kernel_shape, stride,
                             dtype=jnp.bfloat16)
    assert 'ref' not in kernels and 'bf16' in kernels, kernels


def test_mixed_operands_and_other_dtypes_are_refused():
  if not onednn.available():
    pytest.skip(f'oneDNN is {onednn.status()}')
  x = jnp.zeros((2, 8, 8, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match='all float32 or all bfloat16'):
    onednn.conv(x, jnp.zeros((3, 3, 16, 4), jnp.float32))
  with pytest.raises(ValueError, match='all float32 or all bfloat16'):
    onednn.conv(x.astype(jnp.float16), jnp.zeros((3, 3, 16, 4), jnp.float16))


def test_without_native_bfloat16_the_convolutions_stay_xla(monkeypatch):
  """A CPU without bfloat16 instructions (the detection forced off): the
  backend says so, conv2d runs XLA's lowerings in bfloat16, correctly, and
  float32 convolutions still take oneDNN."""
  if not onednn.available():
    pytest.skip(f'oneDNN is {onednn.status()}')
  monkeypatch.setattr(onednn, 'native_bf16', lambda: False)
  native, why = onednn.bf16_status()
  assert not native
  assert why.startswith('XLA: this CPU has no bfloat16 instructions'), why
  assert 'bfloat16 by XLA: this CPU has no bfloat16' in conv.backend()
  assert not onednn.computes(jnp.bfloat16) and onednn.computes(jnp.float32)
  for stride, padding in ((1, 'SAME'), (2, 'VALID')):
    hlo = _check_against_reference((3, 7, 9, 5), (3, 2, 5, 4), stride,
                                   padding, kernel_scale=0.3,
                                   partial_sums=3 * 2)
    assert 'Onednn' not in hlo
  x = jnp.zeros((2, 8, 8, 16))
  f32_hlo = jax.jit(kernels.conv2d).lower(x, jnp.zeros((3, 3, 16, 4)))
  assert 'OnednnConvForward' in f32_hlo.as_text()


def test_forced_to_xla_by_the_environment(monkeypatch):
  if not onednn.available():
    pytest.skip(f'oneDNN is {onednn.status()}')
  monkeypatch.setenv('CAPSJAX_IMPLEMENTATION', 'xla')
  x = jnp.zeros((2, 8, 8, 16), jnp.bfloat16)
  hlo = jax.jit(kernels.conv2d).lower(x, jnp.zeros((3, 3, 16, 4), x.dtype))
  assert 'Onednn' not in hlo.as_text()


@functools.cache
def _built(name, options):
  """The model built as one compiled program, once per test session (the
  tests only split it); eagerly each initialiser compiles per shape. The
  checks here do not depend on the exact initial values."""
  return created_model(name, **dict(options))


def _capsnet_loss(params, graphdef, rest, images, labels):
  """The CapsNet's margin and reconstruction losses in bfloat16 compute on
  float32 master parameters (training's mixed precision)."""
  model = nnx.merge(graphdef, state_lib.cast_floating(params, jnp.bfloat16),
                    rest)
  out = state_lib.forward(model, images, jnp.bfloat16, labels, train=True)
  flat = images.reshape(images.shape[0], -1)
  loss = (losses.margin_loss(out['class_scores'],
                            jax.nn.one_hot(labels, 10)) +
          0.0005 * losses.reconstruction_loss(out['reconstructions'], flat))
  return jnp.mean(loss), out


@pytest.mark.parametrize('fill', [0.0, 1.0, 0.5])
def test_capsnet_bfloat16_forward_and_gradients_are_finite(fill):
  """All-zero and constant images: finite routing values, outputs and
  float32 gradients in bfloat16 compute (through oneDNN where the CPU has
  bfloat16 instructions)."""
  model = _built('capsnet', (('conv1_channels', 16), ('primary_types', 4),
                             ('decoder_widths', (32, 64))))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  images = np.full((4, 28, 28, 1), fill, np.float32)
  labels = np.arange(4, dtype=np.int32) % 10
  step = jax.jit(jax.value_and_grad(_capsnet_loss, has_aux=True),
                 static_argnums=1)
  hlo = step.lower(params, graphdef, rest, images, labels).as_text()
  assert ('OnednnConvForward' in hlo) == onednn.bf16_status()[0]
  (loss, out), grads = step(params, graphdef, rest, images, labels)
  assert np.isfinite(float(loss))
  for name in ('class_scores', 'capsules', 'coupling', 'primary_lengths',
               'reconstructions'):
    assert np.all(np.isfinite(np.asarray(out[name], np.float32))), name
  for leaf in jax.tree.leaves(grads):
    assert leaf.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(leaf))), fill


def test_large_bfloat16_dense_products_go_to_onednn(monkeypatch):
  """conv.dot_general as a dense layer's: a large bfloat16 product is
  oneDNN's matmul, values and both gradients within bfloat16 of the
  float64 reference; small, float32 or without native bfloat16, XLA's."""
  _native_bf16_or_skip()
  monkeypatch.setattr(products, 'ONEDNN_MIN_MACS', 1000)
  x, x64 = _bf16(0, (2, 3, 40))
  kernel, k64 = _bf16(1, (40, 24), 0.2)
  cotangent, dy64 = _bf16(2, (2, 3, 24))
  layer = lambda x, k: conv.dot_general(x, k, (((2,), (0,)), ((), ())))
  run = jit_output_and_grads
  assert 'OnednnMatmul' in run.lower(layer, x, kernel, cotangent).as_text()
  out, (gx, gk) = run(layer, x, kernel, cotangent)
  assert out.dtype == gx.dtype == gk.dtype == jnp.bfloat16
  flat, dy_flat = x64.reshape(6, 40), dy64.reshape(6, 24)
  for name, value, ref, size in (
      ('output', out.reshape(6, 24), flat @ k64, np.abs(flat) @ np.abs(k64)),
      ('input gradient', gx.reshape(6, 40), dy_flat @ k64.T,
       np.abs(dy_flat) @ np.abs(k64.T)),
      ('kernel gradient', gk, flat.T @ dy_flat,
       np.abs(flat.T) @ np.abs(dy_flat))):
    _assert_within_bf16(value, ref, size, name)
  small = (x[:1, :1], kernel, cotangent[:1, :1])  # 960 multiply-adds
  wide = tuple(a.astype(jnp.float32) for a in (x, kernel, cotangent))
  for args in (small, wide):
    assert 'Onednn' not in run.lower(layer, *args).as_text()
  monkeypatch.setattr(onednn, 'native_bf16', lambda: False)
  retraced = lambda x, k: conv.dot_general(x, k, (((2,), (0,)), ((), ())))
  assert 'Onednn' not in run.lower(retraced, x, kernel, cotangent).as_text()
  # The dense layer it is written for.
  monkeypatch.undo()
  monkeypatch.setattr(products, 'ONEDNN_MIN_MACS', 1000)
  dense = nnx.Linear(40, 24, dot_general=conv.dot_general, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(dense, nnx.Param, ...)
  np.testing.assert_allclose(
      np.asarray(dense(x.astype(jnp.float32))),
      np.asarray(x.astype(jnp.float32) @ params['kernel'][...]) +
      np.asarray(params['bias'][...]), rtol=1e-5, atol=1e-5)
  half = nnx.merge(graphdef, state_lib.cast_floating(params, jnp.bfloat16),
                   rest)
  low = half(x)  # mixed precision: through oneDNN
  assert low.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(low, np.float32),
                             np.asarray(dense(x.astype(jnp.float32))),
                             rtol=0.02, atol=0.02)


def test_shared_votes_go_to_onednn_in_bfloat16(monkeypatch):
  """Su's shared-transform votes through conv.dot_general: in bfloat16 one
  oneDNN matmul [B*I, Din] @ [Din, O*Dout], each vote within bfloat16 of
  the float64 product of the rounded operands, and both gradients too; in
  float32 XLA's product, the same values as the plain einsum."""
  _native_bf16_or_skip()
  monkeypatch.setattr(products, 'ONEDNN_MIN_MACS', 1000)
  u, u64 = _bf16(0, (3, 7, 12))  # [B, I, Din]
  w, w64 = _bf16(1, (5, 12, 4), 0.3)  # [O, Din, Dout]
  dv, dv64 = _bf16(2, (3, 7, 5, 4))
  shared = lambda u, w: votes.shared_vector_votes(
      u, w, dot_general=conv.dot_general)
  run = jit_output_and_grads
  assert 'OnednnMatmul' in run.lower(shared, u, w, dv).as_text()
  out, (gu, gw) = run(shared, u, w, dv)
  assert out.shape == (3, 7, 5, 4) and out.dtype == gu.dtype == jnp.bfloat16
  for name, value, ref, size in (
      ('votes', out, np.einsum('bid,ode->bioe', u64, w64),
       np.einsum('bid,ode->bioe', np.abs(u64), np.abs(w64))),
      ('input gradient', gu, np.einsum('bioe,ode->bid', dv64, w64),
       np.einsum('bioe,ode->bid', np.abs(dv64), np.abs(w64))),
      ('weight gradient', gw, np.einsum('bid,bioe->ode', u64, dv64),
       np.einsum('bid,bioe->ode', np.abs(u64), np.abs(dv64)))):
    _assert_within_bf16(value, ref, size, name)
  u32, w32 = u.astype(jnp.float32), w.astype(jnp.float32)
  assert 'Onednn' not in jax.jit(shared).lower(u32, w32).as_text()
  np.testing.assert_allclose(shared(u32, w32),
                             jnp.einsum('bid,ode->bioe', u32, w32),
                             rtol=1e-6, atol=1e-6)


def test_bfloat16_row_sums_by_onednn_are_float32_sums(monkeypatch):
  """sum_rows_float32 of a bfloat16 [..., F] (the bias gradients' sum) is
  oneDNN's float32 sum: within float32 accumulation of the float64 sum,
  where a bfloat16 accumulation would be off by whole percent; float32
  input, or no native bfloat16, is XLA's float32 sum."""
  _native_bf16_or_skip()
  x, x64 = _bf16(0, (64, 26, 26, 8))  # 43,264 rows
  summed = jax.jit(products.sum_rows_float32)
  assert 'OnednnMatmul' in summed.lower(x).as_text()
  out = summed(x)
  assert out.shape == (8,) and out.dtype == jnp.float32
  ref, size = x64.sum((0, 1, 2)), np.abs(x64).sum((0, 1, 2))
  assert np.all(np.abs(np.asarray(out, np.float64) - ref) <= 1e-5 * size)
  # The cotangent of a ReLU'd convolution output, with zeros: the same.
  relu = jnp.maximum(x, 0)
  np.testing.assert_allclose(summed(relu), np.maximum(x64, 0).sum((0, 1, 2)),
                             rtol=1e-5)
  wide = x.astype(jnp.float32)
  assert 'Onednn' not in summed.lower(wide).as_text()
  np.testing.assert_allclose(summed(wide), ref, rtol=1e-5)
  monkeypatch.setattr(onednn, 'native_bf16', lambda: False)
  assert 'Onednn' not in jax.jit(
      lambda x: products.sum_rows_float32(x)).lower(x).as_text()


@pytest.mark.parametrize('name,options,shape', [
    ('matrix_capsnet', dict(A=8, B=4, C=4, D=4), (32, 32, 1)),
    ('two_digit_capsnet', dict(trunk_widths=(8, 8, 16, 16)), (28, 28, 1)),
    ('baseline_cnn', dict(conv_channels=(4, 4, 4), fc_widths=(8, 8)),
     (28, 28, 1)),
])
@pytest.mark.parametrize('fill', [0.0, 1.0])
def test_other_models_bfloat16_gradients_are_finite(name, options, shape,
                                                    fill):
  """EM routing, Su's capsule model and the baseline CNN on all-zero and
  constant images in bfloat16 compute: finite scores and float32
  gradients."""
  model = _built(name, tuple(sorted(options.items())))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  images = np.full((2,) + shape, fill, np.float32)

  def loss_of(params):
    half = nnx.merge(graphdef, state_lib.cast_floating(params, jnp.bfloat16),
                     rest)
    out = state_lib.forward(half, images, jnp.bfloat16)
    return jnp.mean(out['class_scores']), out['class_scores']

  (loss, scores), grads = jax.jit(jax.value_and_grad(loss_of, has_aux=True))(
      params)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(scores)))
  for leaf in jax.tree.leaves(grads):
    assert leaf.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(leaf))), (name, fill)
