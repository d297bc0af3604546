"""Tests for capsjax.self_routing, capsjax.self_routing_layers and their
counts in capsjax.flops.

The reference below is a float64 NumPy transcription of the paper's
equations (Hahn, Pyeon, Kim, NeurIPS 2019), child by child and parent by
parent; it does not call the library:

    c_ij = softmax_j(W_i^route u_i + b_i^route)
    a_j  = sum_i c_ij a_i / sum_i a_i
    u_j  = sum_i c_ij a_i u_hat_j|i / sum_i c_ij a_i,  u_hat_j|i = W_ij u_i

Shapes: B batch, I input capsules, O output capsules, D output pose
dimension, E input pose dimension.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from capsjax import flops
from capsjax.layers import self_routing as srl
from capsjax.routing import self_routing as sr
from tests.helpers import random_normal

DIMS = chex.Dimensions(B=2, I=5, O=3, D=4, E=6)
BATCH_SHAPES = [(), (2,), (2, 3)]
# float64 against the float64 reference: the same sums in another order.
F64 = dict(rtol=1e-12, atol=1e-14)
# float32 against the float64 reference: divisions by masses down to 1e-3.
F32 = dict(rtol=2e-5, atol=1e-6)

# ----------------------------------------------------------------------------
# The float64 NumPy reference, from the paper.


def np_routing_logits(poses, weights, bias):
  """W_i^route u_i + b_i^route for each child i: poses [..., I, E], weights
  [I, E, O], bias [I, O] -> [..., I, O]."""
  poses = np.asarray(poses, np.float64)
  out = np.zeros(poses.shape[:-1] + (weights.shape[-1],))
  for i in range(poses.shape[-2]):
    out[..., i, :] = poses[..., i, :] @ np.asarray(weights[i], np.float64)
    out[..., i, :] += bias[i]
  return out


def np_votes(poses, weights):
  """u_hat_j|i = u_i W_ij: poses [..., I, E], weights [I, O, E, D]."""
  poses = np.asarray(poses, np.float64)
  num_in, num_out = weights.shape[:2]
  out = np.zeros(poses.shape[:-1] + (num_out, weights.shape[-1]))
  for i in range(num_in):
    for j in range(num_out):
      out[..., i, j, :] = poses[..., i, :] @ np.asarray(weights[i, j],
                                                         np.float64)
  return out


def np_self_routing(votes, activations, logits):
  """The paper's equations: (poses [..., O, D], activations [..., O],
  couplings [..., I, O])."""
  votes, a, logits = (np.asarray(x, np.float64)
                      for x in (votes, activations, logits))
  e = np.exp(logits - logits.max(-1, keepdims=True))
  c = e / e.sum(-1, keepdims=True)
  num_out = votes.shape[-2]
  poses = np.zeros(votes.shape[:-3] + (num_out, votes.shape[-1]))
  parents = np.zeros(votes.shape[:-3] + (num_out,))
  with np.errstate(invalid='ignore'):  # 0/0 where no child is active
    for j in range(num_out):
      weight = c[..., :, j] * a  # c_ij a_i: [..., I]
      parents[..., j] = weight.sum(-1) / a.sum(-1)
      poses[..., j, :] = (np.sum(weight[..., None] * votes[..., :, j, :], -2)
                          / weight.sum(-1)[..., None])
  return poses, parents, c


# ----------------------------------------------------------------------------
# Inputs and runners.


def random_inputs(seed, batch_shape=(), num_in=DIMS.I, num_out=DIMS.O,
                  dim=DIMS.D):
  """(votes [..., I, O, D], activations [..., I] in [0.05, 1], logits
  [..., I, O]), float64."""
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(batch_shape + (num_in, num_out, dim)),
          rng.uniform(0.05, 1.0, batch_shape + (num_in,)),
          2.0 * rng.standard_normal(batch_shape + (num_in, num_out)))


def run(fn, args, dtype):
  """jit(fn)(*args) with every float argument cast to ``dtype``; float64
  under jax_enable_x64. Returns NumPy arrays."""
  with jax.enable_x64(dtype == np.float64):
    # Cast by NumPy: the same rounding, without a compiled conversion for
    # each argument.
    cast = jax.tree.map(lambda x: np.asarray(x, dtype), args)
    return jax.tree.map(np.asarray, jax.jit(fn)(*cast))


DTYPES = [pytest.param(np.float64, id='float64'),
          pytest.param(np.float32, id='float32')]


def _tolerance(dtype):
  return F64 if dtype == np.float64 else F32


def _routings(cases):
  """Self-routing and uniform routing of each (votes, activations, logits)."""
  return [(sr.self_routing(v, a, logits), sr.uniform_routing(v, a))
          for v, a, logits in cases]


# ----------------------------------------------------------------------------
# Against the reference.


@pytest.mark.parametrize('dtype', DTYPES)
def test_self_and_uniform_routing_match_the_paper(dtype):
  cases = [random_inputs(k, shape) for k, shape in enumerate(BATCH_SHAPES)]
  for (votes, acts, logits), (routed, uniform) in zip(
      cases, run(_routings, (cases,), dtype), strict=True):
    batch_shape = votes.shape[:-3]
    chex.assert_shape(routed, (batch_shape + DIMS['OD'], batch_shape + (
        DIMS.O,), batch_shape + DIMS['IO']))
    assert all(x.dtype == dtype for x in routed + uniform)
    for got, want in zip(routed, np_self_routing(votes, acts, logits),
                         strict=True):
      np.testing.assert_allclose(got, want, **_tolerance(dtype))
    # Uniform routing is the paper's equations with every logit 0.
    for got, want in zip(uniform, np_self_routing(votes, acts, 0 * logits),
                         strict=True):
      np.testing.assert_allclose(got, want, **_tolerance(dtype))


def test_self_routing_logits_match_the_paper():
  rng = np.random.default_rng(7)
  poses = rng.standard_normal((2, 3, DIMS.I, DIMS.E))
  weights = rng.standard_normal((DIMS.I, DIMS.E, DIMS.O))
  bias = rng.standard_normal((DIMS.I, DIMS.O))
  for dtype in (np.float64, np.float32):
    got = run(sr.self_routing_logits, (poses, weights, bias), dtype)
    assert got.dtype == dtype
    np.testing.assert_allclose(got, np_routing_logits(poses, weights, bias),
                               **_tolerance(dtype))


def test_bfloat16_routes_in_float32():
  """bfloat16 inputs: the poses come back in bfloat16, the activations and
  couplings in float32, as the float32 routing's within bfloat16 rounding."""
  votes, acts, logits = random_inputs(11, (DIMS.B,))
  wide = run(_routings, ([(votes, acts, logits)],), np.float32)
  narrow = run(_routings, ([(votes, acts, logits)],), jnp.bfloat16)
  for got, want in zip(jax.tree.leaves(narrow), jax.tree.leaves(wide),
                       strict=True):
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=3e-2,
                               atol=3e-2)
  (poses, parents, coupling), (uniform_poses, _, _) = narrow[0]
  assert poses.dtype == uniform_poses.dtype == jnp.bfloat16
  assert parents.dtype == coupling.dtype == np.float32


