"""capsjax.kernels.conv.dispatch: XLA:CPU's Eigen convolutions instead of
YNNPACK's, and conv2d's CPU lowering that follows from it.

The flag is read once per process, so each case is a fresh interpreter;
what it asserts is what the compiler did (the compiled HLO), not timing.
"""

import json
import os
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest

from capsjax import kernels
from capsjax.kernels.conv import dispatch
from capsjax.kernels.conv import lowerings
from capsjax.kernels.conv import onednn
from tests.conftest import REPO

_PROBE = r'''
import json, os
import capsjax
from capsjax.kernels.conv import dispatch as c
print(json.dumps({
    'status': c.prefer_eigen_convolutions(),
    'xla_flags': os.environ.get('XLA_FLAGS', ''),
    'ynn': c.ynn_convolutions(),
    # Su's second layer; the first layers of CapsNet; PrimaryCaps (the
    # input gradient spans 400 positions for 36 outputs); 3x3 stride 3.
    'wide': c.cpu_conv_impl(64, 1, 26 * 26, 24 * 24),
    # Su's last two layers: the padded input gradient spans 1.44 and 1.56
    # times their outputs; the baseline CNN's 5x5 SAME layers 1.31.
    'su_third': c.cpu_conv_impl(64, 1, 12 * 12, 10 * 10),
    'su_fourth': c.cpu_conv_impl(128, 1, 10 * 10, 8 * 8),
    'baseline_same': c.cpu_conv_impl(256, 1, 32 * 32, 28 * 28),
    'su_fourth_narrow': c.cpu_conv_impl(32, 1, 10 * 10, 8 * 8),
    'stride1_tiny_grid': c.cpu_conv_impl(64, 1, 6 * 6, 4 * 4),  # 2.25
    'narrow': c.cpu_conv_impl(1, 1, 28 * 28, 20 * 20),
    'primary': c.cpu_conv_impl(256, 2, 20 * 20, 6 * 6),
    'primary_narrow': c.cpu_conv_impl(8, 2, 20 * 20, 6 * 6),
    'strided': c.cpu_conv_impl(3, 3, 12 * 12, 4 * 4),
    'strided_narrow': c.cpu_conv_impl(3, 2, 12 * 12, 5 * 5),
    # Where oneDNN computes the convolution (capsjax.kernels.conv.onednn).
    'onednn': [c.cpu_conv_impl(*args, onednn=True) for args in (
        (64, 1, 26 * 26, 24 * 24), (64, 1, 12 * 12, 10 * 10),
        (1, 1, 28 * 28, 20 * 20), (256, 1, 32 * 32, 28 * 28),
        (32, 2, 20 * 20, 6 * 6), (256, 2, 20 * 20, 6 * 6))],
    # oneDNN in bfloat16: the PrimaryCaps too (XLA's bfloat16 is slow).
    'onednn_bf16': c.cpu_conv_impl(256, 2, 20 * 20, 6 * 6, onednn=True,
                                   bfloat16=True),
    'devices': __import__('jax').device_count()}))
'''


def _probe(**env):
  environ = {k: v for k, v in os.environ.items()
             if k != 'XLA_FLAGS'}
  environ.update(env, JAX_PLATFORMS='cpu')
  out = subprocess.run([sys.executable, '-c', _PROBE], cwd=REPO, env=environ,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.splitlines()[-1])


needs_the_flag = pytest.mark.skipif(
    not dispatch.jaxlib_knows_flag(dispatch.YNN_FUSION_FLAG),
    reason='this jaxlib has no YNNPACK fusion flag')


