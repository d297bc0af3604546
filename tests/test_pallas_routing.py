"""Tests for capsjax.kernels.pallas_dynamic: dynamic routing as fused Pallas kernels.

The kernels run in Pallas' interpreter on the CPU. Values are checked
against a float64 NumPy transcription of Procedure 1 (Sabour et al. 2017)
written here, loop by loop, from the paper and the options' definitions;
gradients against ``jax.grad`` of ``routing.dynamic_routing`` and a central
difference of that NumPy reference. A lowering test exports every kernel
for CUDA and checks that it becomes a Triton call. Shapes are small (the
interpreter is slow) but cover a masked tail block of input capsules (I = 7
in blocks of 4) and O, D that are not powers of two (3 and 5).
"""

import functools
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import kernel_bench
from benchmarks import routing_kernels
from capsjax import kernels
from capsjax import layers
from capsjax import routing
from capsjax.kernels import pallas_dynamic

# Interpreted on purpose here: the warning that says so is tested once.
pytestmark = pytest.mark.filterwarnings(
    "ignore:implementation='pallas' without a GPU")

BLOCK = 4
SHAPE = (2, 7, 3, 5)  # [B, I, O, D]

# (name, num_iterations, options, with bias): every option of Procedure 1's
# variants, and the 1- and 2-iteration paths.
VARIANTS = {
    'paper': (3, {}, False),
    'leaky_bias': (3, {'leaky': True}, True),
    'su_2018': (3, {'accumulate': False, 'squash_constant': 0.5,
                    'normalize_agreement': True}, True),
    'normalized_leaky_2': (2, {'leaky': True, 'normalize_agreement': True},
                           True),
    'one_iteration': (1, {'leaky': True}, True),
}


# ----------------------------------------------------------------------------
# float64 NumPy reference (Procedure 1, one example and one input capsule at
# a time).


def np_squash(s, constant=1.0):
  """|s|^2 / (constant + |s|^2) * s / |s| (0 at s = 0)."""
  squared = float(s @ s)
  if squared == 0.0:
    return np.zeros_like(s)
  return squared / (constant + squared) * s / np.sqrt(squared)


def np_route_example(u, num_iterations, accumulate=True, leaky=False,
                     squash_constant=1.0, bias=None,
                     normalize_agreement=False):
  """u: [I, O, D] -> (v [O, D], c [I, O])."""
  num_in, num_out, _ = u.shape
  b = np.zeros((num_in, num_out))
  for r in range(num_iterations):
    c = np.zeros((num_in, num_out))
    for i in range(num_in):
      # Softmax over the outputs; leaky: an extra logit fixed at 0.
      logits = np.concatenate([[0.0], b[i]]) if leaky else b[i]
      e = np.exp(logits - logits.max())
      c[i] = (e / e.sum())[1:] if leaky else e / e.sum()
    s = np.einsum('io,iod->od', c, u)
    if bias is not None:
      s = s + bias
    v = np.stack([np_squash(s_j, squash_constant) for s_j in s])
    if r == num_iterations - 1:
      return v, c
    target = v
    if normalize_agreement:
      target = s / np.linalg.norm(s, axis=-1, keepdims=True)
    agreement = np.einsum('iod,od->io', u, target)
    b = b + agreement if accumulate else agreement


def np_route(votes, num_iterations, bias=None, **options):
  """votes: [B, I, O, D]; bias [O, D] or None."""
  votes = np.asarray(votes, np.float64)
  results = [np_route_example(u, num_iterations, bias=bias, **options)
             for u in votes]
  return tuple(np.stack(r) for r in zip(*results, strict=True))


def inputs(variant, shape=SHAPE, dtype=np.float64):
  num_iterations, options, with_bias = VARIANTS[variant]
  rng = np.random.default_rng(sorted(VARIANTS).index(variant))
  votes = rng.standard_normal(shape).astype(dtype)
  bias = (0.3 * rng.standard_normal(shape[-2:])).astype(dtype) if with_bias \
      else None
  # Weights of a scalar loss of both results: the coupling is differentiated
  # too (models return it).
  out_weights = rng.standard_normal(shape[:-3] + shape[-2:]).astype(dtype)
  coupling_weights = rng.standard_normal(shape[:-1]).astype(dtype)
  return num_iterations, options, votes, bias, (out_weights, coupling_weights)


