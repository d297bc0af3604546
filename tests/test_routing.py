"""Tests for capsjax.routing.

The references below are float64 NumPy transcriptions of the two papers'
procedures (Sabour et al. 2017, Procedure 1; Hinton et al. 2018, Procedure
1) and of the em_routing docstring for the released-code options; they do
not call the library. Shapes: B batch, I input capsules, O output capsules,
D capsule dimension.
"""

import functools
import math

import chex
import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from capsjax import routing

DIMS = chex.Dimensions(B=2, I=5, O=3, D=4)
BATCH_SHAPES = [(), (2,), (2, 3)]
ITERATIONS = [1, 2, 3, 5]
# float32 statistics against a float64 reference, after up to 5 iterations.
RTOL, ATOL = 1e-4, 1e-5

# ----------------------------------------------------------------------------
# float64 NumPy references.


def np_softmax(x, axis=-1):
  x = x - np.max(x, axis=axis, keepdims=True)
  e = np.exp(x)
  return e / np.sum(e, axis=axis, keepdims=True)


def np_squash(s, constant=1.0):
  """|s|^2 / (constant + |s|^2) * s / |s|, and 0 at s = 0."""
  s = np.asarray(s, np.float64)
  squared = np.sum(s * s, axis=-1, keepdims=True)
  norm = np.sqrt(squared)
  return squared / (constant + squared) * s / np.where(norm > 0, norm, 1.0)


def np_coupling(logits, leaky=False, axis=-1):
  """softmax over ``axis``; leaky: softmax over [0, b_1 .. b_O], first dropped."""
  if not leaky:
    return np_softmax(logits, axis)
  zero = np.zeros(logits.shape[:-1] + (1,))
  return np_softmax(np.concatenate([zero, logits], axis=-1))[..., 1:]


def np_dynamic_routing(votes, num_iterations, accumulate=True, leaky=False,
                       squash_constant=1.0, bias=None, coupling_axis=-1,
                       normalize_agreement=False):
  """Sabour et al. 2017, Procedure 1. coupling_axis=-2 is the softmax-over-inputs bug;
  normalize_agreement: the logits agree with s / |s|, not squash(s)."""
  votes = np.asarray(votes, np.float64)
  logits = np.zeros(votes.shape[:-1])
  for r in range(num_iterations):
    coupling = np_coupling(logits, leaky, coupling_axis)
    s = np.einsum('...io,...iod->...od', coupling, votes)
    if bias is not None:
      s = s + bias
    outputs = np_squash(s, squash_constant)
    if r < num_iterations - 1:
      target = (s / np.linalg.norm(s, axis=-1, keepdims=True)
                if normalize_agreement else outputs)
      agreement = np.einsum('...iod,...od->...io', votes, target)
      logits = logits + agreement if accumulate else agreement
  return outputs, coupling


def np_su_2018_routing(votes, routings):
  """Su's later Capsule layer (bojone/Capsule, Capsule_Keras.py, March 2018),
  transcribed loop for loop in his layout: u_hat [B, O, I, D], b [B, O, I].

      b = 0
      for i in range(routings):
        c = softmax(b, axis=1)                  # over the output capsules
        o = einsum('bin,binj->bij', c, u_hat)   # [B, O, D]
        if i < routings - 1:
          o = l2_normalize(o, -1); b = einsum('bij,binj->bin', o, u_hat)
      return squashing(o)   # |o|^2 + eps: sqrt(n) / (0.5 + n) * o

  Returns the outputs [B, O, D] and the last c in our layout [B, I, O].
  """
  u_hat = np.moveaxis(np.asarray(votes, np.float64), -3, -2)
  b = np.zeros(u_hat.shape[:-1])
  for i in range(routings):
    c = np_softmax(b, axis=1)
    o = np.einsum('bin,binj->bij', c, u_hat)
    if i < routings - 1:
      o = o / np.sqrt(np.maximum(np.sum(o * o, -1, keepdims=True), 1e-12))
      b = np.einsum('bij,binj->bin', o, u_hat)
  squared = np.sum(o * o, -1, keepdims=True) + 1e-7  # Keras' K.epsilon()
  return np.sqrt(squared) / (0.5 + squared) * o, np.moveaxis(c, 1, 2)


