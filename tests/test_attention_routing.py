"""Tests for capsjax.routing.attention (and its counts in capsjax.flops).

The references below are float64 NumPy transcriptions of the authors' code,
in their layouts; they do not call the library:
- Efficient-CapsNet (EscVM/Efficient-CapsNet, utils/layers.py): Squash.call
  and FCCaps.call, u [batch, O, I, D], b [O, I, 1];
- inverted dot-product attention routing (apple/ml-capsules-inverted-
  attention-routing, src/layers.py): CapsuleFC.forward, called num_routing
  times as src/capsule_model.py does, votes [batch, n = I, m = O, d].
Shapes: B batch, I input capsules, O output capsules, D capsule dimension.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from capsjax import flops
from capsjax.routing import attention as ar

DIMS = chex.Dimensions(B=2, I=5, O=3, D=4)
BATCH_SHAPES = [(), (2,), (2, 3)]
ITERATIONS = [1, 2, 3, 5]
# float64 against the float64 reference: the same formulas, rounding apart
# (the norm floor moves O(1) lengths by 1e-13).
F64 = dict(rtol=1e-10, atol=1e-12)
# float32 against the float64 reference, after up to 5 iterations.
F32 = dict(rtol=1e-5, atol=1e-6)

# ----------------------------------------------------------------------------
# float64 NumPy references.


def np_softmax(x, axis):
  e = np.exp(x - np.max(x, axis=axis, keepdims=True))
  return e / np.sum(e, axis=axis, keepdims=True)


def np_efficient_squash(s):
  """Squash.call: (1 - 1 / (exp(n) + eps)) * s / (n + eps), eps = 10e-21."""
  eps = 10e-21
  n = np.linalg.norm(s, axis=-1, keepdims=True)
  return (1 - 1 / (np.exp(n) + eps)) * (s / (n + eps))


def np_self_attention_routing(votes, priors=None):
  """FCCaps.call from the votes on; returns v [..., O, D] and c + b [..., I, O]."""
  u = np.moveaxis(np.asarray(votes, np.float64), -2, -3)  # [..., O, I, D]
  dim = u.shape[-1]
  # The full I x I attention matrix of each output capsule, summed over k.
  c = np.einsum('...ij,...kj->...ik', u, u).sum(-1)[..., None]  # [..., O, I, 1]
  c = c / np.sqrt(dim)
  c = np_softmax(c, axis=-3)  # axis 1 of [batch, O, I, 1]: the outputs
  if priors is not None:
    c = c + np.asarray(priors, np.float64).T[..., None]  # b: [O, I, 1]
  s = np.sum(u * c, axis=-2)
  return np_efficient_squash(s), np.moveaxis(c[..., 0], -1, -2)


def np_layer_norm(x, gamma, beta, eps=1e-5):
  """torch.nn.LayerNorm over the last axis (biased variance)."""
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * gamma + beta


def np_inverted_routing(votes, num_routing, layer_norm=True, gamma=1.0,
                        beta=0.0, scale_agreement=True):
  """CapsuleFC.forward (vector poses, no dropout), once without and then
  num_routing - 1 times with the previous poses; returns the poses
  [..., m, d] and the last query_key [..., n, m]."""
  votes = np.asarray(votes, np.float64)
  n, m, d = votes.shape[-3:]
  scale = 1.0 / d**0.5 if scale_agreement else 1.0

  def act(value):
    return np_layer_norm(value, gamma, beta) if layer_norm else value

  query_key = np_softmax(np.zeros((n, m)), axis=1)
  value = act(np.einsum('nm,...nmd->...md', query_key, votes))
  query_key = np.broadcast_to(query_key, votes.shape[:-1])
  for _ in range(num_routing - 1):
    query_key = np.einsum('...nmd,...md->...nm', votes, value) * scale
    query_key = np_softmax(query_key, axis=-1)
    query_key = query_key / (np.sum(query_key, -1, keepdims=True) + 1e-10)
    value = act(np.einsum('...nm,...nmd->...md', query_key, votes))
  return value, query_key


# ----------------------------------------------------------------------------
# Inputs and runners.


def random_normal(seed, shape, scale=1.0):
  return scale * np.random.default_rng(seed).standard_normal(shape)


def random_votes(seed, batch_shape=(), num_in=5, num_out=3, dim=4):
  return random_normal(seed, batch_shape + (num_in, num_out, dim))


def run(fn, args, dtype):
  """jit(fn)(*args) with every float argument cast to ``dtype``; float64
  under jax_enable_x64. Returns NumPy arrays."""
  with jax.enable_x64(dtype == np.float64):
    # Cast by NumPy: the same rounding, without a compiled conversion for
    # each argument.
    cast = jax.tree.map(lambda x: np.asarray(x, dtype), args)
    return jax.tree.map(np.asarray, jax.jit(fn)(*cast))


PRIORS = 0.1 * random_normal(1, (DIMS.I, DIMS.O))
GAMMA = 1.0 + 0.3 * random_normal(2, (DIMS.D,))
BETA = 0.2 * random_normal(3, (DIMS.D,))
# (layer_norm, affine, scale_agreement) at T = 3; each differs from default.
INVERTED_VARIANTS = [(False, False, True), (True, True, True),
                     (True, False, False), (False, False, False)]

# XLA compilation dominates: each sweep runs all its cases in one program.


def _self_attention_cases(all_votes, priors):
  return [(ar.self_attention_routing(v), ar.self_attention_routing(v, priors))
          for v in all_votes]


def _inverted_cases(all_votes, variant_votes, gamma, beta):
  default = [[ar.inverted_dot_product_routing(v, t) for t in ITERATIONS]
             for v in all_votes]
  variants = [ar.inverted_dot_product_routing(
      variant_votes, 3, layer_norm=layer_norm,
      scale=gamma if affine else None, offset=beta if affine else None,
      scale_agreement=scale_agreement)
              for layer_norm, affine, scale_agreement in INVERTED_VARIANTS]
  return default, variants


@functools.cache
def sweeps(dtype):
  votes = [random_votes(4 + k, shape) for k, shape in enumerate(BATCH_SHAPES)]
  variant_votes = random_votes(9, (DIMS.B,))
  return (votes, variant_votes,
          run(_self_attention_cases, (votes, PRIORS), dtype),
          run(_inverted_cases, (votes, variant_votes, GAMMA, BETA), dtype))


DTYPES = [pytest.param(np.float64, id='float64'),
          pytest.param(np.float32, id='float32')]


def _tolerance(dtype):
  return F64 if dtype == np.float64 else F32


# ----------------------------------------------------------------------------
# efficient_squash.


@pytest.mark.parametrize('dtype', DTYPES)
def test_efficient_squash_matches_reference(dtype):
  s = random_normal(0, (3, 4, 5))
  s[0, 0] = 0.0
  out = run(ar.efficient_squash, (s,), dtype)
  assert out.dtype == dtype
  chex.assert_shape(out, s.shape)
  np.testing.assert_allclose(out, np_efficient_squash(s), **_tolerance(dtype))
  # Along another axis.
  out = run(functools.partial(ar.efficient_squash, axis=1),
            (np.moveaxis(s, -1, 1),), dtype)
  np.testing.assert_allclose(np.moveaxis(out, 1, -1), np_efficient_squash(s),
                             **_tolerance(dtype))


def test_efficient_squash_length_and_direction():
  s = np.concatenate([random_normal(1, (6, 8)),
                      1e-3 * random_normal(2, (2, 8)),
                      300.0 * random_normal(3, (2, 8))])
  out = run(ar.efficient_squash, (s,), np.float64)
  norm = np.linalg.norm(s, axis=-1)
  length = np.linalg.norm(out, axis=-1)
  # The norm floor (1e-12 under the root) shortens a vector of length n by
  # about 2.5e-13 / n relative: 1.6e-10 at n = 1.5e-3.
  np.testing.assert_allclose(length, -np.expm1(-norm), rtol=1e-9)
  np.testing.assert_allclose(length[:6], -np.expm1(-norm[:6]), rtol=1e-12)
  # Below 1 where float64 can tell 1 - exp(-n) from 1.
  assert np.all(length <= 1.0) and np.all(length[:8] < 1.0)
  np.testing.assert_allclose(np.sum(out * s, -1), length * norm, rtol=1e-12)


@jax.jit
def _squash_and_jacobian(s):
  """efficient_squash(s) and its float32 Jacobian, one compiled program."""
  return ar.efficient_squash(s), jax.jacobian(
      lambda s: ar.efficient_squash(s).astype(jnp.float32))(s)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_efficient_squash_zero_and_long_vectors_finite_gradients(dtype):
  """The authors' form has 0/0 in the gradient at s = 0 and inf/inf where
  exp(|s|) overflows float32 (|s| > 89); the gradient at 0 is the identity."""
  s = np.asarray(np.stack([np.zeros(4), [100.0, 0, 0, 0], [1e6, -1e6, 0, 0]]),
                 dtype)
  out, jacobian = _squash_and_jacobian(s)
  out, jacobian = np.asarray(out), np.asarray(jacobian)
  assert out.dtype == dtype
  np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)
  np.testing.assert_allclose(np.asarray(out[1:], np.float32),
                             np.asarray(s[1:], np.float32)
                             / np.linalg.norm(np.asarray(s[1:], np.float32),
                                              axis=-1, keepdims=True),
                             rtol=1e-2)
  assert np.all(np.isfinite(np.asarray(jacobian, np.float32)))
  np.testing.assert_allclose(np.asarray(jacobian[0, :, 0], np.float32),
                             np.eye(4), atol=1e-5)


def test_efficient_squash_check_grads():
  s = random_normal(5, (3, 4))
  with jax.enable_x64(True):
    check_grads(jax.jit(ar.efficient_squash), (jnp.asarray(s),), order=2,
                modes=['fwd', 'rev'])


# ----------------------------------------------------------------------------
# Against the references.


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('index', range(len(BATCH_SHAPES)))
def test_self_attention_routing_matches_reference(index, dtype):
  batch_shape = BATCH_SHAPES[index]
  all_votes, _, results, _ = sweeps(dtype)
  votes = all_votes[index]
  for (outputs, coupling), priors in zip(results[index], (None, PRIORS),
                                         strict=True):
    chex.assert_shape(outputs, batch_shape + DIMS['OD'])
    chex.assert_shape(coupling, batch_shape + DIMS['IO'])
    assert outputs.dtype == coupling.dtype == dtype
    ref = np_self_attention_routing(votes, priors)
    chex.assert_trees_all_close((outputs, coupling), ref, **_tolerance(dtype))
    assert np.all(np.linalg.norm(outputs, axis=-1) < 1.0)
  # The priors add to the couplings after the softmax: exactly B apart.
  np.testing.assert_allclose(results[index][1][1] - results[index][0][1],
                             np.broadcast_to(PRIORS, batch_shape + DIMS['IO']),
                             rtol=1e-5, atol=1e-6)
  # Without priors each input's couplings sum to 1 over the outputs, and
  # they are not uniform on these votes.
  coupling = results[index][0][1]
  np.testing.assert_allclose(coupling.sum(-1), 1.0, rtol=1e-6)
  assert np.max(np.abs(coupling - 1.0 / DIMS.O)) > 1e-2


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('index', range(len(BATCH_SHAPES)))
def test_inverted_routing_matches_reference(index, dtype):
  batch_shape = BATCH_SHAPES[index]
  all_votes, _, _, (results, _) = sweeps(dtype)
  votes = all_votes[index]
  for num_iterations, (poses, coupling) in zip(ITERATIONS, results[index],
                                               strict=True):
    chex.assert_shape(poses, batch_shape + DIMS['OD'])
    chex.assert_shape(coupling, batch_shape + DIMS['IO'])
    assert poses.dtype == coupling.dtype == dtype
    ref = np_inverted_routing(votes, num_iterations)
    chex.assert_trees_all_close((poses, coupling), ref, **_tolerance(dtype))
    np.testing.assert_allclose(coupling.sum(-1), 1.0, rtol=1e-6)
    if num_iterations == 1:
      np.testing.assert_array_equal(coupling, dtype(1.0 / DIMS.O))
    else:
      assert np.max(np.abs(coupling - 1.0 / DIMS.O)) > 1e-2
    # LayerNorm without affine: each pose has mean 0 and variance
    # var / (var + 1e-5).
    np.testing.assert_allclose(poses.mean(-1), 0.0, atol=1e-6)
    np.testing.assert_allclose(poses.var(-1), 1.0, rtol=1e-3)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('index', range(len(INVERTED_VARIANTS)))
def test_inverted_routing_variants_match_reference(index, dtype):
  layer_norm, affine, scale_agreement = INVERTED_VARIANTS[index]
  _, votes, _, (_, results) = sweeps(dtype)
  options = dict(layer_norm=layer_norm, scale_agreement=scale_agreement)
  if affine:
    options.update(gamma=GAMMA, beta=BETA)
  ref = np_inverted_routing(votes, 3, **options)
  chex.assert_trees_all_close(results[index], ref, **_tolerance(dtype))
  # The options matter on these inputs, so the comparison is not vacuous.
  default = np_inverted_routing(votes, 3)
  assert max(np.max(np.abs(a - b))
             for a, b in zip(ref, default, strict=True)) > 1e-3


# ----------------------------------------------------------------------------
# jit, vmap, grad.


def _both(votes, priors, gamma, beta):
  return (ar.self_attention_routing(votes, priors),
          ar.inverted_dot_product_routing(votes, 3, scale=gamma, offset=beta))


def test_vmap_equals_loop_and_eager():
  votes = random_votes(10, (4,)).astype(np.float32)
  args = tuple(np.asarray(x, np.float32) for x in (PRIORS, GAMMA, BETA))
  mapped = jax.jit(jax.vmap(_both, in_axes=(0, None, None, None)))(votes,
                                                                    *args)
  single = jax.jit(_both)
  looped = [single(v, *args) for v in votes]
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *looped)
  chex.assert_trees_all_close(mapped, stacked, rtol=1e-6, atol=1e-7)
  # A leading batch axis is the same as vmap, and eager the same as jit.
  chex.assert_trees_all_close(jax.jit(_both)(votes, *args), mapped,
                              rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(_both(votes[0], *args), looped[0], rtol=1e-6,
                              atol=1e-7)


def _weighted_loss(votes, priors, gamma, beta, weights):
  outputs = jax.tree.leaves(_both(votes, priors, gamma, beta))
  return sum(jnp.sum(x * w) for x, w in zip(outputs, weights, strict=True))


def test_gradients_match_finite_differences():
  """float64 autodiff against central differences of a few entries of every
  argument, through every iteration."""
  args = (random_votes(11, (2,)), PRIORS, GAMMA, BETA)
  shapes = [(2,) + DIMS['OD'], (2,) + DIMS['IO']] * 2
  weights = [random_normal(12 + k, shape) for k, shape in enumerate(shapes)]
  step = 1e-6
  with jax.enable_x64(True):
    loss = jax.jit(functools.partial(_weighted_loss, weights=weights))
    grads = jax.tree.map(np.asarray,
                         jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args))
    entries = [(0, (0, 1, 2, 3)), (0, (1, 4, 0, 0)), (0, (0, 2, 1, 2)),
               (1, (3, 1)), (1, (0, 2)), (2, (1,)), (3, (2,))]
    for argnum, index in entries:
      plus, minus = list(args), list(args)
      plus[argnum], minus[argnum] = args[argnum].copy(), args[argnum].copy()
      plus[argnum][index] += step
      minus[argnum][index] -= step
      # float64 NumPy scalars: the same difference, not compiled op by op.
      numeric = (np.asarray(loss(*plus)) - np.asarray(loss(*minus))) / (
          2 * step)
      np.testing.assert_allclose(grads[argnum][index], numeric, rtol=1e-6,
                                 atol=1e-8, err_msg=f'{argnum} {index}')
    for grad, arg in zip(grads, args, strict=True):
      chex.assert_shape(grad, arg.shape)
      assert grad.dtype == jnp.float64


# ----------------------------------------------------------------------------
# Degenerate inputs: values and gradients stay finite.

DEGENERATE_CASES = ['zero', 'identical', 'scale_1e6', 'scale_1e-20']


def _degenerate_votes(case):
  votes = random_votes(13, (DIMS.B,))
  if case == 'zero':
    return np.zeros_like(votes)
  if case == 'identical':
    return np.full_like(votes, 0.7)
  if case == 'single_input':
    return votes[:, :1]
  return float(case.split('_')[1]) * votes


def _degenerate_loss(groups):
  total, values = 0.0, []
  for votes, priors, gamma, beta in groups:
    outs = jax.tree.leaves(_both(votes, priors, gamma, beta))
    outs.append(ar.inverted_dot_product_routing(votes, 2, layer_norm=False)[0])
    total += sum(jnp.sum(x.astype(jnp.float32) * w)
                 for x, w in zip(outs, (1.0, 2.0, 1.0, 3.0, 1.0),
                                 strict=True))
    values.append(outs)
  return total, values


_degenerate_grads = jax.jit(jax.grad(_degenerate_loss, has_aux=True))


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_finite_on_degenerate_inputs(dtype):
  """Zero votes, identical votes, one input capsule, votes of 1e6 and 1e-20
  scale: finite outputs and gradients with respect to every argument."""
  stacked = np.stack([_degenerate_votes(case) for case in DEGENERATE_CASES])
  single = _degenerate_votes('single_input')
  groups = [tuple(np.asarray(x, dtype) for x in (
      votes, PRIORS[:votes.shape[-3]], GAMMA, BETA))
            for votes in (stacked, single)]
  grads, values = jax.tree.map(np.asarray, _degenerate_grads(groups))
  names = ['self-attention outputs', 'self-attention coupling',
           'inverted poses', 'inverted coupling', 'inverted poses, no norm']
  for group_values, group_grads, group, cases in zip(
      values, grads, groups, [DEGENERATE_CASES, ['single_input']],
      strict=True):
    for name, value in zip(names, group_values, strict=True):
      value = np.asarray(value, np.float32)
      for k, case in enumerate(cases):
        per_case = value[k] if len(cases) > 1 else value
        assert np.all(np.isfinite(per_case)), f'{case}: {name} not finite'
    for name, grad, arg in zip(['votes', 'priors', 'scale', 'offset'],
                               group_grads, group, strict=True):
      assert grad.dtype == arg.dtype
      finite = np.isfinite(np.asarray(grad, np.float32))
      if name == 'votes' and len(cases) > 1:
        for k, case in enumerate(cases):
          assert np.all(finite[k]), f'{case}: d/d{name} not finite'
      else:
        assert np.all(finite), f'{cases}: d/d{name} not finite'
    assert group_values[0].dtype == group_values[2].dtype == dtype
    assert group_values[1].dtype == group_values[3].dtype == jnp.float32
  zero, identical = 0, 1
  sa_out, sa_coupling, inv_poses, inv_coupling, _ = (
      np.asarray(x, np.float32) for x in values[0])
  # Zero votes: s = 0 squashes to 0; the LayerNorm of a zero pose is the
  # offset. Equal agreements: uniform couplings (plus the priors).
  np.testing.assert_array_equal(sa_out[zero], 0.0)
  np.testing.assert_allclose(
      inv_poses[zero],
      np.broadcast_to(np.asarray(groups[0][3], np.float32), DIMS['BOD']),
      rtol=1e-6)
  for case in (zero, identical):
    np.testing.assert_allclose(
        sa_coupling[case],
        np.broadcast_to(1.0 / DIMS.O + np.asarray(groups[0][1], np.float32),
                        DIMS['BIO']), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(inv_coupling[case], 1.0 / DIMS.O, rtol=1e-6)


# ----------------------------------------------------------------------------
# Properties.


def test_permuting_capsules():
  """Permuting the input capsules (and the priors with them) permutes the
  couplings and leaves the outputs alone; permuting the output capsules
  permutes the outputs (every per-output parameter is shared)."""
  votes = random_votes(14, (DIMS.B,))
  ins, outs = np.array([3, 0, 4, 1, 2]), np.array([2, 0, 1])
  args = (votes, votes[:, ins], votes[:, :, outs], PRIORS, PRIORS[ins],
          PRIORS[:, outs], GAMMA, BETA)

  def route(v, v_in, v_out, p, p_in, p_out, gamma, beta):
    return [_both(*x, gamma, beta) for x in ((v, p), (v_in, p_in),
                                             (v_out, p_out))]

  base, by_input, by_output = run(route, args, np.float64)
  for (out, coupling), (out_in, coupling_in), (out_out, coupling_out) in zip(
      base, by_input, by_output, strict=True):
    np.testing.assert_allclose(out_in, out, **F64)
    np.testing.assert_allclose(coupling_in, coupling[:, ins], **F64)
    np.testing.assert_allclose(out_out, out[:, outs], **F64)
    np.testing.assert_allclose(coupling_out, coupling[:, :, outs], **F64)


def test_one_input_capsule_by_hand():
  """With I = 1 the self-attention agreement is |u_o|^2 / sqrt(D), and the
  inverted routing's first pose is LayerNorm(u_o / O)."""
  votes = random_votes(15, (), num_in=1)
  (sa_out, sa_coupling), (inv_poses, _) = run(
      lambda v: (ar.self_attention_routing(v),
                 ar.inverted_dot_product_routing(v, 1)), (votes,), np.float64)
  coupling = np_softmax(np.sum(votes[0] ** 2, -1) / 2.0, axis=-1)
  np.testing.assert_allclose(sa_coupling[0], coupling, **F64)
  s = coupling[:, None] * votes[0]
  length = np.linalg.norm(s, axis=-1, keepdims=True)
  np.testing.assert_allclose(sa_out, (1 - np.exp(-length)) * s / length, **F64)
  pose = votes[0] / 3.0
  centred = pose - pose.mean(-1, keepdims=True)
  np.testing.assert_allclose(
      inv_poses, centred / np.sqrt(np.mean(centred**2, -1, keepdims=True)
                                   + 1e-5), **F64)


