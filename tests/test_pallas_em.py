"""The Pallas EM kernel (capsjax/kernels/pallas_em.py) in interpret mode: the
float64 NumPy reference, autodiff of routing.em_routing, the fused CPU
kernel and the XLA conv capsule routing; degenerate windows; and its
lowering to a Triton call for CUDA."""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import em_kernels
from benchmarks import kernel_bench
from capsjax import kernels
from capsjax import layers
from capsjax import routing
from capsjax.kernels import em_cpu
from capsjax.kernels import pallas_em
from capsjax.routing import votes as votes_lib
from tests.helpers import em_beta_a_scale
from tests.helpers import em_window_inputs
from tests.helpers import np_window_votes
from tests.test_routing import np_em_routing

# Interpreted on purpose here: the warning that says so is tested once.
pytestmark = pytest.mark.filterwarnings(
    "ignore:routing implementation='pallas' without a GPU")

_inputs = functools.partial(em_window_inputs, num_out=3)

# Window-local options: the paper's schedule, cost normalisation with a
# constant lambda, the authors' form with centre momentum, one iteration.
OPTIONS = {
    'paper': dict(num_iterations=3),
    'normalized_cost': dict(num_iterations=2, normalize_cost=True,
                            inverse_temperature=1.0),
    'authors': dict(num_iterations=3, activation_form='authors',
                    center_momentum=0.1, variance_epsilon=5e-4,
                    inverse_temperature=(0.5, 1.0, 2.0)),
    'one_iteration': dict(num_iterations=1),
}






@pytest.mark.parametrize('name', sorted(OPTIONS))
def test_matches_float64_reference(name):
  options = dict(OPTIONS[name])
  iterations = options.pop('num_iterations')
  poses, acts, weights, beta_u, beta_a = _inputs(
      1, beta_a_scale=em_beta_a_scale(name))
  # 7 children in chunks of 4: two chunks, the last padded.
  with jax.enable_x64(True):
    out = pallas_em.route_windows(poses, acts, weights, beta_u, beta_a,
                                  iterations, child_chunk=4, **options)
  assert [x.dtype for x in out] == [jnp.float64] * 3
  expected = np_em_routing(np_window_votes(poses, weights), acts, beta_u,
                           beta_a, iterations, **options)
  for got, want in zip(out, expected, strict=True):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize('name, backward', [('authors', 'pallas'),
                                            ('normalized_cost', 'xla')])
def test_gradients_equal_autodiff_of_em_routing(name, backward):
  # Every input's gradient, the inverse temperatures' included, for
  # cotangents on all three outputs: the backward kernel (7 children in
  # chunks of 4), or XLA's in chunks of 2 windows (the last one padded).
  # (The conv test below checks the kernel's with normalize_cost.)
  options = dict(OPTIONS[name])
  iterations = options.pop('num_iterations')
  lambdas = np.asarray(routing.inverse_temperatures(
      options.pop('inverse_temperature', None), iterations, jnp.float32),
      np.float64)
  inputs = _inputs(2, beta_a_scale=em_beta_a_scale(name)) + (lambdas,)
  rng = np.random.default_rng(3)
  cotangents = (rng.normal(size=(3, 3, 16)), rng.normal(size=(3, 3)),
                rng.normal(size=(3, 7, 3)))

  def loss(route):
    def value(*x):
      out = route(*x)
      return sum(jnp.sum(o * c) for o, c in zip(out, cotangents, strict=True))
    return jax.grad(value, argnums=tuple(range(6)))

  def pallas(poses, acts, weights, beta_u, beta_a, lam):
    return pallas_em.route_windows(poses, acts, weights, beta_u, beta_a,
                                   iterations, inverse_temperature=lam,
                                   child_chunk=4, backward=backward,
                                   backward_chunk=2, **options)

  def xla(poses, acts, weights, beta_u, beta_a, lam):
    return routing.em_routing(votes_lib.matrix_votes(poses, weights), acts,
                              beta_u, beta_a, iterations,
                              inverse_temperature=lam, **options)

  with jax.enable_x64(True):
    got = jax.jit(loss(pallas))(*inputs)
    want = jax.jit(loss(xla))(*inputs)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-9,
                               atol=1e-12)
    assert np.any(np.asarray(w) != 0)