def np_em_routing(votes, activations, beta_u, beta_a, num_iterations,
                  inverse_temperature=None, variance_epsilon=1e-4,
                  normalize_cost=False, center_momentum=0.0,
                  activation_form='paper'):
  """Hinton et al. 2018, Procedure 1, with the options of the authors' released code.

  Each option as google-research capsule_em/em_layers.py computes it
  (update_em_routing, read at commit 00895117 for this reference):
  center_momentum: centre = 0.9 * fresh mean + 0.1 * previous centre, the
  previous one starting at 0, and the variance taken around the updated
  centre; the variance floor added, not a max; activation_form='authors':
  logit = lambda * (mass * (-sum_h log var_h - beta_u * 16 * (log 2 pi +
  1)) - 5000 beta_a) (16 = the pose size), no cost normalisation there.
  normalize_cost is the open implementations' (mean - cost) / std (an option, off by
  default). The mass guard is this library's 1e-6 (the authors add 1e-5 in
  the class layer and 1e-7 in conv layers); it only matters for masses near
  0.
  """
  votes = np.asarray(votes, np.float64)
  activations = np.asarray(activations, np.float64)
  beta_u = np.asarray(beta_u, np.float64)
  beta_a = np.asarray(beta_a, np.float64)
  num_out, dim = votes.shape[-2:]
  if inverse_temperature is None:
    lambdas = [0.01 * (1 - 0.95 ** (t + 1)) for t in range(num_iterations)]
  elif np.ndim(inverse_temperature) == 0:
    lambdas = [float(inverse_temperature)] * num_iterations
  else:
    lambdas = [float(x) for x in inverse_temperature]
  assignments = np.full(votes.shape[:-1], 1.0 / num_out)
  mu = np.zeros(votes.shape[:-3] + (num_out, dim))
  for t, lam in enumerate(lambdas):
    used = assignments
    weights = assignments * activations[..., None]  # R_ij a_i
    mass = np.sum(weights, axis=-2)  # [..., O]
    # The docstring's mass epsilon (1e-6) guards 0/0 for all-zero activations.
    denominator = mass[..., None] + 1e-6
    new_mu = np.einsum('...io,...iod->...od', weights, votes) / denominator
    mu = (1 - center_momentum) * new_mu + center_momentum * mu
    diff2 = (votes - mu[..., None, :, :]) ** 2
    var = (np.einsum('...io,...iod->...od', weights, diff2) / denominator
           + variance_epsilon)
    if activation_form == 'paper':
      # cost_h = (beta_u + log sigma_h) sum_i R_ij a_i, summed over h.
      cost = np.sum((beta_u[..., None] + 0.5 * np.log(var)) * mass[..., None],
                    axis=-1)
    else:
      cost = mass * (np.sum(np.log(var), axis=-1)
                     + beta_u * dim * (math.log(2 * math.pi) + 1))
    if normalize_cost:
      cost = ((cost - np.mean(cost, axis=-1, keepdims=True))
              / np.std(cost, axis=-1, keepdims=True))
    if activation_form == 'paper':
      logit = lam * (beta_a - cost)
    else:
      logit = lam * (-cost - 5000.0 * beta_a)
    if t < num_iterations - 1:
      log_a = -np.logaddexp(0.0, -logit)
      log_p = -0.5 * np.sum(diff2 / var[..., None, :, :]
                            + np.log(2 * math.pi * var[..., None, :, :]),
                            axis=-1)
      assignments = np_softmax(log_a[..., None, :] + log_p, axis=-1)
  return mu, 1.0 / (1.0 + np.exp(-logit)), used


# ----------------------------------------------------------------------------
# Inputs.


def random_votes(seed, batch_shape=(), num_in=5, num_out=3, dim=4, scale=1.0):
  rng = np.random.default_rng(seed)
  return (scale * rng.standard_normal(batch_shape + (num_in, num_out, dim))
          ).astype(np.float32)


def random_em_inputs(seed, batch_shape=(), num_in=5, num_out=3, dim=4):
  rng = np.random.default_rng(seed)
  votes = rng.standard_normal(batch_shape + (num_in, num_out, dim))
  activations = rng.uniform(0.1, 1.0, batch_shape + (num_in,))
  beta_u = 0.5 * rng.standard_normal(num_out)
  beta_a = 0.5 * rng.standard_normal(num_out)
  return tuple(x.astype(np.float32)
               for x in (votes, activations, beta_u, beta_a))


# Cached: tests that use the same options and shapes share one compilation
# (XLA compilation dominates the run time of this module).
@functools.cache
def jit_dynamic(num_iterations, **options):
  return jax.jit(functools.partial(routing.dynamic_routing,
                                   num_iterations=num_iterations, **options))


@functools.cache
def jit_em(num_iterations, **options):
  return jax.jit(functools.partial(routing.em_routing,
                                   num_iterations=num_iterations, **options))


# XLA compilation dominates the run time, and one program with many routing
# calls compiles faster than many programs with one each: the sweeps below
# run every case of a parametrized test in one jitted call, cached.


def _numpy(tree):
  """Results as NumPy arrays: arithmetic on them in the checks runs in
  NumPy, not as one small compiled program per operation."""
  return jax.tree.map(np.asarray, tree)


@functools.cache
def dynamic_sweep():
  """dynamic_routing for every (batch shape, iteration count)."""
  votes = [random_votes(4, shape) for shape in BATCH_SHAPES]
  run = jax.jit(lambda all_votes: [
      [routing.dynamic_routing(v, t) for t in ITERATIONS] for v in all_votes])
  return votes, _numpy(run(votes))


@functools.cache
def em_sweep():
  """em_routing for every (batch shape, iteration count)."""
  inputs = [random_em_inputs(13, shape) for shape in BATCH_SHAPES]
  run = jax.jit(lambda all_inputs: [
      [routing.em_routing(*x, t) for t in ITERATIONS] for x in all_inputs])
  return inputs, _numpy(run(inputs))


# ----------------------------------------------------------------------------
# squash and safe_norm.

_squash = jax.jit(routing.squash)
_coupling = jax.jit(routing.coupling_coefficients)
_leaky_coupling = jax.jit(functools.partial(routing.coupling_coefficients,
                                            leaky=True))
_safe_norm = jax.jit(routing.safe_norm, static_argnames=('axis', 'keepdims'))


@pytest.mark.parametrize('constant', [1.0, 0.5])
@pytest.mark.parametrize('axis', [-1, 1])
def test_squash_matches_reference(constant, axis):
  s = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
  s[0, 0] = 0.0
  out = jax.jit(functools.partial(routing.squash, axis=axis,
                                  constant=constant))(s)
  ref = np.moveaxis(np_squash(np.moveaxis(s, axis, -1), constant), -1, axis)
  chex.assert_shape(out, s.shape)
  np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
@hypothesis.given(hnp.arrays(np.float32, (8, 5),
                             elements=st.floats(-1e3, 1e3, width=32)))
