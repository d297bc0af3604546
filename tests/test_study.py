"""capsjax.study: the routing study's model, every head.

Shapes at the three sizes the study reads (abstractly: no compute), the
parameter counts matched, one jitted gradient of a small model per head,
and the control's couplings. Small widths: the study's model is compiled
once per head here.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from capsjax import families
from capsjax import models
from capsjax import study
from tests.conftest import unit_tier_keeps

SMALL = dict(stem_widths=(4, 4, 8, 8), primary_types=2, capsule_dim=4)
# The three inputs of the study: MNIST, the affine canvases, Su's stacked
# pairs.
SIZES = ((28, 28), (40, 40), (56, 28))


def _model(head, **options):
  return models.create_model('routing_study_net', rngs=nnx.Rngs(0),
                             head=head, **options)


@nnx.jit
def _forward(model, images):
  # One compiled program per head and shape, not one per op.
  return model(images)


def _images(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).uniform(size=shape),
                     jnp.float32)


@pytest.mark.parametrize('head', study.HEADS)
def test_every_head_reads_every_size_of_the_study(head):
  model = nnx.eval_shape(lambda: _model(head))
  for height, width in SIZES:
    out = nnx.eval_shape(lambda m, h=height, w=width: m(
        jnp.zeros((3, h, w, 1), jnp.float32)), model)
    children = study.num_children(height, width)
    dim = 16  # capsule_dim, and the EM head's 4x4 poses
    chex.assert_shape(out['class_scores'], (3, 10))
    if head != 'self_routing':  # its class layer makes no poses
      chex.assert_shape(out['capsules'], (3, 10, dim))
    chex.assert_shape(out['coupling'], (3, children, 10))
    assert out['class_scores'].dtype == jnp.float32


def test_parameter_counts_are_matched_within_ten_percent():
  counts = {head: models.count_params(nnx.eval_shape(lambda h=head: _model(h)))
            for head in study.HEADS}
  assert max(counts.values()) / min(counts.values()) <= 1.10, counts
  # The counts the module docstring states.
  assert counts == {
      'dynamic_1': 75_872, 'dynamic_3': 75_872, 'su': 75_872, 'em': 75_132,
      'self_attention': 75_952, 'inverted_dot_product': 75_921,
      'self_routing': 75_192, 'uniform': 76_392}


# One head of each routing family in the unit tier.
@pytest.mark.parametrize('head', unit_tier_keeps(
    study.HEADS, 'dynamic_3', 'em', 'self_attention', 'self_routing'))
def test_every_head_trains_with_finite_gradients_and_scores_in_0_1(head):
  model = _model(head, **SMALL)
  images = _images((4, 28, 28, 1))
  labels = jnp.asarray([0, 1, 2, 3])
  family = families.of(model)

  @nnx.jit
  def loss_and_grads(model, images):
    def loss_fn(model):
      outputs = model(images, train=True)
      return jnp.mean(family.class_loss(outputs['class_scores'], labels)), (
          outputs)
    return nnx.value_and_grad(loss_fn, has_aux=True)(model)

  (loss, outputs), grads = loss_and_grads(model, images)
  assert np.isfinite(loss)
  leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
  assert leaves and all(np.all(np.isfinite(g)) for g in leaves)
  # Every parameter a head owns gets a gradient (none is dead weight).
  assert all(np.any(g != 0) for g in jax.tree.leaves(
      nnx.state(grads.head, nnx.Param))), head
  scores = np.asarray(outputs['class_scores'])
  assert np.all(np.isfinite(scores)) and np.all((scores >= 0) & (scores <= 1))


def test_the_control_couples_every_child_to_every_class_equally():
  model = _model('uniform', **SMALL)
  out = _forward(model, _images((2, 40, 40, 1)))
  np.testing.assert_allclose(out['coupling'], 1 / 10, rtol=1e-6)
  # Its scores are the lengths of its squashed poses, not the (constant)
  # activations: they differ between classes.
  assert np.ptp(np.asarray(out['class_scores']), axis=-1).min() > 0
  # Self-routing starts from the same couplings (its routing networks are
  # zeros) and leaves them as it learns.
  start = _forward(_model('self_routing', **SMALL), _images((2, 40, 40, 1)))
  np.testing.assert_allclose(start['coupling'], 1 / 10, rtol=1e-6)


def test_routing_changes_the_couplings_of_the_routed_heads():
  images = _images((2, 28, 28, 1))
  for head in ('dynamic_3', 'su', 'em', 'self_attention',
               'inverted_dot_product'):
    coupling = np.asarray(_forward(_model(head, **SMALL), images)['coupling'])
    assert np.ptp(coupling, axis=-1).max() > 1e-4, head


def test_bad_options_and_images_raise_one_clear_error():
  with pytest.raises(ValueError, match='head must be one of'):
    _model('dynamic_2')
  with pytest.raises(ValueError, match='stem_widths must be 4 positive'):
    _model('su', stem_widths=(8, 8))
  with pytest.raises(ValueError, match='primary_types must be a positive'):
    _model('su', primary_types=0)
  model = nnx.eval_shape(lambda: _model('em', **SMALL))
  with pytest.raises(ValueError, match=r'at least 14x14 .*got \(2, 12, 28'):
    model(jnp.zeros((2, 12, 28, 1)))


def test_routing_cost_counts_each_head():
  children = study.num_children(28, 28)
  assert children == 8 * 8 * 8
  costs = {head: study.routing_cost(head, children).flops
           for head in study.HEADS}
  assert all(cost > 0 for cost in costs.values())
  # Three iterations cost more than one; the control least of all.
  assert costs['dynamic_3'] > costs['dynamic_1']
  assert costs['uniform'] == min(costs.values())


@pytest.mark.parametrize('head', ('dynamic_3', 'em', 'self_routing'))
def test_forward_flops_agree_with_xla_on_its_own_convolutions(head):
  model = _model(head, implementation='xla', **SMALL)
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
  cost = forward.lower(state, jnp.zeros((1, 40, 40, 1))).compile(
      ).cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  ours = study.forward_flops(head, 40, 40, **SMALL)
  # (1% at the default widths; the small model routes a larger share.)
  assert ours == pytest.approx(cost['flops'], rel=0.1)