# ----------------------------------------------------------------------------
# Properties a wrong routing would break.


def _properties_cases(votes, acts, logits, perm):
  """Routings of the inputs, of the children permuted, of the inputs with
  child 0 inactive, of the same without child 0, and of one parent."""
  inactive = acts.at[..., 0].set(0.0)
  wild = votes.at[..., 0, :, :].set(1e3), logits.at[..., 0, :].set(-40.0)
  return (sr.self_routing(votes, acts, logits),
          sr.self_routing(votes[..., perm, :, :], acts[..., perm],
                          logits[..., perm, :]),
          sr.self_routing(votes, inactive, logits),
          sr.self_routing(wild[0], inactive, wild[1]),
          sr.self_routing(votes[..., 1:, :, :], acts[..., 1:],
                          logits[..., 1:, :]),
          sr.self_routing(votes[..., :1, :], acts, logits[..., :1]),
          sr.uniform_routing(votes, jnp.ones_like(acts)))


def test_routing_properties():
  votes, acts, logits = random_inputs(3, (4,), num_in=7)
  acts[:, -2:] = [0.0, 1.0]  # activations in [0, 1], ends included
  perm = np.random.default_rng(0).permutation(7)
  (base, permuted, inactive, wild, without, one_parent,
   plain) = run(functools.partial(_properties_cases, perm=perm),
                (votes, acts, logits), np.float64)
  poses, parents, coupling = base
  # Each child splits itself over the parents; the parents' activations are
  # in [0, 1] and, as c sums to 1 over O, sum to 1 over the parents.
  np.testing.assert_allclose(coupling.sum(-1), 1.0, rtol=1e-14)
  assert np.all((parents >= 0.0) & (parents <= 1.0))
  np.testing.assert_allclose(parents.sum(-1), 1.0, rtol=1e-14)
  # The children are a set: their order changes nothing but the couplings'.
  np.testing.assert_allclose(permuted[0], poses, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(permuted[1], parents, rtol=1e-12)
  np.testing.assert_array_equal(permuted[2], coupling[:, perm])
  # A child of activation 0 changes no parent, whatever its votes and
  # logits: the parents are those of the other children alone.
  for got in (inactive, wild):
    np.testing.assert_allclose(got[0], without[0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got[1], without[1], rtol=1e-12)
  # One parent takes everything: coupling 1, activation 1, and its pose is
  # the activation-weighted mean of its votes.
  np.testing.assert_array_equal(one_parent[2], 1.0)
  np.testing.assert_allclose(one_parent[1], 1.0, rtol=1e-14)
  mean = np.sum(acts[..., None] * votes[..., 0, :], -2) / acts.sum(-1,
                                                                   keepdims=True)
  np.testing.assert_allclose(one_parent[0][..., 0, :], mean, rtol=1e-12)
  # Uniform routing with equal activations: each parent the plain mean.
  np.testing.assert_allclose(plain[0], votes.mean(-3), rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(plain[1], 1.0 / DIMS.O, rtol=1e-14)


def test_a_confident_child_routes_to_one_parent():
  """Logits of +-1e30 (finite in float32): the softmax is one-hot, and each
  parent is the activation-weighted mean of the children routed to it."""
  votes, acts, _ = random_inputs(5, (), num_in=4)
  choice = np.array([0, 2, 2, 0])
  logits = np.where(np.arange(DIMS.O) == choice[:, None], 1e30, -1e30)
  poses, parents, coupling = run(sr.self_routing, (votes, acts, logits),
                                 np.float32)
  np.testing.assert_array_equal(coupling, np.eye(DIMS.O)[choice])
  for j in (0, 2):
    mine = choice == j
    np.testing.assert_allclose(parents[j], acts[mine].sum() / acts.sum(),
                               rtol=1e-6)
    np.testing.assert_allclose(
        poses[j], np.sum(acts[mine, None] * votes[mine, j], 0)
        / acts[mine].sum(), rtol=1e-5, atol=1e-6)
  # Parent 1 receives nothing: activation 0 and, below the floor, pose 0.
  assert parents[1] == 0.0
  np.testing.assert_array_equal(poses[1], 0.0)


# ----------------------------------------------------------------------------
# Shapes: vmap, leading batch dimensions.


def test_shapes_under_vmap_and_leading_dims():
  votes, acts, logits = random_inputs(13, (2, DIMS.B))
  batched = run(_routings, ([(votes, acts, logits)],), np.float32)[0]
  mapped = run(lambda v, a, lg: jax.vmap(jax.vmap(
      lambda *x: _routings([x])[0]))(v, a, lg), (votes, acts, logits),
               np.float32)
  for got, want in zip(jax.tree.leaves(mapped), jax.tree.leaves(batched),
                       strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  for poses, parents, coupling in batched:
    chex.assert_shape([poses, parents, coupling],
                      [(2, DIMS.B, DIMS.O, DIMS.D), (2, DIMS.B, DIMS.O),
                       (2, DIMS.B, DIMS.I, DIMS.O)])


def test_bad_shapes_and_dtypes_raise():
  # NumPy inputs: the slicing below runs no compiled program.
  votes, acts, logits = (np.asarray(x, np.float32)
                         for x in random_inputs(0, (DIMS.B,)))
  with pytest.raises(ValueError, match='votes must be'):
    sr.self_routing(votes[0, 0], acts[0, :1], logits[0, 0])
  with pytest.raises(ValueError, match='activations must be'):
    sr.uniform_routing(votes, acts[:, :-1])
  with pytest.raises(ValueError, match='routing_logits must be'):
    sr.self_routing(votes, acts, logits[..., :-1])
  with pytest.raises(TypeError, match='floating point'):
    sr.self_routing(votes.astype(jnp.int32), acts, logits)
  for epsilon in (0.0, -1e-6, None, True):
    with pytest.raises(ValueError, match='epsilon'):
      sr.uniform_routing(votes, acts, epsilon=epsilon)
  with pytest.raises(ValueError, match='do not match'):
    sr.self_routing_logits(np.zeros((DIMS.B, DIMS.I, DIMS.E), np.float32),
                           np.zeros((DIMS.I, DIMS.E + 1, DIMS.O), np.float32),
                           np.zeros((DIMS.I, DIMS.O), np.float32))


# ----------------------------------------------------------------------------
# Degenerate inputs: finite values and gradients.


def _values_and_grads(votes, acts, logits, weights):
  """Both routings' outputs and the gradients of a weighted sum of them
  with respect to every input."""
  def loss(votes, acts, logits):
    outputs = _routings([(votes, acts, logits)])[0]
    return sum(jnp.sum(x.astype(jnp.float32) * w.astype(jnp.float32))
               for x, w in zip(
        jax.tree.leaves(outputs), weights, strict=True))
  outputs = _routings([(votes, acts, logits)])[0]
  return outputs, jax.grad(loss, argnums=(0, 1, 2))(votes, acts, logits)


def _degenerate(name):
  """(votes, activations, logits) of a degenerate case, float64."""
  votes, acts, logits = random_inputs(21, (DIMS.B,))
  if name == 'zero_activations':
    return votes, 0.0 * acts, logits
  if name == 'tiny_activations':
    return votes, np.full_like(acts, 1e-30), logits
  if name == 'identical_votes':
    return np.broadcast_to(votes[:1, :1, :1], votes.shape), acts, logits
  if name == 'one_input':
    return votes[:, :1], acts[:, :1], logits[:, :1]
  if name == 'huge_votes':
    return 1e30 * votes, acts, logits
  if name == 'tiny_votes':
    return 1e-30 * votes, acts, logits
  if name == 'zero_votes':
    return 0.0 * votes, acts, logits
  assert name == 'huge_logits'
  return votes, acts, 1e30 * np.sign(logits)


DEGENERATE = ['zero_activations', 'tiny_activations', 'identical_votes',
              'one_input', 'huge_votes', 'tiny_votes', 'zero_votes',
              'huge_logits']


@pytest.mark.parametrize('dtype', [np.float32, jnp.bfloat16],
                         ids=['float32', 'bfloat16'])
def test_degenerate_inputs_finite_values_and_gradients(dtype):
  cases = {name: _degenerate(name) for name in DEGENERATE}
  rng = np.random.default_rng(1)
  for name, (votes, acts, logits) in cases.items():
    shapes = [votes.shape[:-3] + DIMS['OD'], votes.shape[:-3] + (DIMS.O,),
              logits.shape] * 2
    weights = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    (routed, uniform), grads = run(_values_and_grads,
                                   (votes, acts, logits, weights), dtype)
    for x in jax.tree.leaves((routed, uniform, grads)):
      assert np.all(np.isfinite(np.asarray(x, np.float32))), name
    _check_degenerate_values(name, (votes, acts, logits), routed, uniform,
                             dtype)


def _check_degenerate_values(name, inputs, routed, uniform, dtype):
  """Where the paper's equations are defined, the routing computes them;
  where they are 0/0 (no active child, or a parent no child routes to), the
  parents are 0."""
  votes, acts, logits = inputs
  tolerance = (dict(rtol=2e-5, atol=1e-6) if dtype == np.float32
               else dict(rtol=3e-2, atol=3e-2))
  if name in ('zero_activations', 'tiny_activations'):
    bound = 0.0 if name == 'zero_activations' else 1e-20
    for x in jax.tree.leaves((routed[:2], uniform[:2])):
      assert np.all(np.abs(np.asarray(x, np.float64)) <= bound), name
    return
  scale = {'huge_votes': 1e30, 'tiny_votes': 1e-30}.get(name, 1.0)
  want_poses, want_parents, want_coupling = np_self_routing(votes, acts,
                                                            logits)
  poses = np.asarray(routed[0], np.float64)
  received = np.isfinite(want_poses)  # not 0/0
  np.testing.assert_array_equal(poses[~received], 0.0)
  np.testing.assert_allclose(poses[received] / scale,
                             want_poses[received] / scale, **tolerance)
  np.testing.assert_allclose(routed[1], want_parents, **tolerance)
  np.testing.assert_allclose(routed[2], want_coupling, **tolerance)
  if name == 'identical_votes':
    np.testing.assert_allclose(poses, np.broadcast_to(votes[0, 0, 0],
                                                      poses.shape), **tolerance)
  if name == 'one_input':  # one child: each parent is its vote
    np.testing.assert_allclose(poses, votes[:, 0], **tolerance)


def test_check_grads_float64():
  """Autodiff matches finite differences (float64, floors inactive)."""
  votes, acts, logits = random_inputs(17, (DIMS.B,), num_in=3, num_out=2,
                                      dim=3)
  rng = np.random.default_rng(18)
  poses = rng.standard_normal((DIMS.B, 3, 2))
  route_weights, route_bias = rng.standard_normal((3, 2, 2)), rng.standard_normal(
      (3, 2))
  weights = [rng.standard_normal(s) for s in [(DIMS.B, 2, 3), (DIMS.B, 2),
                                              (DIMS.B, 3, 2)]]

  def weighted(outputs):
    return sum(jnp.sum(x * w) for x, w in zip(outputs, weights, strict=True))

  with jax.enable_x64(True):
    args = [jnp.asarray(x) for x in (votes, acts, logits, poses, route_weights,
                                     route_bias)]
    check_grads(jax.jit(lambda v, a, lg: weighted(sr.self_routing(v, a, lg))),
                args[:3], order=1, modes=['rev'], atol=1e-6, rtol=1e-6)
    check_grads(jax.jit(lambda v, a: weighted(sr.uniform_routing(v, a))),
                args[:2], order=1, modes=['rev'], atol=1e-6, rtol=1e-6)
    check_grads(jax.jit(lambda v, a, p, w, b: weighted(sr.self_routing(
        v, a, sr.self_routing_logits(p, w, b)))),
                args[:2] + args[3:], order=1, modes=['rev'], atol=1e-6,
                rtol=1e-6)


# ----------------------------------------------------------------------------
# The layer.


def _layer(couplings='self', routing_scale=0.0, seed=0):
  layer = srl.SelfRoutingCapsules(DIMS.I, DIMS.E, DIMS.O, DIMS.D,
                                  couplings=couplings, rngs=nnx.Rngs(seed))
  if routing_scale:
    rng = np.random.default_rng(seed + 100)
    layer.route_weights[...] = jnp.asarray(
        routing_scale * rng.standard_normal(layer.route_weights.shape),
        jnp.float32)
    layer.route_bias[...] = jnp.asarray(
        routing_scale * rng.standard_normal(layer.route_bias.shape),
        jnp.float32)
  return layer


def _layer_inputs(seed, batch_shape):
  """Child poses [..., I, E] and activations [..., I] in [0.05, 1], float32
  NumPy."""
  acts = np.random.default_rng(seed).uniform(0.05, 1.0, batch_shape + (DIMS.I,))
  return (random_normal(seed, batch_shape + (DIMS.I, DIMS.E)),
          acts.astype(np.float32))


# One jitted route for every layer of the same structure and input shape.
_route = nnx.jit(lambda layer, poses, acts: layer.route(poses, acts))


def _count(layer):
  return sum(x.size for x in jax.tree.leaves(nnx.state(layer, nnx.Param)))


def test_layer_matches_the_paper_and_counts_its_parameters():
  layer = _layer(routing_scale=0.5)
  for batch_shape in ((DIMS.B,), (2, DIMS.B)):
    poses, acts = _layer_inputs(1, batch_shape)
    out_poses, out_acts, coupling = _route(layer, poses, acts)
    chex.assert_shape([out_poses, out_acts, coupling],
                      [batch_shape + DIMS['OD'], batch_shape + (DIMS.O,),
                       batch_shape + DIMS['IO']])
    votes = np_votes(poses, np.asarray(layer.weights[...]))
    logits = np_routing_logits(poses, np.asarray(layer.route_weights[...]),
                               np.asarray(layer.route_bias[...]))
    for got, want in zip((out_poses, out_acts, coupling),
                         np_self_routing(votes, acts, logits), strict=True):
      np.testing.assert_allclose(got, want, rtol=5e-5, atol=1e-5)
  i, o, e, d = DIMS.I, DIMS.O, DIMS.E, DIMS.D
  assert _count(layer) == i * o * (e * d + e + 1)
  assert _count(_layer('uniform')) == i * o * e * d


def test_layer_starts_as_uniform_routing():
  """The routing networks start at zero (the authors' code): the couplings
  are 1/O and the layer computes what its no-routing control computes."""
  poses, acts = _layer_inputs(2, (DIMS.B,))
  fresh, control = _layer('self'), _layer('uniform')
  np.testing.assert_array_equal(fresh.weights[...], control.weights[...])
  got, want = _route(fresh, poses, acts), _route(control, poses, acts)
  for x, y in zip(got, want, strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(got[2], 1.0 / DIMS.O, rtol=1e-6)
  np.testing.assert_allclose(got[1], 1.0 / DIMS.O, rtol=1e-6)


@pytest.mark.parametrize('couplings', ['self', 'uniform'])
def test_layer_gradients_finite(couplings):
  """Gradients of every parameter are finite, also for inactive children,
  and the routing networks get one."""
  layer = _layer(couplings)
  poses, acts = _layer_inputs(3, (DIMS.B,))
  acts[0] = 0.0  # the first example has no active child

  @nnx.jit
  def grads(layer, poses, acts):
    def loss(layer):
      out_poses, out_acts = layer(poses, acts)
      scores = jnp.log(out_acts + 1e-3) @ jnp.arange(DIMS.O, dtype=jnp.float32)
      return jnp.sum(out_poses ** 2) + jnp.sum(scores)
    return nnx.grad(loss)(layer)

  leaves = [np.asarray(x) for x in
            jax.tree.leaves(nnx.to_pure_dict(grads(layer, poses, acts)))]
  assert len(leaves) == (3 if couplings == 'self' else 1)
  for leaf in leaves:
    assert np.all(np.isfinite(leaf)) and np.any(leaf != 0.0)


def test_layer_initialisation_and_arguments():
  layer = _layer('uniform')
  weights = np.asarray(layer.weights[...])
  limit = np.sqrt(6.0 / (DIMS.O * DIMS.E * DIMS.D))
  assert np.abs(weights).max() <= limit
  big = srl.authors_transform_init(jax.random.PRNGKey(0), (8, 10, 16, 16))
  np.testing.assert_allclose(np.std(big), np.sqrt(2.0 / (10 * 16 * 16)),
                             rtol=0.05)
  assert not hasattr(layer, 'route_weights')
  with pytest.raises(ValueError, match='couplings'):
    srl.SelfRoutingCapsules(2, 3, 4, 5, couplings='dynamic',
                            rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='out_dim'):
    srl.SelfRoutingCapsules(2, 3, 4, 0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='epsilon'):
    srl.SelfRoutingCapsules(2, 3, 4, 5, epsilon=0.0, rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------
# FLOP counts.


def test_flop_counts_by_hand():
  # 2IOD + OD + 6IO + I + 2O + 1 with I, O, D = 2, 3, 4.
  assert flops.self_routing_flops(2, 3, 4) == (48 + 12 + 36 + 2 + 6 + 1, 6)
  assert flops.self_routing_flops(2, 3, 4, uniform=True) == (105 - 24, 0)
  assert flops.self_routing_flops(2, 3, 4, in_dim=5) == (105 + 60 + 6, 6)
  cost = flops.self_routing_cost((5, 2, 3, 4))
  assert cost.flops == 5 * 105 and cost.transcendentals == 30
  # votes, activations, logits; poses, activations, coupling (float32).
  assert cost.bytes == 4 * 5 * (24 + 2 + 6 + 12 + 3 + 6)
  assert cost.streaming_bytes == cost.bytes
  backward = flops.self_routing_cost((5, 2, 3, 4), backward=True)
  assert backward.flops == 3 * cost.flops and backward.bytes == 2 * cost.bytes
  with pytest.raises(ValueError, match='in_dim'):
    flops.self_routing_cost((1, 2, 3, 4), in_dim=0)


def _xla_flops(fn, *args):
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return cost['flops']


def test_flop_counts_match_xla():
  """Within 15% of XLA's own count of the compiled forward pass (the row of
  docs/routings.md rests on it), loosely for the backward pass."""
  shape = (2, 64, 10, 16)
  votes, acts, logits = (np.asarray(x, np.float32) for x in random_inputs(
      0, shape[:1], *shape[1:]))
  poses = np.ones((2, 64, 8), np.float32)
  networks = np.ones((64, 8, 10), np.float32), np.ones((64, 10), np.float32)
  cases = [
      (lambda v, a, lg: sr.self_routing(v, a, lg), (votes, acts, logits), {}),
      (lambda v, a: sr.uniform_routing(v, a), (votes, acts),
       {'uniform': True}),
      (lambda v, a, p, w, b: sr.self_routing(v, a, sr.self_routing_logits(
          p, w, b)), (votes, acts, poses) + networks, {'in_dim': 8}),
  ]
  for fn, args, options in cases:
    ratio = _xla_flops(fn, *args) / flops.self_routing_cost(shape,
                                                            **options).flops
    assert abs(ratio - 1) < 0.15, (options, ratio)
  backward = jax.grad(lambda v, a, lg: jnp.sum(sr.self_routing(v, a, lg)[0]),
                      argnums=(0, 1, 2))
  ratio = (_xla_flops(backward, votes, acts, logits)
           / flops.self_routing_cost(shape, backward=True).flops)
  assert 0.5 <= ratio <= 2.0, ratio