def loss(route, votes, bias, weights, num_iterations, options):
  outputs, coupling = route(votes, num_iterations, bias=bias, **options)
  out_weights, coupling_weights = weights
  return (jnp.sum(outputs.astype(coupling.dtype) * out_weights)
          + jnp.sum(coupling * coupling_weights)), (outputs, coupling)


PALLAS = functools.partial(pallas_dynamic.dynamic_routing,
                           block_inputs=BLOCK)


@functools.cache
def value_and_grad(route, num_iterations, options_items, with_bias):
  """jit(value_and_grad) of ``loss`` wrt the votes (and the bias)."""
  argnums = (0, 1) if with_bias else (0,)
  return jax.jit(jax.value_and_grad(
      lambda v, b, w: loss(route, v, b, w, num_iterations,
                           dict(options_items)),
      argnums=argnums, has_aux=True))


# ----------------------------------------------------------------------------
# Values and gradients, float64 (the kernels compute in the votes' dtype).


# leaky_bias runs in float32 below (its options also run here, with
# normalize_agreement, in normalized_leaky_2).
@pytest.mark.parametrize('variant', ['paper', 'su_2018', 'normalized_leaky_2',
                                     'one_iteration'])
def test_float64_values_and_gradients(variant):
  num_iterations, options, votes, bias, weights = inputs(variant)
  key = (num_iterations, tuple(sorted(options.items())), bias is not None)
  with jax.enable_x64(True):
    (total, (outputs, coupling)), grads = value_and_grad(PALLAS, *key)(
        votes, bias, weights)
    _, xla_grads = value_and_grad(routing.dynamic_routing, *key)(
        votes, bias, weights)
    assert outputs.dtype == coupling.dtype == jnp.float64
    # NumPy from here: float64 JAX arrays outside x64 would be truncated.
    total, outputs, coupling, grads, xla_grads = jax.tree.map(
        np.asarray, (total, outputs, coupling, grads, xla_grads))
  ref_outputs, ref_coupling = np_route(votes, num_iterations, bias, **options)
  np.testing.assert_allclose(outputs, ref_outputs, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(coupling, ref_coupling, rtol=1e-10, atol=1e-12)
  for grad, xla_grad in zip(grads, xla_grads, strict=True):
    np.testing.assert_allclose(grad, xla_grad, rtol=1e-9, atol=1e-11)

  # The reference's own derivative along a random direction (independent of
  # JAX's autodiff): central difference against <grad, direction>.
  def np_loss(v, b):
    out, c = np_route(v, num_iterations, b, **options)
    return np.sum(out * weights[0]) + np.sum(c * weights[1])

  rng = np.random.default_rng(99)
  step = 1e-6
  dv = rng.standard_normal(votes.shape)
  db = None if bias is None else rng.standard_normal(bias.shape)
  plus = np_loss(votes + step * dv, None if bias is None else bias + step * db)
  minus = np_loss(votes - step * dv, None if bias is None else bias - step * db)
  directional = float(np.sum(grads[0] * dv))
  if bias is not None:
    directional += float(np.sum(grads[1] * db))
  np.testing.assert_allclose(directional, (plus - minus) / (2 * step),
                             rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(total, np_loss(votes, bias), rtol=1e-10)


# ----------------------------------------------------------------------------
# float32 and bfloat16, leading batch dims, kernels.dynamic_routing's
# implementation.


def _through_impl(votes, num_iterations, **options):
  return kernels.dynamic_routing(votes, num_iterations,
                                 implementation='pallas', **options)


def test_float32_leading_dims_through_impl():
  """[2, 2, I, O, D] votes, a bias broadcast over the batch,
  implementation='pallas'
  (default block: one masked block for I = 7)."""
  num_iterations, options, votes, bias, weights = inputs(
      'leaky_bias', (2, 2) + SHAPE[1:], np.float32)
  key = (num_iterations, tuple(sorted(options.items())), True)
  (_, (outputs, coupling)), grads = value_and_grad(_through_impl, *key)(
      votes, bias, weights)
  _, xla_grads = value_and_grad(routing.dynamic_routing, *key)(
      votes, bias, weights)
  assert outputs.shape == (2, 2, 3, 5) and coupling.shape == (2, 2, 7, 3)
  assert outputs.dtype == coupling.dtype == jnp.float32
  ref_outputs, ref_coupling = np_route(votes.reshape((-1,) + SHAPE[1:]),
                                       num_iterations, bias, **options)
  np.testing.assert_allclose(outputs.reshape(ref_outputs.shape), ref_outputs,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(coupling.reshape(ref_coupling.shape),
                             ref_coupling, rtol=1e-5, atol=1e-6)
  for grad, xla_grad in zip(grads, xla_grads, strict=True):
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(grad, xla_grad, rtol=1e-4, atol=1e-5)


def test_bfloat16_votes():
  """bfloat16 votes are routed in float32: outputs and the votes' gradient
  in bfloat16, the coupling float32, as routing.dynamic_routing."""
  num_iterations, options, votes, _, weights = inputs('paper',
                                                      dtype=np.float32)
  votes = jnp.asarray(votes, jnp.bfloat16)
  key = (num_iterations, (), False)
  (_, (outputs, coupling)), (grad,) = value_and_grad(PALLAS, *key)(
      votes, None, weights)
  (_, (xla_outputs, xla_coupling)), (xla_grad,) = value_and_grad(
      routing.dynamic_routing, *key)(votes, None, weights)
  assert outputs.dtype == grad.dtype == jnp.bfloat16
  assert coupling.dtype == jnp.float32
  np.testing.assert_allclose(coupling, xla_coupling, rtol=1e-5, atol=1e-6)
  for mine, xla in ((outputs, xla_outputs), (grad, xla_grad)):
    np.testing.assert_allclose(np.asarray(mine, np.float32),
                               np.asarray(xla, np.float32), rtol=2e-2,
                               atol=2e-2)


# ----------------------------------------------------------------------------
# jit, vmap, grad.


def test_jit_vmap_grad_agree_with_xla():
  """jit(vmap(grad)) over a leading axis equals the XLA routing's gradient
  of the batch (routing is independent per example). Only the outputs are
  differentiated: the coupling's cotangent is a symbolic zero, which the
  backward kernel does not read."""
  _, _, votes, _, (out_weights, _) = inputs('paper', (3,) + SHAPE, np.float32)

  def example_loss(route, v, w):
    return jnp.sum(route(v, 2)[0] * w)  # 2 iterations: a shorter trace

  mapped = jax.jit(jax.vmap(jax.grad(functools.partial(example_loss, PALLAS))))(
      votes, out_weights)
  expected = jax.jit(jax.grad(functools.partial(
      example_loss, routing.dynamic_routing)))(votes, out_weights)
  np.testing.assert_allclose(mapped, expected, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------
# Degenerate inputs.


def _degenerate_votes():
  """Same-shape cases stacked on a leading axis, and one input capsule."""
  rng = np.random.default_rng(18)
  base = rng.standard_normal(SHAPE)
  cases = {'zero': np.zeros(SHAPE), 'identical': np.full(SHAPE, 0.7),
           'huge': 1e15 * base, 'tiny': 1e-20 * base}
  single = base[:, :1]
  return cases, np.stack(list(cases.values())).astype(np.float32), single


def test_degenerate_inputs_finite():
  """Zero, identical, 1e15 and 1e-20 votes and a single input capsule:
  finite values and gradients, values as XLA's. (Leaky, a bias and s / |s|
  in the logits: the options with their own edge cases; 2 iterations, the
  fewest with a logit pass in both directions.)"""
  num_iterations = 2
  options = {'leaky': True, 'normalize_agreement': True}
  bias = np.full(SHAPE[-2:], 0.1, np.float32)
  cases, stacked, single = _degenerate_votes()

  def total(route, v):
    outputs, coupling = route(v, num_iterations, bias=bias, **options)
    return jnp.sum(outputs) + 2.0 * jnp.sum(coupling), (outputs, coupling)

  def run(route):
    grad = jax.grad(total, argnums=1, has_aux=True)
    return jax.jit(lambda s, o: (grad(route, s), grad(route, o)))(
        stacked, single.astype(np.float32))

  results = run(PALLAS)
  xla_results = run(routing.dynamic_routing)
  for (grads, values), (_, xla_values), names in zip(
      results, xla_results, (list(cases), ['single']), strict=True):
    for array in (grads,) + values:
      finite = np.isfinite(np.asarray(array)).reshape(len(names), -1)
      bad = [name for name, ok in zip(names, finite.all(-1), strict=True)
             if not ok]
      assert not bad, f'not finite: {bad}'
    for mine, xla in zip(values, xla_values, strict=True):
      np.testing.assert_allclose(mine, xla, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------
# The CUDA lowering: every kernel becomes a Triton call.

TRITON_CALL = '__gpu$xla.gpu.triton'


@pytest.mark.parametrize('shape,dtype,variant', [
    ((4, 1152, 10, 16), jnp.float32, 'paper'),  # the paper's DigitCaps
    ((2, 1000, 10, 16), jnp.bfloat16, 'leaky_bias'),  # I % 16 = 8
    ((2, 7, 3, 5), jnp.float32, 'su_2018'),
])
def test_kernels_lower_to_triton_for_cuda(shape, dtype, variant):
  """Forward and backward (with and without the coupling's cotangent)
  lower for CUDA through Pallas' Triton backend: one Triton custom call per
  kernel. (The Triton IR is compiled to PTX by XLA on a GPU, not here.)"""
  num_iterations, options, *_ = inputs(variant, shape)
  route = functools.partial(pallas_dynamic.dynamic_routing,
                            interpret=False, **options)
  bias = jnp.zeros(shape[-2:], jnp.float32) if VARIANTS[variant][2] else None

  def with_coupling(v):
    outputs, coupling = route(v, num_iterations, bias=bias)
    return jnp.sum(outputs.astype(jnp.float32)) + jnp.sum(coupling)

  def without_coupling(v):
    return jnp.sum(route(v, num_iterations, bias=bias)[0].astype(jnp.float32))

  def forward(v):
    return route(v, num_iterations, bias=bias)

  abstract_votes = jax.ShapeDtypeStruct(shape, dtype)
  for fn, calls in ((forward, 1), (jax.grad(with_coupling), 2),
                    (jax.grad(without_coupling), 2)):
    exported = jax.export.export(
        jax.jit(fn), platforms=['cuda'],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
            TRITON_CALL)])(abstract_votes)
    assert exported.mlir_module().count(TRITON_CALL) == calls


# ----------------------------------------------------------------------------
# Arguments.


def test_bad_arguments_and_empty_batch():
  votes = np.zeros(SHAPE, np.float32)
  with pytest.raises(ValueError, match="implementation must be None .* "
                     r"\('xla', 'pallas'\)"):
    kernels.dynamic_routing(votes, 3, implementation='triton')
  with pytest.raises(ValueError, match='block_inputs must be a power of two'):
    pallas_dynamic.dynamic_routing(votes, 3, block_inputs=24)
  with pytest.raises(ValueError, match='num_iterations'):
    pallas_dynamic.dynamic_routing(votes, 0)
  with pytest.raises(ValueError, match='votes must be'):
    pallas_dynamic.dynamic_routing(votes[0, 0], 3)
  # No example: no kernel to launch (a grid of no programs).
  outputs, coupling = pallas_dynamic.dynamic_routing(votes[:0], 3)
  assert outputs.shape == (0, 3, 5) and coupling.shape == (0, 7, 3)


def test_dense_capsules_implementation():
  """The layer's implementation reaches kernels.dynamic_routing (traced
  only: the kernels' values are tested above)."""
  def jaxpr(impl):
    layer = layers.DenseCapsules(7, 4, 3, 5, implementation=impl,
                                 rngs=nnx.Rngs(params=0))
    return str(jax.make_jaxpr(layer)(jnp.zeros((2, 7, 4))))

  assert 'pallas_call' in jaxpr('pallas')
  assert 'pallas_call' not in jaxpr(None)
  with pytest.raises(ValueError, match='implementation must be None'):
    jaxpr('cuda')


# ----------------------------------------------------------------------------
# The benchmark command, at a tiny size.


def test_benchmark_runs_tiny(tmp_path, capsys):
  output = tmp_path / 'rows.jsonl'
  routing_kernels.main(['--tiny', '--num_iterations=2', f'--output={output}'])
  rows = [json.loads(line) for line in output.read_text().splitlines()]
  assert [(r['impl'], r['block_inputs']) for r in rows] == [('xla', None),
                                                            ('pallas', 8)]
  for row in rows:
    assert row['votes_shape'] == [1, 20, 10, 16]
    assert row['ms_per_call'] > 0 and row['steps'] == 1
    assert row['compulsory_bytes'] == 2 * 20 * 10 * 16 * 4
  assert 'pallas' in capsys.readouterr().out


def test_paper_kernel_compiles_to_sm80_without_spills(tmp_path):
  # Where the Triton compiler is installed (PyTorch brings it), its build of
  # the forward kernel at the paper's DigitCaps shape for an A100 (sm_80),
  # without a GPU: ptxas says how many registers it takes and that it
  # spills none (``--ptxas=forward,backward`` builds both).
  pytest.importorskip('triton')
  args = routing_kernels.parse_args(['--ptxas=forward'])
  [(_, fn, shapes, name)] = routing_kernels.ptxas_builds(args)
  row = kernel_bench.ptxas_report(fn, shapes, name, 80, str(tmp_path))
  assert (row['kernel'], row['target']) == ('_forward_kernel', 'sm_80')
  assert row['spill_store_bytes'] == 0 and 0 < row['registers'] <= 255


def test_the_paper_configs_select_the_kernels_by_flag():
  """--config.model_options.implementation=pallas reaches a model option
  of that name (a typed key: ml_collections refuses unknown keys), and the
  model routes with the Pallas kernels and convolves with its default."""
  from capsjax import models
  from experiments.configs import capsnet_mnist
  from experiments.configs import matrix_capsnet_mnist
  for module in (capsnet_mnist, matrix_capsnet_mnist):
    for variant in ('', 'smoke'):
      config = module.get_config(variant)
      assert config.model_options.implementation is None
      assert 'implementation' in models.model_options(config.model)
      config.model_options.implementation = 'pallas'
      with pytest.raises(TypeError):
        config.model_options.implementation = 3
  model = models.create_model('capsnet', rngs=nnx.Rngs(0), conv1_channels=8,
                              primary_types=2, reconstruction=False,
                              implementation='pallas')
  assert model.digit.implementation == 'pallas'
  assert model.conv1.implementation is None
  with pytest.raises(ValueError, match="one of capsjax's implementations"):
    models.create_model('capsnet', rngs=nnx.Rngs(0), implementation='cuda')


def test_the_interpreter_is_said_when_no_gpu_chose_it():
  votes = jnp.ones((1, 3, 2, 4))
  if jax.default_backend() == 'gpu':
    # There the kernels compile: nothing to say.
    with warnings.catch_warnings():
      warnings.simplefilter('error')
      np.testing.assert_allclose(
          pallas_dynamic.dynamic_routing(votes, 2)[0],
          routing.dynamic_routing(votes, 2)[0], rtol=1e-5)
    return
  with pytest.warns(UserWarning, match=r"without a GPU runs the Pallas kernels "
                    r"in Pallas' interpreter"):
    pallas_dynamic.dynamic_routing(votes, 2)
