"""The fused EM routing kernel (capsjax/kernels/csrc/em_routing.cc) against the
float64 NumPy reference, autodiff of routing.em_routing, finite
differences and the XLA conv capsule routing."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from capsjax import kernels
from capsjax import layers
from capsjax import routing
from capsjax.kernels import em_cpu
from capsjax.kernels import implementations
from capsjax.routing import votes as votes_lib
from tests.helpers import em_beta_a_scale
from tests.helpers import em_window_inputs
from tests.helpers import np_window_votes
from tests.test_routing import np_em_routing

pytestmark = pytest.mark.skipif(not em_cpu.available(),
                                reason=f'EM kernel {em_cpu.status()}')

# Each routes windows on their own: the paper's form with the authors'
# schedule, cost normalisation with a constant lambda, the released code's
# activation form with centre momentum and its variance floor, and 1 and 2
# iterations.
OPTIONS = {
    'paper': dict(num_iterations=3),
    'normalized_cost': dict(num_iterations=3, normalize_cost=True,
                            inverse_temperature=1.0),
    'authors': dict(num_iterations=3, activation_form='authors',
                    center_momentum=0.1, variance_epsilon=5e-4,
                    inverse_temperature=(0.5, 1.0, 2.0)),
    'one_iteration': dict(num_iterations=1),
    'two_iterations': dict(num_iterations=2, inverse_temperature=0.3),
}








@pytest.mark.parametrize('name', sorted(OPTIONS))
def test_kernel_matches_float64_reference(name):
  options = dict(OPTIONS[name])
  iterations = options.pop('num_iterations')
  poses, acts, weights, beta_u, beta_a = em_window_inputs(
      1, beta_a_scale=em_beta_a_scale(name))
  with jax.enable_x64(True):
    out = em_cpu.route_windows(poses, acts, weights, beta_u, beta_a,
                                  iterations, **options)
  assert [x.dtype for x in out] == [jnp.float64] * 3
  expected = np_em_routing(np_window_votes(poses, weights), acts, beta_u,
                           beta_a, iterations, **options)
  for got, want in zip(out, expected, strict=True):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-9, atol=1e-12)


def _routing_outputs_loss(route, cotangents):
  def loss(poses, acts, weights, beta_u, beta_a, lambdas):
    out = route(poses, acts, weights, beta_u, beta_a, lambdas)
    return sum(jnp.sum(o * c) for o, c in zip(out, cotangents, strict=True))
  return loss


@pytest.mark.parametrize('name', sorted(OPTIONS))
def test_kernel_gradients_equal_autodiff_of_em_routing(name):
  # Every input's gradient, the inverse temperatures' included, for
  # cotangents on all three outputs (poses, activations, assignments).
  options = dict(OPTIONS[name])
  iterations = options.pop('num_iterations')
  lambdas = np.asarray(routing.inverse_temperatures(
      options.pop('inverse_temperature', None), iterations, jnp.float32),
      np.float64)
  inputs = em_window_inputs(2, beta_a_scale=em_beta_a_scale(name)) + (lambdas,)
  rng = np.random.default_rng(3)
  num, num_in, num_out = 3, 7, 4
  cotangents = (rng.normal(size=(num, num_out, 16)),
                rng.normal(size=(num, num_out)),
                rng.normal(size=(num, num_in, num_out)))

  def kernel(poses, acts, weights, beta_u, beta_a, lam):
    return em_cpu.route_windows(poses, acts, weights, beta_u, beta_a,
                                   iterations, inverse_temperature=lam,
                                   **options)

  def xla(poses, acts, weights, beta_u, beta_a, lam):
    return routing.em_routing(votes_lib.matrix_votes(poses, weights), acts,
                              beta_u, beta_a, iterations,
                              inverse_temperature=lam, **options)

  with jax.enable_x64(True):
    argnums = tuple(range(6))
    got = jax.jit(jax.grad(_routing_outputs_loss(kernel, cotangents),
                           argnums))(*inputs)
    # Jitted too: one compilation, not one per operation of the routing.
    want = jax.jit(jax.grad(_routing_outputs_loss(xla, cotangents),
                            argnums))(*inputs)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-8,
                               atol=1e-11)
    assert np.any(np.asarray(w) != 0)


def test_kernel_gradients_match_finite_differences():
  poses, acts, weights, beta_u, beta_a = em_window_inputs(
      4, num=2, num_in=5, num_out=3)
  with jax.enable_x64(True):
    check_grads(jax.jit(lambda *x: em_cpu.route_windows(
        *x, 3, normalize_cost=True, inverse_temperature=0.7)),
                (poses, acts, weights, beta_u, beta_a), order=1,
                modes=['rev'], atol=1e-4, rtol=1e-4)


def test_float32_kernel_is_float64_to_float32_precision():
  inputs = em_window_inputs(5, num=4, num_in=72, num_out=16)
  cotangent = np.random.default_rng(6).normal(size=(4, 16, 16))

  def loss(*x):
    out_poses, out_acts, _ = em_cpu.route_windows(*x, 3)
    return jnp.sum(out_poses * cotangent) + jnp.sum(out_acts)

  # Jitted: one compilation, not one per operation.
  with jax.enable_x64(True):
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*inputs)
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
      *(np.asarray(x, np.float32) for x in inputs))
  # float32 sums over 72 children and 3 iterations: measured <= 2e-6
  # relative to each array's largest entry.
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == jnp.float32
    scale = np.max(np.abs(np.asarray(w)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(w),
                               atol=2e-5 * scale, rtol=0)


def _layer_params(dims_c=2, out_types=3, seed=0):
  layer = layers.ConvCapsules(dims_c, out_types, 3, 2, beta_u_init=0.2,
                              beta_a_init=-0.1, rngs=nnx.Rngs(seed))
  return tuple(np.asarray(x, np.float64) for x in (
      layer.weights[...], layer.beta_u[...], layer.beta_a[...]))


def test_conv_capsule_routing_by_kernel_equals_xla():
  rng = np.random.default_rng(8)
  poses = rng.normal(size=(2, 7, 5, 2, 4, 4))
  acts = rng.uniform(size=(2, 7, 5, 2))
  params = _layer_params()

  def loss_and_grads(impl):
    def loss(poses, acts, *params):
      out_poses, out_acts, assignments = kernels.conv_capsule_routing(
          poses, acts, *params, stride=2, implementation=impl, normalize_cost=True)
      return (jnp.sum(jnp.sin(out_poses) * out_acts[..., None, None])
              + jnp.sum(jnp.cos(assignments)),
              (out_poses, out_acts, assignments))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4),
                                      has_aux=True))(poses, acts, *params)

  with jax.enable_x64(True):
    kernel, xla = loss_and_grads('native'), loss_and_grads('xla')
    assert loss_and_grads(None)[0][0] == kernel[0][0]
  for got, want in zip(jax.tree.leaves(kernel), jax.tree.leaves(xla),
                             strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-9,
                               atol=1e-12)


def test_default_routes_cpu_conv_capsules_with_the_kernel():
  layer = layers.ConvCapsules(2, 3, 3, 2, rngs=nnx.Rngs(0))
  poses = jnp.zeros((1, 5, 5, 2, 4, 4))
  acts = jnp.ones((1, 5, 5, 2))
  hlo = jax.jit(lambda p, a: layer(p, a)).lower(poses, acts).as_text()
  assert 'EmConvRoutingForward' in hlo
  chunked = layers.ConvCapsules(2, 3, 3, 2, window_chunk=1, rngs=nnx.Rngs(0))
  hlo = jax.jit(lambda p, a: chunked(p, a)).lower(poses, acts).as_text()
  assert 'EmConvRoutingForward' not in hlo


def test_bfloat16_conv_capsules_route_in_float32_by_the_kernel():
  # Mixed precision's bfloat16 poses and transforms: the kernel multiplies
  # and routes them in float32, exactly as the same values upcast.
  rng = np.random.default_rng(12)
  poses = jnp.asarray(rng.normal(size=(2, 5, 5, 2, 4, 4)), jnp.bfloat16)
  acts = jnp.asarray(rng.uniform(size=(2, 5, 5, 2)), jnp.bfloat16)
  params = tuple(jnp.asarray(x, jnp.bfloat16) for x in _layer_params())
  route = jax.jit(lambda *x: kernels.conv_capsule_routing(*x, stride=2))
  assert 'EmConvRoutingForward' in route.lower(poses, acts,
                                               *params).as_text()
  half = route(poses, acts, *params)
  # Upcast by NumPy (exact): no conversion program per input shape.
  upcast = route(*(np.asarray(x, np.float32) for x in (poses, acts, *params)))
  assert [x.dtype for x in half] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]
  for h, u in zip(half, upcast, strict=True):
    np.testing.assert_array_equal(np.asarray(h),
                                  np.asarray(u.astype(h.dtype)))


def _degenerate_windows(name):
  poses, acts, weights, beta_u, beta_a = em_window_inputs(
      9, num=2, num_in=6, num_out=3, dtype=np.float32)
  if name == 'zero_activations':
    acts = np.zeros_like(acts)
  elif name == 'identical_votes':
    poses = np.broadcast_to(poses[:, :1], poses.shape).copy()
    weights = np.broadcast_to(weights[:1, :1], weights.shape).copy()
  elif name == 'one_child':
    poses, acts, weights = poses[:, :1], acts[:, :1], weights[:1]
  elif name == 'huge_votes':
    # The scale test_routing's degenerate cases guarantee (at 1e13 both
    # this kernel's and XLA's float32 gradients overflow).
    poses = poses * 1e12
  elif name == 'tiny_votes':
    poses = poses * 1e-20
  return poses, acts, weights, beta_u, beta_a


@pytest.mark.parametrize('name', ['zero_activations', 'identical_votes',
                                  'one_child', 'huge_votes', 'tiny_votes'])
def test_values_and_gradients_finite_on_degenerate_windows(name):
  inputs = _degenerate_windows(name)

  def loss(*x):
    out_poses, out_acts, assignments = em_cpu.route_windows(*x, 3)
    return (jnp.sum(out_poses) + jnp.sum(out_acts) + jnp.sum(assignments),
            (out_poses, out_acts, assignments))

  (value, outputs), grads = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(*inputs)
  for x in (value, *outputs, *grads):
    assert np.all(np.isfinite(np.asarray(x))), name
  np.testing.assert_allclose(np.sum(np.asarray(outputs[2]), -1), 1.0,
                             rtol=1e-5)


def test_gradients_are_the_same_bit_for_bit_on_every_call():
  # 512 windows on XLA's thread pool: the shared parameters' gradients are
  # sums over windows that different threads route. Summed per thread in
  # the order the threads took the windows, 3 of the 5 gradients differed
  # in their last bits on every one of 20 repeated calls here (2 cores).
  # Summed per chunk of windows, the chunks in order, none differs.
  num, num_in, num_out = 512, 18, 8
  inputs = em_window_inputs(5, num=num, num_in=num_in, num_out=num_out,
                            dtype=np.float32) + (
                                np.array([0.5, 1.0, 2.0], np.float32),)
  rng = np.random.default_rng(1)
  cotangents = tuple(rng.normal(size=shape).astype(np.float32) for shape in (
      (num, num_out, 16), (num, num_out), (num, num_in, num_out)))

  def kernel(poses, acts, weights, beta_u, beta_a, lam):
    return em_cpu.route_windows(poses, acts, weights, beta_u, beta_a, 3,
                                   inverse_temperature=lam)

  grads = jax.jit(jax.grad(_routing_outputs_loss(kernel, cotangents),
                           tuple(range(6))))
  first = [np.asarray(g) for g in grads(*inputs)]
  for _ in range(10):
    for g, again in zip(first, grads(*inputs), strict=True):
      np.testing.assert_array_equal(np.asarray(again), g)


def test_vmap_equals_a_loop():
  poses, acts, weights, beta_u, beta_a = em_window_inputs(10, dtype=np.float32)
  stacked = np.stack([poses, poses[::-1]])
  # One jitted function for the batch and the loop: two compilations.
  route = jax.jit(lambda p: em_cpu.route_windows(
      p, acts, weights, beta_u, beta_a, 2))
  batched = jax.vmap(route)(stacked)
  for k in range(2):
    single = route(stacked[k])
    for b, s in zip(batched, single, strict=True):
      np.testing.assert_array_equal(np.asarray(b)[k], np.asarray(s))


def test_bad_arguments_raise_value_error():
  poses, acts, weights, beta_u, beta_a = em_window_inputs(11, dtype=np.float32)
  with pytest.raises(ValueError, match=r'poses \[N, I, 4, 4\]'):
    em_cpu.route_windows(poses[:, :-1], acts, weights, beta_u, beta_a)
  with pytest.raises(ValueError, match='activation_form'):
    em_cpu.route_windows(poses, acts, weights, beta_u, beta_a,
                            activation_form='hinton')
  # bfloat16 poses are routed in float32.
  half = em_cpu.route_windows(poses.astype(jnp.bfloat16), acts, weights,
                                 beta_u, beta_a)
  upcast = em_cpu.route_windows(
      np.asarray(poses.astype(jnp.bfloat16), np.float32), acts, weights,
      beta_u, beta_a)
  for h, u in zip(half, upcast, strict=True):
    assert h.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(h), np.asarray(u))
  conv_poses = np.zeros((1, 5, 5, 2, 4, 4), np.float32)
  conv_acts = np.ones((1, 5, 5, 2), np.float32)
  w, bu, ba = (np.asarray(x, np.float32) for x in _layer_params())
  with pytest.raises(ValueError, match='couples the windows'):
    kernels.conv_capsule_routing(
        conv_poses, conv_acts, w, bu, ba, stride=2, implementation='native',
        normalize_across_positions=True)
  with pytest.raises(ValueError, match="implementation must be None .* "
                     "conv_capsule_routing's implementations"):
    kernels.conv_capsule_routing(
        conv_poses, conv_acts, w, bu, ba, stride=2, implementation='kernel')
  with pytest.raises(ValueError, match='implementation must be None'):
    layers.ConvCapsules(2, 3, implementation='fused', rngs=nnx.Rngs(0))


def test_environment_switch_routes_through_xla(monkeypatch):
  """CAPSJAX_IMPLEMENTATION=xla: the default routes through XLA, and the
  choice says why; a named 'native' still takes the kernel."""
  layer = layers.ConvCapsules(2, 3, 3, 2, rngs=nnx.Rngs(0))
  native = layers.ConvCapsules(2, 3, 3, 2, implementation='native',
                               rngs=nnx.Rngs(0))
  poses, acts = jnp.zeros((1, 5, 5, 2, 4, 4)), jnp.ones((1, 5, 5, 2))
  monkeypatch.setenv('CAPSJAX_IMPLEMENTATION', 'xla')
  with implementations.recording() as choices:
    hlo = jax.jit(lambda p, a: layer(p, a)).lower(poses, acts).as_text()
  assert 'EmConvRoutingForward' not in hlo
  assert implementations.describe(choices) == {
      'conv_capsule_routing': 'xla (1 call; CAPSJAX_IMPLEMENTATION=xla)'}
  hlo = jax.jit(lambda p, a: native(p, a)).lower(poses, acts).as_text()
  assert 'EmConvRoutingForward' in hlo
  monkeypatch.setenv('CAPSJAX_IMPLEMENTATION', 'pallas')
  with pytest.raises(ValueError, match='CAPSJAX_IMPLEMENTATION must be'):
    jax.jit(lambda p, a: layer(p, a)).lower(poses, acts)


def test_kernel_cost_counts_xla_dot_flops_and_the_kernel_operands():
  from capsjax import flops
  num, num_in, num_out = 6, 18, 4
  shape = (num, num_in, num_out, 16)
  poses, acts, weights, beta_u, beta_a = em_window_inputs(
      13, num, num_in, num_out, dtype=np.float32)
  kernel = flops.em_conv_kernel_cost(shape, 3)
  routing_only = flops.em_routing_cost(shape, 3)
  votes_dot = jax.jit(votes_lib.matrix_votes).lower(
      poses, weights).compile().cost_analysis()
  votes_dot = votes_dot[0] if isinstance(votes_dot, list) else votes_dot
  assert kernel.flops - routing_only.flops == votes_dot['flops']
  outputs = em_cpu.route_windows(poses, acts, weights, beta_u, beta_a, 3)
  operands = sum(x.nbytes for x in (poses, acts, weights, *outputs))
  assert kernel.bytes == kernel.streaming_bytes == operands
  backward = flops.em_conv_kernel_cost(shape, 3, backward=True)
  assert backward.bytes == 2 * operands
  assert backward.flops == 3 * kernel.flops


def test_without_a_compiler_conv_capsules_route_through_xla(tmp_path):
  code = '\n'.join([
      'import jax.numpy as jnp',
      'from capsjax import kernels',
      'from capsjax.kernels import em_cpu',
      'print(em_cpu.status())',
      'out = kernels.conv_capsule_routing(',
      '    jnp.zeros((1, 5, 5, 2, 4, 4)), jnp.ones((1, 5, 5, 2)),',
      '    jnp.zeros((3, 3, 2, 3, 4, 4)), jnp.zeros(3), jnp.zeros(3), stride=2)',
      'print([o.shape for o in out])'])
  result = subprocess.run(
      [sys.executable, '-c', code], capture_output=True, text=True,
      check=True, env={**os.environ, 'CXX': '/nonexistent/g++',
                       'CAPSJAX_CACHE_DIR': str(tmp_path)})
  assert result.stdout.splitlines() == [
      "not available: the C++ compiler $CXX='/nonexistent/g++' does not "
      'exist; set CXX to one that does, or unset it',
      '[(1, 2, 2, 3, 4, 4), (1, 2, 2, 3), (1, 2, 2, 18, 3)]']