def test_squash_length_and_direction(s):
  out = np.asarray(_squash(s))
  length = np.linalg.norm(out, axis=-1)
  norm = np.linalg.norm(s.astype(np.float64), axis=-1)
  assert np.all(np.isfinite(out))
  assert np.all(length >= 0.0) and np.all(length <= 1.0)
  # Strictly below 1 where float32 can represent |s|^2 / (1 + |s|^2) < 1.
  assert np.all(length[norm <= 100.0] < 1.0)
  np.testing.assert_allclose(length, norm**2 / (1.0 + norm**2), rtol=1e-5,
                             atol=1e-7)
  # Same direction: out = k s with k >= 0.
  big = norm > 1e-3
  cosine = np.sum(out[big] * s[big], -1) / (length[big] * norm[big])
  np.testing.assert_allclose(cosine, 1.0, rtol=1e-5)


@jax.jit
def _squash_at_zero(zero, zero32):
  """squash(zero), its gradient and safe_norm's, in one compiled program."""
  weights = jnp.arange(16.0).reshape(2, 8)
  grad = jax.grad(lambda s: jnp.sum(routing.squash(s).astype(jnp.float32)
                                    * weights))(zero)
  norm_grad = jax.grad(lambda s: jnp.sum(routing.safe_norm(s)))(zero32)
  return routing.squash(zero), grad, norm_grad


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_squash_zero_vector_has_zero_value_and_finite_gradient(dtype):
  zero = np.zeros((2, 8), dtype)
  out, grad, norm_grad = _squash_at_zero(zero, np.zeros((2, 8), np.float32))
  assert out.dtype == dtype
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
  assert grad.dtype == dtype
  assert np.all(np.isfinite(np.asarray(grad, np.float32)))
  np.testing.assert_array_equal(norm_grad, 0.0)


def test_integer_inputs_are_refused_not_routed_to_zeros():
  """Every routing returns its votes' dtype: integer votes (np.arange, a
  count) would come back as zeros, so they are refused with the fix."""
  from capsjax.routing import attention as attention_routing
  votes = np.ones((2, 4, 3, 4), np.int32)
  calls = {
      'squash': lambda: routing.squash(votes[:, 0]),
      'dynamic_routing': lambda: routing.dynamic_routing(votes, 2),
      'em_routing': lambda: routing.em_routing(
          votes, np.ones((2, 4)), beta_u=0.0, beta_a=0.0, num_iterations=2),
      'efficient_squash': lambda: attention_routing.efficient_squash(
          votes[:, 0]),
      'self_attention_routing': lambda: (
          attention_routing.self_attention_routing(votes)),
      'inverted_dot_product_routing': lambda: (
          attention_routing.inverted_dot_product_routing(votes, 2)),
      'pose_layer_norm': lambda: attention_routing.pose_layer_norm(
          votes[:, 0]),
  }
  for name, call in calls.items():
    with pytest.raises(TypeError, match='must be floating point .* int32: '
                       'cast it first'):
      call()
    print(name, 'refused')
  # Floating votes of every width still route.
  for dtype in (jnp.bfloat16, jnp.float32):
    outputs, _ = jit_dynamic(2)(votes.astype(dtype))
    assert outputs.dtype == dtype
    assert np.all(np.asarray(outputs, np.float32) > 0)


def test_safe_norm_matches_numpy():
  x = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
  np.testing.assert_allclose(_safe_norm(x), np.linalg.norm(x, axis=-1),
                             rtol=1e-6)
  np.testing.assert_allclose(_safe_norm(x, axis=0, keepdims=True),
                             np.linalg.norm(x, axis=0, keepdims=True),
                             rtol=1e-6)
  np.testing.assert_allclose(_safe_norm(np.zeros(3)), 1e-6)


@pytest.mark.parametrize('constant', [1.0, 0.5])
def test_squash_check_grads(constant):
  s = np.random.default_rng(2).standard_normal((3, 4))
  with jax.enable_x64(True):
    check_grads(jax.jit(functools.partial(routing.squash, constant=constant)),
                (jnp.asarray(s, jnp.float64),), order=1, modes=['fwd', 'rev'])


# ----------------------------------------------------------------------------
# Coupling coefficients.