def test_float32_is_float64_to_float32_precision():
  # 72 children to 16 parents (sums over 9 chunks), 2 iterations, both
  # kernels in float32 against the XLA routing in float64. Measured
  # relative to each array's largest entry: <= 1.6e-6 at XLA's default
  # optimisation level, <= 1.3e-5 at the level 0 these tests interpret the
  # kernels at (conftest.py).
  inputs = _inputs(5, num=4, num_in=72, num_out=16)
  cotangent = np.random.default_rng(6).normal(size=(4, 16, 16))

  def loss(route):
    def value(*x):
      out_poses, out_acts, assignments = route(*x)
      return (jnp.sum(out_poses * cotangent) + jnp.sum(out_acts)
              + jnp.sum(jnp.sin(assignments)))
    return jax.jit(jax.value_and_grad(value, argnums=(0, 1, 2, 3, 4)))

  with jax.enable_x64(True):
    want = loss(lambda p, a, w, u, b: routing.em_routing(
        votes_lib.matrix_votes(p, w), a, u, b, 2))(*inputs)
  got = loss(lambda *x: pallas_em.route_windows(*x, 2))(
      *(np.asarray(x, np.float32) for x in inputs))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == jnp.float32
    scale = np.max(np.abs(np.asarray(w)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(w),
                               atol=3e-5 * scale, rtol=0)


def _layer_params(in_types=2, out_types=3):
  layer = layers.ConvCapsules(in_types, out_types, 3, 2, beta_u_init=0.2,
                              beta_a_init=-0.1, rngs=nnx.Rngs(0))
  return tuple(np.asarray(x, np.float64) for x in (
      layer.weights[...], layer.beta_u[...], layer.beta_a[...]))


def test_conv_capsule_routing_by_pallas_equals_xla_and_the_cpu_kernel():
  rng = np.random.default_rng(8)
  poses = rng.normal(size=(2, 5, 5, 2, 4, 4))
  acts = rng.uniform(size=(2, 5, 5, 2))
  params = _layer_params()

  def loss_and_grads(impl):
    def loss(poses, acts, *params):
      out = kernels.conv_capsule_routing(
          poses, acts, *params, stride=2, implementation=impl,
          normalize_cost=True, num_iterations=2)
      return (jnp.sum(jnp.sin(out[0]) * out[1][..., None, None])
              + jnp.sum(jnp.cos(out[2])), out)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4),
                                      has_aux=True))(poses, acts, *params)

  with jax.enable_x64(True):
    pallas = loss_and_grads('pallas')
    xla = loss_and_grads('xla')
    kernel = (kernels.conv_capsule_routing(
        poses, acts, *params, stride=2, implementation='native',
        normalize_cost=True, num_iterations=2)
        if em_cpu.available() and jax.default_backend() == 'cpu' else None)
  for got, want in zip(jax.tree.leaves(pallas), jax.tree.leaves(xla),
                       strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-9,
                               atol=1e-12)
  for got, want in zip(pallas[0][1], kernel or (), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-9,
                               atol=1e-12)


def test_float32_jit_and_vmap_equal_a_loop_of_calls():
  poses, acts, weights, beta_u, beta_a = _inputs(10, dtype=np.float32)
  stacked = np.stack([poses, poses[::-1]])

  def route(poses, weights):
    return pallas_em.route_windows(poses, acts, weights, beta_u, beta_a, 2)

  batched = jax.jit(jax.vmap(route, in_axes=(0, None)))(stacked, weights)
  for k in range(2):
    single = jax.jit(route)(stacked[k], weights)
    for b, s in zip(batched, single, strict=True):
      assert b.dtype == jnp.float32
      np.testing.assert_allclose(np.asarray(b[k]), np.asarray(s), rtol=1e-6,
                                 atol=1e-6)


def _degenerate_windows(name):
  poses, acts, weights, beta_u, beta_a = _inputs(9, num=1, num_in=6,
                                                 dtype=np.float32)
  if name == 'zero_activations':
    acts = np.zeros_like(acts)
  elif name == 'zero_poses':
    poses = np.zeros_like(poses)
  elif name == 'identical_votes':
    poses = np.broadcast_to(poses[:, :1], poses.shape).copy()
    weights = np.broadcast_to(weights[:1, :1], weights.shape).copy()
  elif name == 'huge_poses':
    poses = poses * 1e12  # the scale test_routing's degenerate cases hold
  elif name == 'tiny_poses':
    poses = poses * 1e-20
  return poses, acts, weights, beta_u, beta_a


def test_values_and_gradients_finite_on_degenerate_windows():
  # One window each (one call compiled for all).
  def loss(*x):
    out = pallas_em.route_windows(*x, 3)
    return jnp.sum(out[0]) + jnp.sum(out[1]) + jnp.sum(out[2]), out

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4),
                                    has_aux=True))
  for name in ('zero_activations', 'zero_poses', 'identical_votes',
               'huge_poses', 'tiny_poses', 'random'):
    (value, outputs), grads = step(*_degenerate_windows(name))
    for x in (value, *outputs, *grads):
      assert np.all(np.isfinite(np.asarray(x))), name
    np.testing.assert_allclose(np.sum(np.asarray(outputs[2]), -1), 1.0,
                               rtol=1e-5, err_msg=name)


@pytest.mark.parametrize('name, windows, stride', [('convcaps1', 36, 2),
                                                   ('convcaps2', 16, 1)])
