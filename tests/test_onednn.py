"""oneDNN's convolutions through XLA FFI (capsjax.onednn, the `onednn` extra).

Skipped only where the extra's wheels are not installed; installed, the
handlers must build and load (the README's test command installs them).
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capsjax import layers
from capsjax import onednn
from tests.conftest import REPO
from tests.test_layers import _assert_equals_direct
from tests.test_layers import _direct_conv
from tests.test_layers import _output_and_grads
from tests.test_layers import _random

pytestmark = pytest.mark.skipif(
    not onednn.wheels_installed(),
    reason="oneDNN's wheels are not installed (pip install -e '.[onednn]')")


def test_builds_and_loads_where_installed():
  assert onednn.available(), onednn.status()
  assert onednn.status().startswith('in use')
  # oneDNN's optimised kernels, not its reference ones.
  assert 'ref' not in onednn.kernels(2, 12, 64, 64)


def test_values_and_both_gradients_are_the_convolution_sums():
  """Against the definition in float64 NumPy, with a non-square kernel and
  odd sizes so that a wrong layout, window order or flip shows:
  y[b, i, j, f] = sum_{u, v, c} x[b, i + u, j + v, c] k[u, v, c, f];
  dx[b, i + u, j + v, c] += dy[b, i, j, f] k[u, v, c, f];
  dk[u, v, c, f] = sum_{b, i, j} x[b, i + u, j + v, c] dy[b, i, j, f]."""
  x = _random(0, (3, 7, 9, 5))
  kernel = _random(1, (3, 2, 5, 4), 0.3)
  cotangent = _random(2, (3, 5, 8, 4))
  out, (gx, gk) = jax.jit(_output_and_grads, static_argnums=0)(
      onednn.conv, x, kernel, cotangent)
  x64, k64, dy64 = (np.asarray(a, np.float64) for a in (x, kernel, cotangent))
  ref, gx_ref, gk_ref = np.zeros((3, 5, 8, 4)), np.zeros(x.shape), np.zeros(
      kernel.shape)
  for u in range(3):
    for v in range(2):
      window = x64[:, u:u + 5, v:v + 8]
      ref += np.einsum('bijc,cf->bijf', window, k64[u, v])
      gx_ref[:, u:u + 5, v:v + 8] += np.einsum('bijf,cf->bijc', dy64, k64[u, v])
      gk_ref[u, v] = np.einsum('bijc,bijf->cf', window, dy64)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gk, gk_ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize('shape,kernel_shape', [
    ((2, 26, 26, 64), (3, 3, 64, 64)),  # Su's second layer
    ((2, 12, 12, 64), (3, 3, 64, 128)),  # Su's third
    ((1, 10, 10, 128), (3, 3, 128, 128)),  # Su's fourth, one image
    ((2, 4, 5, 16), (4, 5, 16, 3)),  # the kernel covers the input: 1x1 out
])
def test_default_cpu_conv_is_onednn_and_equals_direct(shape, kernel_shape):
  x = _random(0, shape)
  kernel = _random(1, kernel_shape, 0.1)
  hlo = jax.jit(layers.conv2d).lower(x, kernel).as_text()
  assert 'OnednnConvForward' in hlo
  cotangent = _random(2, jax.eval_shape(
      lambda x, k: _direct_conv(x, k, 1), x, kernel).shape)
  _assert_equals_direct(layers.conv2d, lambda x, k: _direct_conv(x, k, 1), x,
                        kernel, cotangent)


@pytest.mark.parametrize('case', ['narrow', 'same', 'strided', 'bfloat16',
                                  'empty'])
def test_conv2d_keeps_other_lowerings_where_onednn_does_not_apply(case):
  x = jnp.zeros((0 if case == 'empty' else 2, 8, 8,
                 1 if case == 'narrow' else 16),
                jnp.bfloat16 if case == 'bfloat16' else jnp.float32)
  kernel = jnp.zeros((3, 3, x.shape[-1], 4), x.dtype)
  stride = 2 if case == 'strided' else 1
  padding = 'SAME' if case == 'same' else 'VALID'
  conv = lambda x, k: layers.conv2d(x, k, stride, padding)
  assert 'Onednn' not in jax.jit(conv).lower(x, kernel).as_text()
  assert conv(x, kernel).shape == jax.eval_shape(
      lambda x, k: _direct_conv(x, k, stride, padding), x, kernel).shape
  if case != 'narrow':
    with pytest.raises(ValueError, match="conv_impl='onednn' takes VALID"):
      layers.conv2d(x, kernel, stride, padding, impl='onednn')


def test_degenerate_inputs_give_finite_values_and_gradients():
  """All-zero, huge and tiny inputs: finite, and zeros where they must be."""
  kernel = _random(1, (3, 3, 16, 8), 0.1)
  for scale in (0.0, 1e30, 1e-30):
    x = scale * _random(0, (2, 5, 5, 16))
    out, (gx, gk) = jax.jit(_output_and_grads, static_argnums=0)(
        onednn.conv, x, kernel, np.ones((2, 3, 3, 8), np.float32))
    for a in (out, gx, gk):
      assert np.all(np.isfinite(np.asarray(a))), scale
    if scale == 0.0:
      assert not np.any(np.asarray(out)) and not np.any(np.asarray(gk))


def test_vmap_and_a_train_step_of_a_conv_layer():
  x = _random(0, (3, 2, 6, 6, 16))
  kernel = _random(1, (3, 3, 16, 4), 0.1)
  batched = jax.vmap(lambda x: layers.conv2d(x, kernel))(x)
  np.testing.assert_allclose(
      batched, jax.vmap(lambda x: _direct_conv(x, kernel, 1))(x), rtol=1e-5,
      atol=1e-5)
  loss = lambda k: jnp.sum(jnp.tanh(layers.conv2d(x[0], k)))
  np.testing.assert_allclose(
      jax.grad(loss)(kernel),
      jax.grad(lambda k: jnp.sum(jnp.tanh(_direct_conv(x[0], k, 1))))(kernel),
      rtol=1e-5, atol=1e-5)


def test_turned_off_by_the_environment():
  code = ('import json, jax, jax.numpy as jnp\n'
          'from capsjax import layers, onednn\n'
          'x = jnp.zeros((2, 8, 8, 16)); k = jnp.zeros((3, 3, 16, 4))\n'
          'hlo = jax.jit(layers.conv2d).lower(x, k).as_text()\n'
          'print(json.dumps([onednn.available(), onednn.status(), '
          "'Onednn' in hlo]))\n")
  env = dict(os.environ, CAPSJAX_ONEDNN='0', JAX_PLATFORMS='cpu')
  result = subprocess.run([sys.executable, '-c', code], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True)
  available, status, in_hlo = json.loads(result.stdout.strip().splitlines()[-1])
  assert not available and status == 'off (CAPSJAX_ONEDNN=0)' and not in_hlo