def test_pose_layer_norm_keeps_bfloat16_and_computes_wide():
  """bfloat16 poses with float32 affine parameters: bfloat16 out, within
  bfloat16's rounding of the float64 reference (the statistics taken in
  float32, as the routings take theirs)."""
  rng = np.random.default_rng(0)
  poses, scale, offset = (rng.standard_normal(shape) for shape in
                          ((5, 10, 16), (16,), (16,)))
  poses16 = np.asarray(poses, jnp.bfloat16)
  out = jax.jit(ar.pose_layer_norm)(poses16, np.asarray(scale, np.float32),
                                    np.asarray(offset, np.float32))
  assert out.dtype == jnp.bfloat16
  rounded = np.asarray(poses16, np.float64)
  centred = rounded - rounded.mean(-1, keepdims=True)
  expected = (centred / np.sqrt((centred**2).mean(-1, keepdims=True) +
                                ar.LAYER_NORM_EPSILON) * scale + offset)
  np.testing.assert_allclose(np.asarray(out, np.float64), expected,
                             rtol=2**-7, atol=2**-7)


def test_layer_norm_parameters_without_layer_norm_are_refused():
  votes = np.ones((2, 4, 3, 8), np.float32)
  with pytest.raises(ValueError, match='with layer_norm=False they would be '
                     'ignored'):
    ar.inverted_dot_product_routing(votes, 2, layer_norm=False,
                                    scale=np.ones(8, np.float32))


