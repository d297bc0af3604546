"""oneDNN's convolutions through XLA FFI (kernels.conv.onednn, the `onednn` extra).

Skipped only where the extra's wheels are not installed or the user turned
the path off; otherwise the handlers must build and load
(the README's test command installs them).
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capsjax import kernels
from capsjax.kernels.conv import lowerings
from capsjax.kernels.conv import onednn
from tests.conftest import REPO
from tests.helpers import assert_equals_direct
from tests.helpers import conv_reference
from tests.helpers import direct_conv
from tests.helpers import jit_output_and_grads
from tests.helpers import output_and_grads
from tests.helpers import random_normal

pytestmark = pytest.mark.skipif(
    not onednn.wheels_installed(),
    reason="oneDNN's wheels are not installed (pip install -e '.[onednn]')")


def test_builds_and_loads_where_installed():
  assert onednn.available(), onednn.status()
  assert onednn.status().startswith('in use')
  # oneDNN's optimised kernels, not its reference ones, for Su's 3x3
  # layer, the smoke CapsNet's strided PrimaryCaps and a SAME 5x5 layer.
  for x_shape, kernel_shape, stride, padding in [
      ((2, 12, 12, 64), (3, 3, 64, 64), 1, onednn.VALID),
      ((2, 20, 20, 32), (9, 9, 32, 64), 2, onednn.VALID),
      ((2, 28, 28, 256), (5, 5, 256, 128), 1, ((2, 2), (2, 2)))]:
    assert 'ref' not in onednn.kernels(x_shape, kernel_shape, stride, padding)


@pytest.mark.parametrize('stride,padding', [
    (1, ((0, 0), (0, 0))),
    (1, ((1, 1), (2, 0))),  # asymmetric: a swapped pair shows
    (2, ((0, 0), (0, 0))),  # the last row and column are read by no window
    (2, ((1, 2), (0, 1))),
    (3, ((2, 0), (1, 1))),
])
def test_values_and_both_gradients_are_the_convolution_sums(stride, padding):
  """Against the definition in float64 NumPy, with a non-square kernel and
  odd sizes so that a wrong layout, window order, flip, stride or padding
  shows."""
  x = random_normal(0, (3, 7, 9, 5))
  kernel = random_normal(1, (3, 2, 5, 4), 0.3)
  out_shape = onednn.output_shape(x.shape, kernel.shape, stride, padding)
  cotangent = random_normal(2, out_shape)
  out, (gx, gk) = jit_output_and_grads(
      lambda x, k: onednn.conv(x, k, stride, padding), x, kernel, cotangent)
  ref, gx_ref, gk_ref = conv_reference(x, kernel, cotangent, stride, padding)
  assert out.shape == ref.shape == out_shape
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gk, gk_ref, rtol=1e-5, atol=1e-4)


def test_shapes_that_differ_only_in_padding_are_not_confused():
  """The handlers keep their oneDNN primitives per shape and geometry: two
  convolutions of the same input, kernel and output sizes whose padding
  differs, called alternately in one program, must each give their own
  values."""
  x = random_normal(0, (2, 6, 6, 16))
  kernel = random_normal(1, (3, 3, 16, 4), 0.2)
  cotangent = random_normal(2, (2, 6, 6, 4))
  paddings = [((2, 0), (0, 2)), ((1, 1), (1, 1)), ((0, 2), (2, 0))]

  def all_three(x, kernel):
    return [output_and_grads(lambda x, k, p=p: onednn.conv(x, k, 1, p), x,
                              kernel, cotangent) for p in paddings]

  for _ in range(2):  # the second time from the cache
    for padding, (out, (gx, gk)) in zip(
        paddings, jax.jit(all_three)(x, kernel), strict=True):
      ref, gx_ref, gk_ref = conv_reference(x, kernel, cotangent, 1, padding)
      np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(gk, gk_ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize('shape,kernel_shape,stride,padding,targets', [
    # Su's second, third and fourth layers; one image
    ((2, 26, 26, 64), (3, 3, 64, 64), 1, 'VALID', 3),
    ((2, 12, 12, 64), (3, 3, 64, 128), 1, 'VALID', 3),
    ((1, 10, 10, 128), (3, 3, 128, 128), 1, 'VALID', 3),
    ((2, 4, 5, 16), (4, 5, 16, 3), 1, 'VALID', 3),  # 1x1 out
    ((2, 28, 28, 1), (9, 9, 1, 8), 1, 'VALID', 3),  # an image: narrow
    ((2, 14, 14, 16), (5, 5, 16, 8), 1, 'SAME', 3),  # the baseline CNN's
    ((2, 20, 20, 32), (9, 9, 32, 16), 2, 'VALID', 3),  # smoke PrimaryCaps
    # the paper's PrimaryCaps (fewer features): oneDNN's input gradient only
    ((2, 20, 20, 64), (9, 9, 64, 16), 2, 'VALID', 1),
])
def test_default_cpu_conv_is_onednn_and_equals_direct(
    shape, kernel_shape, stride, padding, targets):
  x = random_normal(0, shape)
  kernel = random_normal(1, kernel_shape, 0.1)
  conv = lambda x, k: kernels.conv2d(x, k, stride, padding)
  direct = lambda x, k: direct_conv(x, k, stride, padding)
  cotangent = random_normal(2, jax.eval_shape(direct, x, kernel).shape)
  hlo = jit_output_and_grads.lower(
      conv, x, kernel, cotangent).as_text()
  called = {name for name in ('OnednnConvForward', 'OnednnConvInputGrad',
                              'OnednnConvKernelGrad') if name in hlo}
  assert called == ({'OnednnConvInputGrad'} if targets == 1 else
                    {'OnednnConvForward', 'OnednnConvInputGrad',
                     'OnednnConvKernelGrad'})
  assert_equals_direct(conv, direct, x, kernel, cotangent)


@pytest.mark.parametrize('case', ['float16', 'empty'])
@pytest.mark.parametrize('impl', ['onednn', 'onednn_input_grad'])
def test_conv2d_keeps_other_lowerings_where_onednn_does_not_apply(case, impl):
  x = jnp.zeros((0 if case == 'empty' else 2, 8, 8, 16),
                jnp.float16 if case == 'float16' else jnp.float32)
  kernel = jnp.zeros((3, 3, 16, 4), x.dtype)
  assert 'Onednn' not in jax.jit(kernels.conv2d).lower(x, kernel).as_text()
  assert kernels.conv2d(x, kernel).shape == jax.eval_shape(
      lambda x, k: direct_conv(x, k, 1), x, kernel).shape
  with pytest.raises(ValueError,
                     match=f"lowering='{impl}': it takes float32 or bfloat16"):
    lowerings.conv2d(x, kernel, lowering=impl)
  with pytest.raises(ValueError, match="implementation='native' cannot take"):
    kernels.conv2d(x, kernel, implementation='native')


def test_degenerate_inputs_give_finite_values_and_gradients():
  """All-zero, huge and tiny inputs: finite, and zeros where they must be."""
  kernel = random_normal(1, (3, 3, 16, 8), 0.1)
  for scale in (0.0, 1e30, 1e-30):
    x = scale * random_normal(0, (2, 5, 5, 16))
    out, (gx, gk) = jit_output_and_grads(
        onednn.conv, x, kernel, np.ones((2, 3, 3, 8), np.float32))
    for a in (out, gx, gk):
      assert np.all(np.isfinite(np.asarray(a))), scale
    if scale == 0.0:
      assert not np.any(np.asarray(out)) and not np.any(np.asarray(gk))


def test_vmap_and_a_train_step_of_a_conv_layer():
  x = random_normal(0, (3, 2, 6, 6, 16))
  kernel = random_normal(1, (3, 3, 16, 4), 0.1)
  batched = jax.vmap(lambda x: kernels.conv2d(x, kernel))(x)
  np.testing.assert_allclose(
      batched, jax.vmap(lambda x: direct_conv(x, kernel, 1))(x), rtol=1e-5,
      atol=1e-5)
  loss = lambda k: jnp.sum(jnp.tanh(kernels.conv2d(x[0], k)))
  np.testing.assert_allclose(
      jax.grad(loss)(kernel),
      jax.grad(lambda k: jnp.sum(jnp.tanh(direct_conv(x[0], k, 1))))(kernel),
      rtol=1e-5, atol=1e-5)


def test_forced_to_xla_by_the_environment():
  """CAPSJAX_IMPLEMENTATION=xla: the default is XLA's convolution (oneDNN
  stays built); a named 'native' still runs oneDNN's."""
  code = ('import json, jax, jax.numpy as jnp\n'
          'from capsjax import kernels\n'
          'from capsjax.kernels import implementations\n'
          'from capsjax.kernels.conv import onednn\n'
          'x = jnp.zeros((2, 8, 8, 16)); k = jnp.zeros((3, 3, 16, 4))\n'
          'with implementations.recording() as choices:\n'
          '  hlo = jax.jit(kernels.conv2d).lower(x, k).as_text()\n'
          'native = jax.jit(lambda x, k: kernels.conv2d(\n'
          "    x, k, implementation='native')).lower(x, k).as_text()\n"
          'print(json.dumps([onednn.available(), "Onednn" in hlo,\n'
          '  "Onednn" in native, implementations.describe(choices)]))\n')
  env = dict(os.environ, CAPSJAX_IMPLEMENTATION='xla', JAX_PLATFORMS='cpu')
  result = subprocess.run([sys.executable, '-c', code], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True)
  available, in_hlo, in_native, choices = json.loads(
      result.stdout.strip().splitlines()[-1])
  assert available and not in_hlo and in_native
  assert choices == {'conv2d': 'xla (1 call; CAPSJAX_IMPLEMENTATION=xla)'}