def test_paper_conv_capsule_layers_lower_to_triton_for_cuda(name, windows,
                                                            stride):
  # The paper EM model's conv capsule windows (3 x 3 x 32 = 288 children
  # to 32 types) at batch 16, forward and backward, exported for CUDA on
  # this CPU: each pass is one Triton kernel, a program per window.
  del stride  # the windows are routed alike; only their count differs

  def loss(poses, acts, weights, beta_u, beta_a):
    out = pallas_em.route_windows(poses, acts, weights, beta_u, beta_a, 3,
                                  interpret=False)
    return jnp.sum(out[0]) + jnp.sum(out[1]), out

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4),
                                    has_aux=True))
  shapes = [(16 * windows, 288, 4, 4), (16 * windows, 288), (288, 32, 4, 4),
            (32,), (32,)]
  exported = jax.export.export(
      step, platforms=['cuda'],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
          '__gpu$xla.gpu.triton')])(
              *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))
  text = exported.mlir_module()
  assert text.count('stablehlo.custom_call @__gpu$xla.gpu.triton') == 2, name
  assert set(re.findall(r'(grid_x|num_warps) = (\d+) : i32', text)) == {
      ('grid_x', str(16 * windows)), ('num_warps', '4')}
  assert re.findall(r'name = "(em_conv_windows\w*)"', text) == [
      'em_conv_windows', 'em_conv_windows_backward']


def test_paper_conv_capsule_kernel_compiles_to_sm80_without_spills(tmp_path):
  # Where the Triton compiler is installed (PyTorch brings it), its build of
  # the ConvCaps1 forward kernel for an A100 (sm_80), without a GPU: ptxas
  # says how many registers it takes and what it spills
  # (``--ptxas=backward`` builds the backward kernel, about a minute here).
  # Register use depends on the Triton version: 142 registers and no
  # spills with Triton 3.8, all 255 and 372 spilled bytes with 3.6 (the
  # one PyTorch 2.11 brings; NUM_WARPS = 8 spills with neither, unmeasured
  # on a GPU).
  triton = pytest.importorskip('triton')
  [(_, fn, shapes, name)] = em_kernels.ptxas_builds('forward')
  row = kernel_bench.ptxas_report(fn, shapes, name, 80, str(tmp_path))
  assert (row['kernel'], row['target']) == ('em_conv_windows', 'sm_80')
  assert 0 < row['registers'] <= 255
  if tuple(map(int, triton.__version__.split('.')[:2])) >= (3, 8):
    assert row['spill_store_bytes'] == 0


def test_bad_arguments_raise_value_error():
  poses, acts, weights, beta_u, beta_a = _inputs(11, dtype=np.float32)
  with pytest.raises(ValueError, match=r'poses \[N, I, 4, 4\]'):
    pallas_em.route_windows(poses[:, :-1], acts, weights, beta_u, beta_a)
  with pytest.raises(ValueError, match='power of two'):
    pallas_em.route_windows(poses, acts, weights, beta_u, beta_a,
                            child_chunk=6)
  with pytest.raises(ValueError, match='on its own'):
    pallas_em.route_windows(poses, acts, weights, beta_u, beta_a,
                            normalize_across_positions=True)
  conv_poses = np.zeros((1, 5, 5, 2, 4, 4), np.float32)
  conv_acts = np.ones((1, 5, 5, 2), np.float32)
  w, bu, ba = (np.asarray(x, np.float32) for x in _layer_params())
  with pytest.raises(ValueError,
                     match="implementation='pallas'.*couples the windows"):
    kernels.conv_capsule_routing(
        conv_poses, conv_acts, w, bu, ba, stride=2, implementation='pallas',
        normalize_across_positions=True)
  with pytest.raises(ValueError, match="'xla', 'native', 'pallas'"):
    kernels.conv_capsule_routing(
        conv_poses, conv_acts, w, bu, ba, stride=2, implementation='triton')
  # The layers take it through, and never pick it themselves.
  layer = layers.ConvCapsules(2, 3, implementation='pallas', rngs=nnx.Rngs(0))
  assert layer.implementation == 'pallas'
  hlo = jax.jit(lambda p, a: layers.ConvCapsules(2, 3, rngs=nnx.Rngs(0))(
      p, a)).lower(conv_poses, conv_acts).as_text()
  assert 'em_conv_windows' not in hlo


def test_benchmark_runs_tiny_on_the_cpu(tmp_path):
  out = tmp_path / 'rows.jsonl'
  em_kernels.main(['--tiny', '--layers=convcaps2', '--impls=pallas',
                   f'--output={out}'])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r['layer'], r['batch_size'], r['impl'], r['steps']) for r in rows
          ] == [('convcaps2', 1, 'pallas', 1)]
  assert all(r['ms_per_call'] > 0 and r['windows'] == 9 for r in rows)