def test_dimension_one_skips_layer_norm():
  """The authors' layer leaves D = 1 poses unnormalised (their LayerNorm of a
  scalar would be the constant offset)."""
  votes = random_votes(16, (DIMS.B,), dim=1)
  poses, coupling = run(lambda v: ar.inverted_dot_product_routing(v, 3),
                        (votes,), np.float64)
  ref = np_inverted_routing(votes, 3, layer_norm=False)
  chex.assert_trees_all_close((poses, coupling), ref, **F64)


def test_bfloat16_outputs_close_to_float32():
  votes = jnp.asarray(random_votes(17, (DIMS.B,)), jnp.bfloat16)
  rounded = np.asarray(votes, np.float32)
  fn = jax.jit(lambda v: _both(v, None, None, None))
  low, high = fn(votes), fn(rounded)
  for (out, coupling), (out32, coupling32) in zip(low, high, strict=True):
    assert out.dtype == jnp.bfloat16 and coupling.dtype == jnp.float32
    # Same (rounded) inputs: only the rounding of the outputs differs.
    np.testing.assert_allclose(np.asarray(out, np.float32), out32,
                               rtol=2.0**-8, atol=2.0**-8)
    np.testing.assert_allclose(coupling, coupling32, rtol=1e-6, atol=1e-7)


