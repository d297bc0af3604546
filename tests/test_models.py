"""Tests for capsjax.models: registry, parameter counts, calls under jit."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from capsjax import families
from capsjax import models
from capsjax import routing
from capsjax import training
from tests.conftest import unit_tier_keeps
from tests.helpers import created_model

# Small widths: the full models are slow to compile and run on a CPU.
SMALL_CAPSNET = dict(conv1_channels=16, primary_types=4,
                     decoder_widths=(32, 64))
SMALL_MATRIX = dict(A=8, B=4, C=4, D=4)
SMALL_TRUNK = dict(trunk_widths=(8, 8, 16, 16))


def _images(seed, shape):
  rng = np.random.default_rng(seed)
  return rng.uniform(size=shape).astype(np.float32)


def _abstract(name, **options):
  """The model with abstract parameters: counts and errors without compute."""
  return nnx.eval_shape(
      lambda: models.create_model(name, rngs=nnx.Rngs(0), **options))


def _all_finite(tree):
  return all(bool(np.all(np.isfinite(x))) for x in jax.tree.leaves(tree))


@functools.partial(nnx.jit, static_argnames=('loss_key', 'train'))
@functools.partial(nnx.value_and_grad, has_aux=True)
def _loss_and_grads(model, images, labels, loss_key, train=True):
  out = model(images, labels, train=train)
  return sum(jnp.sum(v) for k, v in out.items() if k in loss_key), out


# ----------------------------------------------------------------------------
# Registry.


def test_registry_lists_every_model_with_a_family():
  names = models.list_models()
  assert names == ('baseline_cnn', 'capsnet', 'efficient_capsnet',
                   'matrix_capsnet', 'routing_study_net', 'two_digit_baseline',
                   'two_digit_capsnet')
  assert {name: families.of(name).name for name in names} == {
      'baseline_cnn': 'cnn', 'capsnet': 'capsnet',
      'efficient_capsnet': 'capsnet', 'matrix_capsnet': 'em',
      'routing_study_net': 'capsnet', 'two_digit_baseline': 'two_digit',
      'two_digit_capsnet': 'two_digit'}
  assert {training.runs.trainer_of(families.of(name)).__name__
          for name in names} == {'capsjax.training.vector_capsules',
                                 'capsjax.training.matrix_capsules'}
  assert families.of(_abstract('two_digit_baseline')) is families.of(
          'two_digit_capsnet')
  with pytest.raises(ValueError, match='valid names: baseline_cnn, capsnet'):
    families.of('capsule_net')
  assert models.model_options('capsnet')['num_iterations'] == 3


@pytest.mark.parametrize('name,options,message', [
    ('capsule_net', {}, 'valid names: baseline_cnn, capsnet'),
    ('capsnet', {'iterations': 3}, r"unknown option\(s\) \['iterations'\]"),
    ('capsnet', {'num_iterations': 0}, 'num_iterations'),
    ('capsnet', {'conv1_channels': -8}, 'conv1_channels must be a positive'),
    ('capsnet', {'primary_types': 0}, 'primary_types must be a positive'),
    ('capsnet', {'primary_kernel': 0}, 'primary_kernel must be a positive'),
    ('capsnet', {'conv1_kernel': 40}, 'kernel size 40 is larger than the'),
    ('baseline_cnn', {'kernel_size': -5}, 'kernel_size must be a positive'),
    ('matrix_capsnet', {'caps2_stride': 0}, 'caps2_stride must be a positive'),
    ('two_digit_capsnet', {'capsule_dim': -1}, 'capsule_dim must be'),
    ('capsnet', {'decoder_widths': (512, 0)}, 'decoder_widths'),
    ('capsnet', {'input_shape': (8, 8, 1)}, 'larger than the input'),
    ('capsnet', {'implementation': 'fft'}, 'implementation must be'),
    ('baseline_cnn', {'fc_widths': (328, -1)}, 'fc_widths'),
    ('baseline_cnn', {'dropout_rate': 1.5}, 'dropout_rate'),
    ('matrix_capsnet', {'input_shape': (16, 16, 1)}, 'larger than the input'),
    ('matrix_capsnet', {'A': 0}, 'A must be'),
    ('matrix_capsnet', {'num_iterations': 0}, 'num_iterations'),
    ('matrix_capsnet', {'caps1_iterations': -1}, 'caps1_iterations'),
    ('matrix_capsnet', {'init': 'xavier'}, 'init'),
    ('matrix_capsnet', {'activation_form': 'gmm'}, 'activation_form'),
    ('two_digit_capsnet', {'trunk_widths': (8, 8)}, 'trunk_widths'),
    ('two_digit_baseline', {'hidden_width': -1}, 'hidden_width'),
])
def test_bad_names_and_options_raise_clear_errors(name, options, message):
  with pytest.raises(ValueError, match=message):
    _abstract(name, **options)


def test_bad_images_raise_clear_errors():
  capsnet = _abstract('capsnet', **SMALL_CAPSNET)
  with pytest.raises(ValueError, match=r'images must be \[B, 28, 28, 1\]'):
    capsnet(np.zeros((2, 32, 32, 1), np.float32))
  trunk = _abstract('two_digit_capsnet', **SMALL_TRUNK)
  with pytest.raises(ValueError, match='at least 14x14'):
    trunk(np.zeros((2, 12, 28, 1), np.float32))


# Every model in the registry: small options and the input it expects
# (None: any height and width >= 14).
REGISTRY_INPUTS = {
    'capsnet': (SMALL_CAPSNET, (28, 28), 1),
    'baseline_cnn': ({'conv_channels': (4, 4, 4), 'fc_widths': (8, 8)},
                     (28, 28), 1),
    'efficient_capsnet': ({'conv_channels': (4, 4, 4, 8), 'primary_dim': 4,
                           'decoder_widths': (8, 8)}, (28, 28), 1),
    'matrix_capsnet': (SMALL_MATRIX, (32, 32), 1),
    'two_digit_baseline': (SMALL_TRUNK, None, 1),
    'two_digit_capsnet': (SMALL_TRUNK, None, 1),
    'routing_study_net': ({'stem_widths': (4, 4, 8, 8), 'primary_types': 2,
                           'capsule_dim': 16}, None, 1),
}


@pytest.mark.parametrize('name', unit_tier_keeps(
    models.list_models(), 'capsnet', 'matrix_capsnet'))
def test_bfloat16_forward_keeps_class_scores_distinct(name):
  """In bfloat16 compute the class scores are still float32 (capsule
  lengths, EM activations, Su's sigmoids): as many distinct values as in
  float32, and the same predictions where float32's top two are apart."""
  from capsjax.training import state as state_lib
  options, spatial, channels = REGISTRY_INPUTS[name]
  model = created_model(name, **options)
  h, w = spatial or (28, 28)
  images = jax.jit(jax.random.uniform, static_argnums=1)(
      jax.random.key(1), (16, h, w, channels))

  # Jitted, as training runs them (and one compilation, not one per op);
  # the bfloat16 copy of the parameters made inside.
  @functools.partial(nnx.jit, static_argnames='low')
  def forward(model, images, low):
    if low:
      graphdef, params, rest = nnx.split(model, nnx.Param, ...)
      model = nnx.merge(graphdef, state_lib.cast_floating(
          params, jnp.bfloat16), rest)
      images = images.astype(jnp.bfloat16)
    return model(images)['class_scores']

  high = np.asarray(forward(model, images, low=False))
  low = forward(model, images, low=True)
  if name == 'baseline_cnn':  # logits, not a score in [0, 1]
    return
  assert low.dtype == jnp.float32, name
  low = np.asarray(low)
  assert len(np.unique(low)) == len(np.unique(high)), name


@pytest.mark.parametrize('name', models.list_models())
def test_every_model_rejects_wrong_images_naming_expected_and_got(name):
  options, spatial, channels = REGISTRY_INPUTS[name]
  model = _abstract(name, **options)
  h, w = spatial or (28, 28)
  expected = (f'[B, {h}, {w}, {channels}]' if spatial
              else f'[B, H, W, {channels}]')
  wrong_shapes = [(2, h, w, channels + 2), (2, h, w), (h, w, channels)]
  if spatial:
    wrong_shapes.append((2, h + 4, w, channels))
  # NumPy inputs: a jnp.zeros would compile once per shape and dtype.
  for shape in wrong_shapes:
    with pytest.raises(ValueError) as info:
      model(np.zeros(shape, np.float32))
    message = str(info.value)
    assert f'images must be {expected}' in message, message
    assert f'got shape {shape}' in message, message
  if not spatial:
    with pytest.raises(ValueError, match=r'at least 14x14 .*got \(2, 12, 40'):
      model(np.zeros((2, 12, 40, channels), np.float32))
  for dtype in (jnp.uint8, jnp.int32, jnp.bool_, jnp.bfloat16):
    with pytest.raises(ValueError, match=rf'images must be float32 \(the dtype '
                       rf'of the model.s parameters\).* got {dtype.__name__}'):
      model(np.zeros((2, h, w, channels), dtype))
  with pytest.raises(ValueError, match='to_float converts uint8'):
    model(np.zeros((2, h, w, channels), np.uint8))
  # The expected input passes the checks (abstractly: no compute).
  nnx.eval_shape(lambda: models.create_model(name, rngs=nnx.Rngs(0),
                                             **options)(
      jnp.zeros((2, h, w, channels), jnp.float32)))


# ----------------------------------------------------------------------------
# Parameter counts.


def test_capsnet_parameter_count():
  model = _abstract('capsnet')
  assert models.count_params(model.conv1) == 20_992
  assert models.count_params(model.primary) == 5_308_672
  assert models.count_params(model.digit) == 1_474_560 + 160
  assert models.count_params(model.decoder) == 1_411_344
  assert models.count_params(model) == 8_215_728
  assert models.count_params(_abstract('capsnet', use_bias=False)) == 8_215_568
  assert models.count_params(
      _abstract('capsnet', reconstruction=False)) == 6_804_384


def test_baseline_cnn_parameter_count():
  # 35.4M in the paper: 'SAME' 5x5 convs without pooling, FC 328, FC 192.
  assert models.count_params(_abstract('baseline_cnn')) == 35_445_522


@pytest.mark.parametrize('options,expected', [
    ({}, 316_394),  # A = B = C = D = 32; the paper's "310K"
    ({'A': 64, 'B': 8, 'C': 16, 'D': 16}, 67_154),  # the paper's "68K"
])
def test_matrix_capsnet_parameter_count(options, expected):
  model = _abstract('matrix_capsnet', **options)
  assert models.count_params(model) == expected
  assert model.grid_sizes == ((14, 6, 4), (14, 6, 4))


def test_two_digit_parameter_counts():
  # Su's post: "about 270K" for both; neither depends on the input size.
  assert models.count_params(_abstract('two_digit_baseline')) == 276_810
  assert models.count_params(_abstract('two_digit_capsnet')) == 279_488


# ----------------------------------------------------------------------------
# Calls under jit.


def test_capsnet_small_outputs_masks_and_grads():
  dims = chex.Dimensions(B=2, K=10, D=16, I=6 * 6 * 4, N=28 * 28)
  model = created_model('capsnet', **SMALL_CAPSNET)
  images = _images(0, (dims.B, 28, 28, 1))
  labels = np.array([3, 7], np.int32)
  multi_hot = np.zeros((dims.B, dims.K), np.float32)
  multi_hot[0, [1, 2]] = multi_hot[1, 5] = 1.0

  @nnx.jit
  def run(model, images, labels, multi_hot):
    def decode(capsules, mask):
      flat = (capsules * mask[..., None]).reshape(capsules.shape[0], -1)
      return jax.nn.sigmoid(model.decoder(flat))
    train = model(images, labels, train=True)
    multi = model(images, multi_hot, train=True)
    test = model(images, labels, train=False)
    longest = jax.nn.one_hot(jnp.argmax(test['class_scores'], -1), 10)
    refs = (decode(train['capsules'], jax.nn.one_hot(labels, 10)),
            decode(train['capsules'], multi_hot),
            decode(test['capsules'], longest))
    return train, multi, test, refs

  train, multi, test, refs = run(model, images, labels, multi_hot)
  chex.assert_shape(train['class_scores'], dims['BK'])
  chex.assert_shape(train['capsules'], dims['BKD'])
  chex.assert_shape(train['coupling'], dims['BIK'])
  chex.assert_shape(train['reconstructions'], dims['BN'])
  lengths = np.asarray(train['class_scores'])
  assert np.all((lengths >= 0) & (lengths < 1))
  np.testing.assert_allclose(lengths, np.linalg.norm(train['capsules'],
                                                     axis=-1), rtol=1e-5)
  np.testing.assert_allclose(np.sum(train['coupling'], -1), 1.0, rtol=1e-5)
  for out, ref in zip((train, multi, test), refs, strict=True):
    np.testing.assert_allclose(out['reconstructions'], ref, rtol=1e-5,
                               atol=1e-6)
  # Routing does not see the labels.
  np.testing.assert_allclose(test['capsules'], train['capsules'], rtol=1e-6)

  (value, out), grads = _loss_and_grads(
      model, images, labels, loss_key=('class_scores', 'reconstructions'))
  assert np.isfinite(value) and _all_finite(grads)
  chex.assert_trees_all_equal_shapes(grads, nnx.state(model, nnx.Param))


def test_full_capsnet_forward():
  dims = chex.Dimensions(B=2, K=10, D=16, I=1152, N=784)
  # Built and run as one program: only shapes and finiteness are checked.
  out = jax.jit(lambda x: models.create_model('capsnet', rngs=nnx.Rngs(0))(x))(
      _images(1, (dims.B, 28, 28, 1)))
  chex.assert_shape(out['class_scores'], dims['BK'])
  chex.assert_shape(out['capsules'], dims['BKD'])
  chex.assert_shape(out['coupling'], dims['BIK'])
  chex.assert_shape(out['reconstructions'], dims['BN'])
  assert _all_finite(out)


def test_baseline_cnn_small_dropout_only_in_training():
  model = nnx.jit(lambda: models.create_model(
      'baseline_cnn', rngs=nnx.Rngs(params=0, dropout=1),
      conv_channels=(8, 8, 4), fc_widths=(16, 8)))()
  images = _images(2, (3, 28, 28, 1))
  forward = nnx.jit(lambda m, x, train: m(x, train=train)['class_scores'],
                    static_argnames='train')
  eval_1, eval_2 = forward(model, images, False), forward(model, images, False)
  train_1, train_2 = forward(model, images, True), forward(model, images, True)
  chex.assert_shape(eval_1, (3, 10))
  np.testing.assert_array_equal(eval_1, eval_2)
  assert not np.allclose(train_1, train_2)  # A fresh mask each step.
  assert not np.allclose(train_1, eval_1)


def test_matrix_capsnet_small_outputs_and_grads():
  dims = chex.Dimensions(B=2, K=5, P=4)
  model = created_model('matrix_capsnet', **SMALL_MATRIX)
  images = _images(3, (dims.B, 32, 32, 1))
  (value, out), grads = _loss_and_grads(
      model, images, None, loss_key=('class_scores', 'poses'))
  chex.assert_shape(out['class_scores'], dims['BK'])
  chex.assert_shape(out['poses'], dims['BKPP'])
  acts = np.asarray(out['class_scores'])
  assert np.all((acts > 0) & (acts < 1))
  assert np.isfinite(value) and _all_finite(grads)
  # Blank images: every pose equal; still finite (the same compiled program).
  (value, _), grads = _loss_and_grads(
      model, np.zeros_like(images), None, loss_key=('class_scores', 'poses'))
  assert np.isfinite(value) and _all_finite(grads)


def test_matrix_capsnet_options_reach_the_layers_on_mnist_shapes():
  # Abstract (eval_shape) model and call: the plumbing, without compiling
  # a second EM network (the layers' tests run these options for real).
  model = _abstract(
      'matrix_capsnet', input_shape=(28, 28, 1), num_classes=10,
      init='authors', em_routing='authors',
      em_routing_overrides={'normalize_across_positions': True,
                            'normalize_cost': True,
                            'inverse_temperature': 1.0}, remat=True,
      votes_dtype=jnp.bfloat16,
      class_inverse_temperature=(0.001, 0.002, 0.003), **SMALL_MATRIX)
  assert model.grid_sizes == ((12, 5, 3), (12, 5, 3))
  for layer in (model.caps1, model.caps2):
    assert layer.remat
    assert layer.votes_dtype == jnp.bfloat16
    assert layer.em_routing == routing.EMRouting(
        num_iterations=3, inverse_temperature=1.0, variance_epsilon=5e-4,
        normalize_cost=True, center_momentum=0.1, activation_form='authors',
        normalize_across_positions=True)
  assert model.class_caps.em_routing.inverse_temperature == (
      0.001, 0.002, 0.003)
  out = nnx.eval_shape(lambda m, x: m(x), model,
                       jax.ShapeDtypeStruct((2, 28, 28, 1), jnp.float32))
  assert out['class_scores'].shape == (2, 10)
  assert out['poses'].shape == (2, 10, 4, 4)
  assert out['poses'].dtype == jnp.float32


@pytest.mark.parametrize('inverse_temperature, expected', [
    (None, tuple(0.0025 * (1 - 0.95**(t + 1)) for t in range(3))),
    (1.0, 0.25),
    ((0.4, 0.8, 1.2), (0.1, 0.2, 0.3))])
def test_matrix_capsnet_class_lambda_scale(inverse_temperature, expected):
  """The class layer's lambda is class_lambda_scale times the others' (the
  released code's final lambda / 4), whatever form lambda takes."""
  model = _abstract('matrix_capsnet', input_shape=(28, 28, 1),
                    num_classes=10, em_routing=routing.EMRouting(
                        inverse_temperature=inverse_temperature),
                    class_lambda_scale=0.25, **SMALL_MATRIX)
  assert model.caps2.em_routing.inverse_temperature == inverse_temperature
  np.testing.assert_allclose(
      model.class_caps.em_routing.inverse_temperature, expected,
      rtol=1e-12)


@pytest.mark.parametrize('bad', [(None,), 'x', ((1.0, 2.0),), float('nan')])
def test_matrix_capsnet_rejects_a_bad_inverse_temperature(bad):
  with pytest.raises(ValueError, match='inverse_temperature must be None'):
    _abstract('matrix_capsnet', input_shape=(28, 28, 1), num_classes=10,
              class_inverse_temperature=bad, **SMALL_MATRIX)
  with pytest.raises(ValueError, match='class_lambda_scale must be > 0'):
    _abstract('matrix_capsnet', input_shape=(28, 28, 1), num_classes=10,
              class_lambda_scale=0.0, **SMALL_MATRIX)


def test_matrix_capsnet_caps1_iterations_override_only_convcaps1():
  model = _abstract('matrix_capsnet', input_shape=(24, 24, 1), num_classes=10,
                    em_routing='capsjax', caps1_iterations=1, **SMALL_MATRIX)
  assert model.grid_sizes == ((10, 4, 2), (10, 4, 2))
  iterations = [layer.em_routing.num_iterations
                for layer in (model.caps1, model.caps2, model.class_caps)]
  assert iterations == [1, 2, 2]
  default = _abstract('matrix_capsnet',
                      em_routing_overrides={'num_iterations': 2},
                      **SMALL_MATRIX)
  assert default.caps1.em_routing.num_iterations == 2
  # The flat routing options of older configs still build the same layers.
  flat = _abstract('matrix_capsnet', num_iterations=2, normalize_cost=True,
                   inverse_temperature=1.0, **SMALL_MATRIX)
  assert flat.caps2.em_routing == routing.CAPSJAX_EM


def test_matrix_capsnet_init_options():
  paper = created_model('matrix_capsnet', **SMALL_MATRIX)
  authors = created_model('matrix_capsnet', init='authors', **SMALL_MATRIX)
  np.testing.assert_allclose(paper.caps1.beta_a[...], 0.0)
  np.testing.assert_allclose(authors.caps1.beta_a[...], 0.5)
  np.testing.assert_allclose(authors.caps2.beta_u[...], 0.5)
  np.testing.assert_allclose(authors.class_caps.beta_a[...], 1.0)
  np.testing.assert_allclose(authors.class_caps.beta_u[...], 2.0)
  assert float(np.std(authors.class_caps.weights[...])) < 0.02


@pytest.mark.parametrize('name', ['two_digit_baseline', 'two_digit_capsnet'])
def test_two_digit_models_accept_any_width(name):
  model = created_model(name, **SMALL_TRUNK)

  @nnx.jit
  def run(model, single, pair):
    grad_fn = nnx.value_and_grad(
        lambda m: (jnp.sum(m(pair)['class_scores']), m(pair)), has_aux=True)
    return model(single), grad_fn(model)

  single, ((value, pair), grads) = run(
      model, _images(5, (2, 28, 28, 1)), _images(6, (2, 28, 56, 1)))
  chex.assert_shape(single['class_scores'], (2, 10))
  chex.assert_shape(pair['class_scores'], (2, 10))
  assert np.isfinite(value) and _all_finite(grads)
  for out in (single, pair):
    scores = np.asarray(out['class_scores'])
    assert np.all((scores >= 0) & (scores <= 1))
  if name == 'two_digit_capsnet':
    chex.assert_shape(single['capsules'], (2, 10, 16))
    chex.assert_shape(single['coupling'], (2, 8 * 8, 10))
    chex.assert_shape(pair['coupling'], (2, 8 * 22, 10))
    np.testing.assert_allclose(
        single['class_scores'], np.linalg.norm(single['capsules'], axis=-1),
        rtol=1e-5)


def test_matrix_capsnet_transform_std_sets_every_em_layers_init():
  model = created_model('matrix_capsnet', input_shape=(28, 28, 1),
                        num_classes=10, A=8, B=8, C=8, D=8, transform_std=1.0)
  for layer in (model.caps1, model.caps2, model.class_caps):
    assert abs(float(np.std(layer.weights[...])) - 1.0) < 0.1
  default = created_model('matrix_capsnet', input_shape=(28, 28, 1),
                          num_classes=10, A=8, B=8, C=8, D=8)
  assert abs(float(np.std(default.caps1.weights[...])) - 0.5) < 0.05
  with pytest.raises(ValueError, match='transform_std must be > 0'):
    models.create_model('matrix_capsnet', rngs=nnx.Rngs(0), transform_std=0.0)
  with pytest.raises(ValueError, match="init='paper' only"):
    models.create_model('matrix_capsnet', rngs=nnx.Rngs(0), init='authors',
                        transform_std=1.0)


def test_matrix_capsnet_authors_coordinates_follow_its_layers():
  # Abstract: the offsets are set at construction, no weights needed.
  model = _abstract('matrix_capsnet', input_shape=(32, 32, 1), A=8, B=2, C=2,
                    D=2, num_classes=5, coordinate_form='authors')
  rows, cols = model.class_caps.coordinate_offsets
  np.testing.assert_allclose(rows, [-0.08, -0.04, 0.0, 0.04], atol=1e-12)
  np.testing.assert_allclose(cols, rows, atol=1e-12)
  grid = _abstract('matrix_capsnet', input_shape=(32, 32, 1), A=8, B=2, C=2,
                   D=2, num_classes=5)
  assert grid.class_caps.coordinate_offsets is None
  with pytest.raises(ValueError, match="coordinate_form must be 'grid', "
                     "'authors'"):
    models.create_model('matrix_capsnet', coordinate_form='centre', rngs=nnx.Rngs(0))