@needs_the_flag
def test_the_call_turns_ynn_convolutions_off_and_convs_go_direct():
  result = _probe(XLA_FLAGS='--xla_force_host_platform_device_count=2')
  assert result['status'].startswith('applied'), result
  # The caller's own flags are kept beside it.
  assert result['xla_flags'].split() == [
      '--xla_force_host_platform_device_count=2',
      dispatch.NO_YNN_CONVOLUTIONS]
  assert result['devices'] == 2
  assert result['ynn'] is False  # the compiler obeyed
  assert result['wide'] == 'space_to_depth'
  assert result['su_third'] == result['su_fourth'] == 'taps'
  assert result['baseline_same'] == 'space_to_depth'
  assert result['su_fourth_narrow'] == 'space_to_depth'  # < 64 channels
  assert result['stride1_tiny_grid'] == 'taps'
  assert result['strided'] == 'space_to_depth'  # 3 * 3 * 3 = 27 channels
  assert result['narrow'] == 'narrow'
  assert result['strided_narrow'] == 'narrow'  # 2 * 2 * 3 = 12 channels
  assert result['primary'] == 'taps'
  # 8 channels: 81 tiny products; their fixed costs make patches faster.
  assert result['primary_narrow'] == 'patches'
  # With oneDNN: its convolution, except PrimaryCaps' (strided taps above),
  # which keeps XLA's forward and kernel gradient.
  assert result['onednn'] == ['onednn'] * 5 + ['onednn_input_grad']
  assert result['onednn_bf16'] == 'onednn'


@needs_the_flag
def test_opting_out_keeps_xla_flags_and_the_patches_path():
  flags = '--xla_cpu_experimental_ynn_fusion_type=individual_convolution'
  result = _probe(XLA_FLAGS=flags)
  assert result['status'] == ('not applied: XLA_FLAGS already sets the '
                              'YNNPACK fusion types')
  assert result['xla_flags'] == flags
  # jaxlib 0.10 hands this convolution to YNNPACK by default, whose
  # backward pass is slow: every convolution then takes the patches path.
  assert result['ynn'] is True
  assert {result[k] for k in ('wide', 'narrow', 'strided', 'primary')
          } == {'patches'}
  assert result['onednn'] == ['onednn'] * 6


@needs_the_flag
def test_a_users_own_ynn_setting_is_respected():
  own = '--xla_cpu_experimental_ynn_fusion_type=+individual_convolution'
  result = _probe(XLA_FLAGS=own)
  assert result['status'].startswith('not applied: XLA_FLAGS already sets')
  assert result['xla_flags'] == own
  assert result['ynn'] is True and result['wide'] == 'patches'


@pytest.mark.parametrize('height,channels,kernel_size,stride', [
    (26, 64, 3, 1),  # Su's second layer: space_to_depth (direct)
    (12, 64, 3, 1),  # Su's third: stride-1 taps (156 / 110 positions)
    (14, 1, 5, 1),  # narrow
    (13, 3, 5, 2),  # strided, regrouped to 12 channels: narrow
    (13, 16, 5, 2),  # strided, regrouped to 64 channels
    (20, 16, 9, 2),  # PrimaryCaps' shape, 16 channels: patches
    (14, 64, 9, 2),  # PrimaryCaps' shape, 64 channels: taps
])
@pytest.mark.parametrize('use_onednn', [False, True])
def test_conv2d_default_equals_direct_in_values_and_gradients(
    height, channels, kernel_size, stride, use_onednn, monkeypatch):
  # Both defaults: XLA's lowerings (the comments above) and, where it is
  # installed, oneDNN's.
  if use_onednn and not onednn.available():
    pytest.skip(f'oneDNN is {onednn.status()}')
  if not use_onednn:
    monkeypatch.setattr(onednn, 'available', lambda: False)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, height, height + 1, channels)).astype(np.float32)
  kernel = (0.1 * rng.standard_normal(
      (kernel_size, kernel_size, channels, 8))).astype(np.float32)
  out_shape = (2, (height - kernel_size) // stride + 1,
               (height + 1 - kernel_size) // stride + 1, 8)
  cotangent = rng.standard_normal(out_shape).astype(np.float32)

  def run(conv):
    out, vjp = jax.vjp(conv, x, kernel)
    return (out, *vjp(cotangent))

  default = jax.jit(lambda: run(lambda x, k: kernels.conv2d(x, k, stride)))()
  direct = run(lambda x, k: lowerings.conv2d(x, k, stride, lowering='direct'))
  chex.assert_shape(default[0], out_shape)
  for got, want in zip(default, direct, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