def test_bad_arguments_raise_value_error():
  votes = random_votes(18, (DIMS.B,))
  with pytest.raises(ValueError, match='num_iterations'):
    ar.inverted_dot_product_routing(votes, 0)
  with pytest.raises(ValueError, match='num_iterations'):
    ar.inverted_dot_product_routing(votes, 2.0)
  for fn in (ar.self_attention_routing, ar.inverted_dot_product_routing):
    with pytest.raises(ValueError, match='votes'):
      fn(votes[0, 0])  # [O, D]
  with pytest.raises(ValueError):
    # Traced: the shapes are checked without running the routing op by op.
    jax.jit(ar.self_attention_routing)(votes, np.zeros((DIMS.I + 1, DIMS.O)))


# ----------------------------------------------------------------------------
# FLOP counts (capsjax.flops), by hand for I = 2, O = 3, D = 4: IO = 6,
# OD = 12, IOD = 24.


def test_attention_flop_counts():
  assert flops.efficient_squash_flops(3, 4) == (3 * 12 + 12, 6)
  cost = flops.self_attention_routing_cost((5, 2, 3, 4))
  assert cost.flops == 5 * (5 * 24 + 5 * 6 + 48)
  assert cost.transcendentals == 5 * (6 + 6)
  assert cost.bytes == 5 * (24 * 4 + 12 * 4 + 6 * 4)
  assert cost.streaming_bytes == 5 * (3 * 24 * 4 + 12 * 4 + 6 * 4)
  with_priors = flops.self_attention_routing_cost((5, 2, 3, 4),
                                                  log_priors=True)
  assert with_priors.flops == cost.flops + 5 * 6
  assert with_priors.bytes == cost.bytes + 6 * 4
  # T = 3: 3 pose updates of 48 + LayerNorm (5 * 12 + 9), 2 routing updates
  # of 48 + 42 + 2.
  cost = flops.inverted_dot_product_routing_cost((5, 2, 3, 4), 3)
  assert cost.flops == 5 * (3 * (48 + 69) + 2 * (48 + 42 + 2))
  assert cost.transcendentals == 5 * (3 * 3 + 2 * 6)
  assert cost.streaming_bytes == cost.bytes + 4 * 5 * 24 * 4
  affine = flops.inverted_dot_product_routing_cost((5, 2, 3, 4), 3,
                                                   affine=True)
  assert affine.flops == cost.flops + 5 * 3 * 24
  bare = flops.inverted_dot_product_routing_cost((5, 2, 3, 4), 1,
                                                 layer_norm=False)
  assert bare.flops == 5 * 48 and bare.transcendentals == 0
  backward = flops.inverted_dot_product_routing_cost((5, 2, 3, 4), 3,
                                                     backward=True)
  assert backward.flops == 3 * cost.flops
  assert backward.bytes == 2 * cost.bytes
  with pytest.raises(ValueError, match='num_iterations'):
    flops.inverted_dot_product_routing_cost((2, 3, 4), 0)


def test_attention_flop_counts_near_xla():
  """Close to XLA's own count (within 4% here, with no backward pass and
  no shared subexpressions to count differently: flops.py's docstring)."""
  votes = jnp.zeros((8, 32, 10, 16), jnp.float32)
  for fn, cost in [
      (ar.self_attention_routing,
       flops.self_attention_routing_cost(votes.shape)),
      (lambda v: ar.inverted_dot_product_routing(v, 3),
       flops.inverted_dot_product_routing_cost(votes.shape, 3))]:
    analysis = jax.jit(fn).lower(votes).compile().cost_analysis()
    if isinstance(analysis, list):
      analysis = analysis[0]
    assert 0.8 < analysis['flops'] / cost.flops < 1.25
    assert 0.8 < analysis['transcendentals'] / cost.transcendentals < 1.25
