"""The bfloat16 audit of the GPU programs (``benchmarks/bf16_audit.py``):
it finds a float32 product that no source line justifies, and every
model family's bfloat16 train step, exported for CUDA on this CPU, has
none above 1 MFLOP."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import bf16_audit
from capsjax.routing import votes as votes_lib

_HERE = os.path.basename(__file__)


def _bf16(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.bfloat16)


def _planted(x, w):
  y = x @ w  # a bfloat16 product: not flagged
  return x.astype(jnp.float32) @ w.astype(jnp.float32) + y  # planted


def _justified(x, w):
  # float32: a statistic, kept float32 on purpose in this test.
  return x.astype(jnp.float32) @ w.astype(jnp.float32)


def test_a_planted_float32_product_is_found_with_its_line_and_converts():
  found = bf16_audit.audit_text(
      bf16_audit.export_text(_planted, _bf16(64, 128), _bf16(128, 128)))
  assert len(found) == 2
  bad = bf16_audit.unjustified(found)
  assert len(bad) == 1, bf16_audit.table(found)
  [product] = bad
  assert product.types == ('f32', 'f32', 'f32')
  assert product.shapes == ((64, 128), (128, 128), (64, 128))
  assert product.flops == 2 * 64 * 128 * 128
  assert set(product.converts) == {'lhs<-bf16', 'rhs<-bf16'}
  line = _planted.__code__.co_firstlineno + 2
  assert product.source == f'tests/{_HERE}:{line}'
  assert 'FLOAT32, NOT JUSTIFIED' in bf16_audit.table(found)
  [other] = [p for p in found if p is not product]
  assert other.types == ('bf16', 'bf16', 'bf16') and not other.float32


def test_the_marker_above_a_line_justifies_its_product():
  found = bf16_audit.audit_text(
      bf16_audit.export_text(_justified, _bf16(64, 128), _bf16(128, 128)))
  [product] = found
  assert product.float32 and not bf16_audit.unjustified(found)
  assert product.reason == 'a statistic, kept float32 on purpose in this test.'
  assert product.where.startswith(f'tests/{_HERE}:')


def test_small_float32_products_are_left_alone():
  found = bf16_audit.audit_text(
      bf16_audit.export_text(_planted, _bf16(8, 16), _bf16(16, 16)))
  assert not bf16_audit.unjustified(found)
  assert bf16_audit.unjustified(found, min_flops=0)


def test_convolution_flops_count_only_the_taps_on_the_input():
  # A stride-2 9 x 9 convolution (the paper CapsNet's PrimaryCaps, narrow),
  # forward and both gradients: each gradient does the forward's work,
  # though the input gradient's lhs dilation and padding hold zeros.
  def loss(x, kernel):
    y = jax.lax.conv_general_dilated(
        x, kernel, (2, 2), 'VALID',
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    return jnp.sum(y.astype(jnp.float32))

  text = bf16_audit.export_text(jax.value_and_grad(loss, argnums=(0, 1)),
                                _bf16(2, 20, 20, 8), _bf16(9, 9, 8, 16))
  convs = [p for p in bf16_audit.products(text) if p.kind == 'convolution']
  assert len(convs) == 3
  assert {p.flops for p in convs} == {2 * 2 * 6 * 6 * 81 * 8 * 16}


def test_elementwise_ops_are_counted_before_fusion():
  text = bf16_audit.export_text(lambda x: jnp.sin(x) * 2 + 1, _bf16(4))
  counts = bf16_audit.op_counts(text)
  assert counts['by_op']['stablehlo.sine'] == 1
  assert counts['main_ops'] >= 3 and counts['while'] == 0
  assert counts['converts'] == {}


def test_ops_are_counted_by_what_made_them():
  text = bf16_audit.export_text(_planted, _bf16(8, 16), _bf16(16, 16))
  counts = bf16_audit.ops_by_layer(text)
  # Two products, the two converts and the sum, all made by _planted.
  assert counts['_planted'] >= 5, counts
  assert sum(counts.values()) == bf16_audit.op_counts(text)['all_ops']


def test_em_votes_are_bfloat16_products_on_a_gpu():
  # On a CPU the votes product runs in float32 (XLA:CPU's bfloat16 batched
  # dot is no faster); on a GPU in the votes' dtype, close to float32's.
  poses = jax.random.normal(jax.random.key(0), (3, 5, 4, 4))
  weights = jax.random.normal(jax.random.key(1), (5, 2, 4, 4))
  low = (jnp.asarray(poses, jnp.bfloat16), jnp.asarray(weights, jnp.bfloat16))
  text = bf16_audit.export_text(votes_lib.matrix_votes, *low)
  [product] = bf16_audit.products(text)
  assert product.types == ('bf16', 'bf16', 'bf16')
  with bf16_audit.as_on_gpu():
    on_gpu = votes_lib.matrix_votes(*low)
  exact = votes_lib.matrix_votes(*(jnp.asarray(x, jnp.float32) for x in low))
  assert on_gpu.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(on_gpu, np.float32), exact,
                             rtol=2e-2, atol=2e-2)


def _audit(spec, batch_size=64, **options):
  text = bf16_audit.export_train_step(spec, batch_size=batch_size,
                                      options=options)
  found = bf16_audit.audit_text(text)
  return text, found


def test_the_smoke_capsnet_step_has_no_unjustified_float32_product():
  text, found = _audit('capsnet_mnist:smoke', batch_size=16)
  assert not bf16_audit.unjustified(found), bf16_audit.table(found)
  # The decoder's products are bfloat16 (a float32 mask once made them
  # float32), the routing's float32 and justified.
  decoder = [p for p in found if p.types[0] == 'bf16' and p.kind ==
             'dot_general' and 'products.py' in p.source]
  assert len(decoder) == 9, bf16_audit.table(found)
  routing = [p for p in found if 'routing/dynamic.py' in p.source]
  assert routing and all(p.float32 and p.reason for p in routing)


@pytest.mark.slow
@pytest.mark.parametrize('spec', sorted(bf16_audit.FAMILIES.values()))
def test_every_family_bf16_step_has_no_unjustified_float32_product(spec):
  _, found = _audit(spec)
  bad = bf16_audit.unjustified(found)
  assert not bad, bf16_audit.table(bad)
  assert any(p.types[0] == 'bf16' for p in found)


@pytest.mark.slow
def test_the_em_step_with_the_pallas_window_kernel():
  text, found = _audit('matrix_capsnet_mnist', implementation='pallas')
  assert not bf16_audit.unjustified(found), bf16_audit.table(found)
  # ConvCaps1 and ConvCaps2 route in Triton kernels, forward and backward.
  assert bf16_audit.op_counts(text)['custom_calls'] == 4