def test_coupling_normalises_over_outputs_not_inputs():
  logits = np.random.default_rng(3).standard_normal((2, 6, 4)).astype(
      np.float32)
  coupling = np.asarray(_coupling(logits))
  np.testing.assert_allclose(coupling.sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_allclose(coupling, np_coupling(logits), rtol=1e-6)
  # The open-port bug (softmax over inputs) gives a different matrix.
  assert np.max(np.abs(coupling - np_coupling(logits, axis=-2))) > 0.1
  assert np.max(np.abs(coupling.sum(-2) - 1.0)) > 0.1


@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(hnp.arrays(np.float32, (6, 4),
                             elements=st.floats(-10, 10, width=32)))
def test_leaky_coupling_sums_below_one(logits):
  coupling = np.asarray(_leaky_coupling(logits))
  totals = coupling.sum(-1)
  assert np.all(coupling >= 0.0)
  assert np.all(totals < 1.0) and np.all(totals > 0.0)
  np.testing.assert_allclose(coupling, np_coupling(logits, leaky=True),
                             rtol=1e-5, atol=1e-7)


def test_zero_logits_give_uniform_coupling():
  zeros = np.zeros((4, 3), np.float32)
  np.testing.assert_allclose(_coupling(zeros), 1 / 3)
  # The orphan logit takes an equal share.
  np.testing.assert_allclose(_leaky_coupling(zeros), 1 / 4)


# ----------------------------------------------------------------------------
# Dynamic routing against the reference.


@pytest.mark.parametrize('index', range(len(BATCH_SHAPES)))
def test_dynamic_routing_matches_reference(index):
  batch_shape = BATCH_SHAPES[index]
  all_votes, all_results = dynamic_sweep()
  votes, results = all_votes[index], all_results[index]
  for num_iterations, (outputs, coupling) in zip(ITERATIONS, results,
                                                 strict=True):
    ref = np_dynamic_routing(votes, num_iterations)
    chex.assert_shape(outputs, batch_shape + DIMS['OD'])
    chex.assert_shape(coupling, batch_shape + DIMS['IO'])
    chex.assert_trees_all_close((outputs, coupling), ref, rtol=RTOL,
                                atol=ATOL)
    np.testing.assert_allclose(np.sum(coupling, -1), 1.0, rtol=1e-6)
    if num_iterations == 1:
      np.testing.assert_allclose(coupling, 1.0 / DIMS.O, rtol=1e-6)
    else:
      assert np.max(np.abs(coupling - 1.0 / DIMS.O)) > 1e-2


# (accumulate, leaky, squash_constant, with_bias, normalize_agreement): covers
# every pair of option values (2^5 combinations would compile 32 times).
DYNAMIC_VARIANTS = [
    (True, True, 1.0, True, False),
    (True, False, 0.5, False, True),
    (False, True, 0.5, False, False),
    (False, False, 1.0, True, True),
    (False, True, 1.0, False, True),
    (True, False, 0.5, True, False),
    (False, False, 0.5, False, True),
]


@functools.cache
def dynamic_variants():
  votes = random_votes(5, (DIMS.B,))
  bias = (0.3 * np.random.default_rng(6).standard_normal(DIMS['OD'])
          ).astype(np.float32)

  @jax.jit
  def run(votes, bias):
    return [routing.dynamic_routing(
        votes, 3, accumulate=accumulate, leaky=leaky,
        squash_constant=squash_constant, bias=bias if with_bias else None,
        normalize_agreement=normalize)
            for accumulate, leaky, squash_constant, with_bias, normalize
            in DYNAMIC_VARIANTS]

  return votes, bias, _numpy(run(votes, bias))


@pytest.mark.parametrize('index', range(len(DYNAMIC_VARIANTS)))
def test_dynamic_routing_variants_match_reference(index):
  accumulate, leaky, squash_constant, with_bias, normalize = (
      DYNAMIC_VARIANTS[index])
  votes, bias, results = dynamic_variants()
  bias = bias if with_bias else None
  outputs, coupling = results[index]
  options = dict(accumulate=accumulate, leaky=leaky,
                 squash_constant=squash_constant,
                 normalize_agreement=normalize)
  ref = np_dynamic_routing(votes, 3, bias=bias, **options)
  chex.assert_trees_all_close((outputs, coupling), ref, rtol=RTOL, atol=ATOL)
  # The options matter on these inputs, so the comparison is not vacuous.
  default = np_dynamic_routing(votes, 3)
  assert max(np.max(np.abs(a - b)) for a, b in zip(ref, default, strict=True)) > 1e-3
  assert np.all(np.linalg.norm(outputs, axis=-1) < 1.0)
  totals = np.sum(coupling, -1)
  if leaky:
    assert np.all(totals < 1.0) and np.all(totals > 0.0)
  else:
    np.testing.assert_allclose(totals, 1.0, rtol=1e-6)


@functools.cache
def su_sweep():
  """Su's routing of one set of votes for every iteration count."""
  votes = random_votes(9, (DIMS.B,))
  run = jax.jit(lambda votes: {t: routing.dynamic_routing(
      votes, t, accumulate=False, squash_constant=0.5,
      normalize_agreement=True) for t in ITERATIONS})
  return votes, _numpy(run(votes))


@pytest.mark.parametrize('num_iterations', [1, 2, 3, 5])
def test_normalized_agreement_is_su_2018_routing(num_iterations):
  votes, results = su_sweep()
  outputs, coupling = results[num_iterations]
  ref = np_su_2018_routing(votes, num_iterations)
  chex.assert_trees_all_close((outputs, coupling), ref, rtol=RTOL, atol=ATOL)
  # Different from the blog's routing (agreement with squash(s)) when the
  # logits are updated at all.
  blog, _ = np_dynamic_routing(votes, num_iterations, accumulate=False,
                               squash_constant=0.5)
  difference = np.max(np.abs(ref[0] - blog))
  assert difference > 1e-3 if num_iterations > 1 else difference < 1e-6


def test_dynamic_routing_catches_softmax_over_inputs():
  votes = random_votes(8, (DIMS.B,))
  outputs, coupling = _numpy(jit_dynamic(3)(votes))
  np.testing.assert_allclose(np.sum(coupling, -1), 1.0, rtol=1e-6)
  assert np.max(np.abs(np.sum(coupling, -2) - 1.0)) > 0.1
  buggy, _ = np_dynamic_routing(votes, 3, coupling_axis=-2)
  right, _ = np_dynamic_routing(votes, 3)
  np.testing.assert_allclose(outputs, right, rtol=RTOL, atol=ATOL)
  assert np.max(np.abs(np.asarray(outputs) - buggy)) > 0.05


# ----------------------------------------------------------------------------
# EM routing against the reference.


@pytest.mark.parametrize('index', range(len(BATCH_SHAPES)))
def test_em_routing_matches_reference(index):
  batch_shape = BATCH_SHAPES[index]
  all_inputs, all_results = em_sweep()
  inputs, results = all_inputs[index], all_results[index]
  for num_iterations, (poses, activations, assignments) in zip(
      ITERATIONS, results, strict=True):
    ref = np_em_routing(*inputs, num_iterations)
    chex.assert_shape(poses, batch_shape + DIMS['OD'])
    chex.assert_shape(activations, batch_shape + DIMS['O'])
    chex.assert_shape(assignments, batch_shape + DIMS['IO'])
    chex.assert_trees_all_close((poses, activations, assignments), ref,
                                rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.sum(assignments, -1), 1.0, rtol=1e-5)
    if num_iterations == 1:
      np.testing.assert_allclose(assignments, 1.0 / DIMS.O, rtol=1e-6)
    else:
      assert np.max(np.abs(assignments - 1.0 / DIMS.O)) > 1e-2


EM_OPTIONS = {
    'normalize_cost': dict(normalize_cost=True, inverse_temperature=1.0),
    'center_momentum': dict(center_momentum=0.1, inverse_temperature=1.0),
    'authors_form': dict(activation_form='authors'),
    'authors_released': dict(activation_form='authors', center_momentum=0.1,
                             variance_epsilon=5e-4),
    'constant_lambda': dict(inverse_temperature=1.0),
    'lambda_sequence': dict(inverse_temperature=(0.5, 2.0, 1.5)),
    'everything': dict(normalize_cost=True, center_momentum=0.1,
                       variance_epsilon=1e-3,
                       inverse_temperature=(1.0, 0.5, 3.0)),
}


def _em_options_inputs(name):
  votes, activations, beta_u, beta_a = random_em_inputs(14, (DIMS.B,))
  if EM_OPTIONS[name].get('activation_form') == 'authors':
    # -5000 beta_a would saturate every sigmoid for beta_a of order 1.
    beta_a = beta_a * 1e-3
  return votes, activations, beta_u, beta_a


@functools.cache
def em_options_sweep():
  inputs = {name: _em_options_inputs(name) for name in EM_OPTIONS}
  run = jax.jit(lambda inputs: {
      name: routing.em_routing(*inputs[name], 3, **options)
      for name, options in EM_OPTIONS.items()})
  return _numpy(run(inputs))


@pytest.mark.parametrize('name', sorted(EM_OPTIONS))
def test_em_routing_options_match_reference(name):
  options = EM_OPTIONS[name]
  inputs = _em_options_inputs(name)
  out = em_options_sweep()[name]
  ref = np_em_routing(*inputs, 3, **options)
  chex.assert_trees_all_close(out, ref, rtol=RTOL, atol=ATOL)
  # The option matters on these inputs, so the comparison is not vacuous.
  default = np_em_routing(*inputs, 3)
  assert max(np.max(np.abs(a - b)) for a, b in zip(ref, default, strict=True)) > 1e-3


def test_em_inverse_temperature_traced_equals_static():
  traced = jax.jit(lambda sequence, scalar, seq_inputs, scalar_inputs: (
      routing.em_routing(*seq_inputs, 3, inverse_temperature=sequence),
      routing.em_routing(*scalar_inputs, 3, inverse_temperature=scalar)))
  from_sequence, from_scalar = traced(
      np.array([0.5, 2.0, 1.5], np.float32), np.float32(1.0),
      _em_options_inputs('lambda_sequence'),
      _em_options_inputs('constant_lambda'))
  chex.assert_trees_all_close(from_sequence,
                              em_options_sweep()['lambda_sequence'],
                              rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(from_scalar,
                              em_options_sweep()['constant_lambda'],
                              rtol=1e-6, atol=1e-7)


def test_inverse_temperature_schedule():
  schedule = routing.inverse_temperature_schedule(4)
  np.testing.assert_allclose(
      schedule, [0.01 * (1 - 0.95**t) for t in (1, 2, 3, 4)], rtol=1e-12)
  np.testing.assert_allclose(routing.inverse_temperature_schedule(2, 1.0),
                             [0.05, 1 - 0.95**2], rtol=1e-12)


def _check_grads_inputs():
  rng = np.random.default_rng(17)
  return (rng.standard_normal((4, 2, 3)), rng.uniform(0.2, 1.0, 4),
          rng.standard_normal(2), rng.standard_normal(2),
          rng.standard_normal((2, 3)),
          # Random weights for the outputs [O, D], [O], [I, O], [O, D], [I, O].
          [rng.standard_normal(shape)
           for shape in [(2, 3), (2,), (4, 2), (2, 3), (4, 2)]])


def test_em_routing_check_grads():
  """Autodiff matches finite differences through every iteration."""
  votes, activations, beta_u, beta_a, _, weights = _check_grads_inputs()
  with jax.enable_x64(True):
    @jax.jit
    def f(votes, activations, beta_u, beta_a):
      outputs = routing.em_routing(votes, activations, beta_u, beta_a, 3,
                                   inverse_temperature=(0.5, 1.0, 1.0))
      return sum(jnp.sum(x * w) for x, w in zip(outputs, weights[:3],
                                                strict=True))
    check_grads(f, tuple(jnp.asarray(x) for x in (votes, activations, beta_u,
                                                   beta_a)),
                order=1, modes=['rev'], atol=1e-4, rtol=1e-4)


def test_em_remat_iterations_checkpoints_and_changes_no_gradient():
  """Checkpointing each EM iteration puts the iterations under jax.checkpoint
  and changes no value or gradient beyond float32 rounding."""
  rng = np.random.default_rng(3)
  votes = jnp.asarray(rng.normal(size=(4, 36, 72, 8, 16)), jnp.float32)
  activations = jnp.asarray(rng.uniform(size=(4, 36, 72)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=(4, 36, 8, 16)), jnp.float32)

  def loss(votes, activations, remat):
    poses, acts, _ = routing.em_routing(
        votes, activations, 0.1, -0.2, 3, inverse_temperature=1.0,
        normalize_cost=True, remat_iterations=remat)
    return jnp.sum(poses * weights) + jnp.sum(acts)

  results = {}
  for remat in (False, True):
    fn = jax.value_and_grad(functools.partial(loss, remat=remat),
                            argnums=(0, 1))
    jaxpr = str(jax.make_jaxpr(fn)(votes, activations))
    assert ('checkpoint' in jaxpr or 'remat' in jaxpr) == remat
    results[remat] = jax.jit(fn)(votes, activations)
  # XLA fuses the recomputed iterations differently: rounding only.
  chex.assert_trees_all_close(results[True], results[False], rtol=1e-4,
                              atol=1e-5)


def test_dynamic_routing_check_grads():
  """Gradients flow through every iteration (the official code stops none)."""
  votes, _, _, _, bias, weights = _check_grads_inputs()
  with jax.enable_x64(True):
    @jax.jit
    def f(votes, bias):
      outputs = routing.dynamic_routing(votes, 3, bias=bias)
      return sum(jnp.sum(x * w) for x, w in zip(outputs, weights[3:],
                                                strict=True))
    check_grads(f, (jnp.asarray(votes), jnp.asarray(bias)), order=1,
                modes=['rev'], atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------
# EM routing is EM for a Gaussian mixture (Hinton et al. 2018, section 2).


def _rotations(angles):
  return np.stack([[[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]]
                   for t in angles])


def test_em_routing_fits_gaussian_mixture():
  """Three well-separated 2-D Gaussians; each parent recovers one mean.

  Routing starts from R = 1/O, so parents whose votes are the same points
  stay identical (next test). A constant per-parent offset added to the votes
  does not break that symmetry: mu_j shifts with the votes and every
  p_j(V_ij) is unchanged; nor does a per-parent diagonal scaling (the
  diagonal Gaussian family is equivariant to it). What breaks it, as in a
  capsule layer, is a per-parent transform W_j: here a small rotation of the
  plane, V_ij = W_j x_i. Each pose is mapped back by W_j^T before comparing.
  lambda = 0.01 keeps the activations (the mixing weights) near 1/2;
  beta_u = beta_a = 0.
  """
  rng = np.random.default_rng(0)
  means = np.array([[-4.0, 0.0], [4.0, 1.0], [0.0, 6.0]])
  labels = np.repeat(np.arange(3), 40)
  points = means[labels] + 0.5 * rng.standard_normal((120, 2))
  transforms = _rotations([-0.2, 0.05, 0.25])
  votes = np.einsum('jab,ib->ija', transforms, points).astype(np.float32)
  poses, activations, assignments = _numpy(jit_em(
      30, inverse_temperature=0.01)(votes, np.ones(120, np.float32), 0.0, 0.0))
  centres = np.einsum('jba,jb->ja', transforms, np.asarray(poses))
  parent = np.argmin(np.linalg.norm(centres[:, None] - means[None], axis=-1),
                     axis=0)  # parent[k]: the parent closest to cluster k
  assert sorted(parent) == [0, 1, 2]
  np.testing.assert_allclose(centres[parent], means, atol=0.3)
  sample_means = np.stack([points[labels == k].mean(0) for k in range(3)])
  np.testing.assert_allclose(centres[parent], sample_means, atol=1e-3)
  np.testing.assert_array_equal(np.argmax(assignments, -1), parent[labels])
  assert np.min(np.max(assignments, -1)) > 0.99
  assert np.all(np.isfinite(activations))


def test_em_routing_identical_parents_stay_identical():
  rng = np.random.default_rng(1)
  points = rng.standard_normal((30, 2)).astype(np.float32)
  offsets = np.array([[0.0, 0.0], [1.0, -2.0], [3.0, 0.5]], np.float32)
  votes = points[:, None, :] + offsets[None]
  # Few iterations: the symmetric state is an unstable fixed point, which
  # float32 rounding (different for each offset) would eventually leave.
  poses, activations, assignments = _numpy(jit_em(
      3, inverse_temperature=0.01)(votes, np.ones(30, np.float32), 0.0, 0.0))
  np.testing.assert_allclose(np.asarray(poses) - offsets,
                             np.broadcast_to(points.mean(0), (3, 2)),
                             atol=1e-5)
  np.testing.assert_allclose(activations, activations[0], rtol=1e-6)
  np.testing.assert_allclose(assignments, 1.0 / 3.0, rtol=1e-5)


# ----------------------------------------------------------------------------
# Degenerate inputs: values and gradients stay finite.


def _degenerate_case(name):
  rng = np.random.default_rng(18)
  shape = (DIMS.B,) + DIMS['IOD']
  votes = rng.standard_normal(shape)
  activations = rng.uniform(0.1, 1.0, shape[:-2])
  if name == 'zero_activations':
    activations = np.zeros_like(activations)
  elif name == 'identical_votes':
    votes = np.full(shape, 0.7)
  elif name == 'single_input':
    votes, activations = votes[:, :1], activations[:, :1]
  elif name == 'scale_1e4':
    votes = 1e4 * votes
  elif name == 'scale_1e-6':
    votes = 1e-6 * votes
  elif name == 'scale_1e12':
    votes = 1e12 * votes
  elif name == 'scale_1e-30':
    votes = 1e-30 * votes
  return votes, activations


# Cases of the same shape, stacked on a new leading axis (routing is
# independent per example), plus the single-input case: one compilation.
SAME_SHAPE_CASES = ['zero_activations', 'identical_votes', 'scale_1e4',
                    'scale_1e-6', 'scale_1e12', 'scale_1e-30']
BETA_U = np.array([0.5, -0.3, 1.0])
BETA_A = np.array([0.2, 0.0, -0.5])


def _degenerate_loss(groups):
  """A scalar touching every output of EM and dynamic routing, per group."""
  total, values = 0.0, []
  for votes, activations, beta_u, beta_a, bias in groups:
    poses, out_a, assignments = routing.em_routing(votes, activations, beta_u,
                                                   beta_a, 3)
    bias = jnp.broadcast_to(bias, votes.shape[:-3] + bias.shape)
    outputs, coupling = routing.dynamic_routing(votes, 3, bias=bias,
                                                leaky=True)
    outs = (poses, out_a, assignments, outputs, coupling)
    total += sum(jnp.sum(x.astype(jnp.float32) * w)
                 for x, w in zip(outs, (1.0, 3.0, 2.0, 1.0, 2.0), strict=True))
    values.append(outs)
  return total, values


_degenerate_grads = jax.jit(jax.grad(_degenerate_loss, has_aux=True))


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_finite_on_degenerate_inputs(dtype):
  """All-zero activations, identical votes, a single input capsule, votes of
  1e-30 to 1e12 scale: finite outputs and gradients wrt every input. (The
  limit: from about 1e15 EM's gradients overflow, from about 1e19 squared
  norms overflow float32's and bfloat16's range in every output.)"""
  stacked = [np.stack(x) for x in zip(*[_degenerate_case(case)
                                        for case in SAME_SHAPE_CASES],
                                      strict=True)]
  single = _degenerate_case('single_input')
  bias = np.full(DIMS['OD'], 0.1)
  groups = [tuple(jnp.asarray(x, dtype) for x in (votes, activations, BETA_U,
                                                  BETA_A, bias))
            for votes, activations in (stacked, single)]
  grads, values = _numpy(_degenerate_grads(groups))
  names = ['poses', 'activations', 'assignments', 'dynamic outputs',
           'coupling']
  for group, group_values, group_grads, cases in zip(
      groups, values, grads, [SAME_SHAPE_CASES, ['single_input']],
      strict=True):
    for name, value in zip(names, group_values, strict=True):
      for k, case in enumerate(cases):
        per_case = value[k] if len(cases) > 1 else value
        assert np.all(np.isfinite(np.asarray(per_case, np.float32))), (
            f'{case}: {name} not finite')
    for name, grad, arg in zip(['votes', 'activations', 'beta_u', 'beta_a',
                                'bias'], group_grads, group, strict=True):
      assert grad.dtype == arg.dtype
      finite = np.isfinite(np.asarray(grad, np.float32))
      if len(cases) > 1 and name in ('votes', 'activations'):
        for k, case in enumerate(cases):
          assert np.all(finite[k]), f'{case}: d/d{name} not finite'
      else:
        assert np.all(finite), f'{cases}: d/d{name} not finite'
    # EM poses and dynamic outputs in the votes' dtype; EM activations
    # float32 (class scores).
    assert group_values[0].dtype == group_values[3].dtype == dtype
    assert group_values[1].dtype == jnp.float32
  # No input is active: no mass, mu = 0, a_j = sigmoid(lambda_T beta_a).
  poses, out_a = values[0][0][0], values[0][1][0]
  lam = 0.01 * (1 - 0.95**3)
  np.testing.assert_allclose(np.asarray(poses, np.float32), 0.0, atol=1e-6)
  expected = 1 / (1 + np.exp(-lam * BETA_A))
  # The signal, a_j - 1/2, is about lam beta_a / 4 (up to 1.8e-4): the
  # tolerance must be far below it, or ignoring beta_a or lambda would pass.
  # bfloat16 cannot resolve it (its spacing at 1/2 is 2^-8): half a spacing.
  atol = 1e-6 if dtype == jnp.float32 else 2.0**-9
  if dtype == jnp.float32:
    assert np.max(np.abs(expected - 0.5)) > 100 * atol
  np.testing.assert_allclose(
      np.asarray(out_a, np.float32),
      np.broadcast_to(expected, out_a.shape), rtol=0, atol=atol)


_variant_grads = jax.jit(jax.grad(
    lambda v, a, bu, ba: sum(jnp.sum(x) for x in routing.em_routing(
        v, a, bu, ba, 3, normalize_cost=True, center_momentum=0.1,
        activation_form='authors')), argnums=(0, 1, 2, 3)))


@pytest.mark.parametrize('case', ['zero_activations', 'identical_votes',
                                  'scale_1e4'])
def test_em_variant_gradients_finite_on_degenerate_inputs(case):
  """normalize_cost divides by the std of the costs, which is 0 here."""
  votes, activations = _degenerate_case(case)
  args = tuple(jnp.asarray(x, jnp.float32) for x in (votes, activations,
                                                      BETA_U, BETA_A))
  for grad in _variant_grads(*args):
    assert np.all(np.isfinite(grad))


# ----------------------------------------------------------------------------
# jit / vmap / eager, retracing, bfloat16.


def test_jit_vmap_eager_agree():
  votes, activations, beta_u, beta_a = random_em_inputs(19, (DIMS.B,))
  eager = routing.em_routing(votes, activations, beta_u, beta_a, 3)
  jitted = jit_em(3)(votes, activations, beta_u, beta_a)
  # Both vmapped (one example at a time) calls in one compiled program.
  mapped_em, mapped_dynamic = jax.jit(jax.vmap(lambda v, a: (
      routing.em_routing(v, a, beta_u, beta_a, 3),
      routing.dynamic_routing(v, 3))))(votes, activations)
  chex.assert_trees_all_close(eager, jitted, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(eager, mapped_em, rtol=1e-5, atol=1e-6)
  eager = routing.dynamic_routing(votes, 3)
  jitted = jit_dynamic(3)(votes)
  chex.assert_trees_all_close(eager, jitted, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(eager, mapped_dynamic, rtol=1e-5, atol=1e-6)


def test_no_retracing():
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def route(votes, activations, beta_u, beta_a, lambdas):
    em = routing.em_routing(votes, activations, beta_u, beta_a, 3,
                            inverse_temperature=lambdas)
    return em, routing.dynamic_routing(votes, 3)

  for seed in range(3):
    route(*random_em_inputs(20 + seed, (DIMS.B,)),
          np.array([0.1, 0.5, 1.0 + seed], np.float32))


@pytest.mark.parametrize('algorithm', ['dynamic', 'em'])
def test_bfloat16_outputs_close_to_float32(algorithm):
  inputs = random_em_inputs(23, (DIMS.B,))
  bf16 = tuple(jnp.asarray(x, jnp.bfloat16) for x in inputs)
  rounded = tuple(np.asarray(x, np.float32) for x in bf16)
  if algorithm == 'dynamic':
    run = lambda v, *_: jit_dynamic(3)(v)
  else:
    run = jit_em(3, **EM_OPTIONS['constant_lambda'])
  low = run(*bf16)
  assert low[0].dtype == jnp.bfloat16
  if algorithm == 'em':
    assert low[1].dtype == jnp.float32  # class scores: see below
  # Same (rounded) inputs in float32: only the output rounding differs.
  chex.assert_trees_all_close(low, run(*rounded), rtol=1e-2, atol=1e-2)
  # Unrounded float32 inputs: the inputs' rounding (2^-9 relative) carried
  # through 3 iterations. Measured over seeds 23-42: at most 0.0055 (dynamic)
  # and 0.0107 (EM, outputs up to 2.1) from float32; 2^-7 and 2^-6 allow it
  # with little room, where 5e-2 hid a 5x error.
  tolerance = 2.0**-7 if algorithm == 'dynamic' else 2.0**-6
  chex.assert_trees_all_close(low, run(*inputs), rtol=tolerance,
                              atol=tolerance)


# ----------------------------------------------------------------------------
# Bad arguments.


def test_bad_arguments_raise_value_error():
  votes, activations, beta_u, beta_a = random_em_inputs(24, (DIMS.B,))
  with pytest.raises(ValueError, match='num_iterations'):
    routing.dynamic_routing(votes, 0)
  with pytest.raises(ValueError, match='num_iterations'):
    routing.em_routing(votes, activations, beta_u, beta_a, 0)
  with pytest.raises(ValueError, match='num_iterations'):
    routing.inverse_temperature_schedule(0)
  with pytest.raises(ValueError, match='num_iterations'):
    routing.dynamic_routing(votes, 2.5)
  with pytest.raises(ValueError, match='votes'):
    routing.dynamic_routing(votes[0, 0], 3)  # [O, D]
  with pytest.raises(ValueError, match='votes'):
    routing.em_routing(votes[0, 0], activations[0, :1], beta_u, beta_a)
  with pytest.raises(ValueError, match='activations'):
    routing.em_routing(votes, activations[:, :-1], beta_u, beta_a)
  with pytest.raises(ValueError, match='activations'):
    routing.em_routing(votes, activations[0], beta_u, beta_a)
  with pytest.raises(ValueError, match='inverse_temperature'):
    routing.em_routing(votes, activations, beta_u, beta_a, 3,
                       inverse_temperature=(1.0, 2.0))
  with pytest.raises(ValueError, match='activation_form'):
    routing.em_routing(votes, activations, beta_u, beta_a,
                       activation_form='other')
  with pytest.raises(ValueError):
    routing.em_routing(votes, activations, np.zeros(DIMS.O + 1), beta_a)
  with pytest.raises(ValueError):
    routing.dynamic_routing(votes, 3, bias=np.zeros((DIMS.O, DIMS.D + 1)))


def test_bfloat16_em_activations_near_one_do_not_tie():
  """Activations near 1 (beta_a large) keep float32 resolution from
  bfloat16 votes: rounded to bfloat16 they would all be 1.0 and the argmax
  would pick the lowest class."""
  votes, activations, _, _ = random_em_inputs(31, (DIMS.B,))
  beta_a = np.array([8.0, 8.5, 9.0], np.float32)
  run = jit_em(3, **EM_OPTIONS['constant_lambda'])
  low = np.asarray(run(jnp.asarray(votes, jnp.bfloat16), activations, 0.0,
                       beta_a)[1])
  high = np.asarray(run(votes, activations, 0.0, beta_a)[1])
  assert low.dtype == jnp.float32
  assert np.all(np.asarray(high) > 0.99)
  assert np.all(np.asarray(low, np.float32).astype(jnp.bfloat16) == 1.0)
  distinct = lambda x: len(np.unique(np.asarray(x)))  # noqa: E731
  assert distinct(low) == distinct(high) == low.size
  np.testing.assert_array_equal(np.argmax(low, -1), np.argmax(high, -1))


def test_em_routing_with_reads_only_the_set_overrides():
  """A config lists every EMRouting field unset (None: the preset's); the
  model and the PyTorch reference read them through em_routing_with."""
  import dataclasses

  from experiments.configs import matrix_capsnet_mnist
  assert routing.em_routing_with('paper', {
      'num_iterations': None, 'normalize_cost': True}) == dataclasses.replace(
          routing.PAPER_EM, normalize_cost=True)
  assert routing.em_routing_with(routing.RELEASED_EM) == routing.RELEASED_EM
  options = matrix_capsnet_mnist.get_config('paper').model_options
  assert set(options.em_routing_overrides) == {
      field.name for field in dataclasses.fields(routing.EMRouting)}
  assert routing.em_routing_with(
      options.em_routing, options.em_routing_overrides) == routing.PAPER_EM
  with pytest.raises(ValueError, match='preset'):
    routing.em_routing_with('papers')
  with pytest.raises(ValueError, match='preset name'):
    routing.em_routing_with({'num_iterations': 3})
