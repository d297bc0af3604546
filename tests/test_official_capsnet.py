"""The official CapsNet (form='official') against a float64 NumPy reference.

The reference below is written from reading the official TensorFlow code
(Sarasra/models, research/capsules: models/capsule_model.py and
models/layers/layers.py) in that code's own layout: NCHW convolutions, the
primary capsules as ``conv_slim_capsule`` (a [B, 1, 32, 8, H, W] vote tensor
routed once over its single input capsule, its bias [32, 8] tiled over the
grid), capsules ordered (type, row, column), DigitCaps as ``capsule`` (one
[I, 8, 10*16] weight tensor), the masked decoder, ``_margin_loss`` reduced by
a mean over batch and classes, and the reconstruction term 0.0005 * the mean
over the batch of the summed squared error. capsjax's weights are mapped
into that layout, so the test also checks the permutation between the two
capsule orders.
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from capsjax import families
from capsjax import kernels
from capsjax import layers
from capsjax import losses
from capsjax import models

# ----------------------------------------------------------------------------
# The reference, float64, in the official code's layout.


# Written against an array module ``xp``: NumPy (complex inputs too, for
# complex-step derivatives: hence relu and the comparisons on the real part)
# or jax.numpy (its gradient, element by element).


def _conv_nchw(x, kernel, stride, xp=np):
  """VALID convolution: x [N, C, H, W], kernel [K, K, C, F] -> [N, F, H', W']."""
  k = kernel.shape[0]
  out_h = (x.shape[2] - k) // stride + 1
  out_w = (x.shape[3] - k) // stride + 1
  # Every kernel offset's strided window, [K*K, N, C, H', W'], contracted with
  # the kernel in one einsum (one op, not K*K: jax.grad of the reference
  # compiles in seconds).
  windows = xp.stack([x[:, :, di:di + stride * out_h:stride,
                        dj:dj + stride * out_w:stride]
                      for di in range(k) for dj in range(k)])
  return xp.einsum('knchw,kcf->nfhw', windows,
                   kernel.reshape(k * k, *kernel.shape[2:]), optimize=True)


def _relu(x):
  return x * (x.real > 0)


def _squash(x, axis, xp=np):
  """The official ``_squash`` (no epsilon: no zero vectors reach it here)."""
  norm = xp.sqrt(xp.sum(x * x, axis=axis, keepdims=True))
  return x / norm * (norm**2 / (1.0 + norm**2))


def _route_softmax(logits, leaky, xp=np):
  """Softmax over axis 2 (the output capsules); leaky: an extra zero logit
  in front, dropped after the softmax."""
  if leaky:
    zero = xp.zeros_like(logits[:, :, :1])
    logits = xp.concatenate([zero, logits], axis=2)
  e = xp.exp(logits - logits.real.max(axis=2, keepdims=True))
  route = e / e.sum(axis=2, keepdims=True)
  return route[:, :, 1:] if leaky else route


def _routing(votes, biases, num_routing, leaky, xp=np):
  """``_update_routing``: votes [B, I, O, D, ...] -> activations [B, O, D, ...].

  Logits [B, I, O, ...] start at 0 and grow by <vote, activation> after
  every iteration; the last iteration's activation is returned.
  """
  logits = xp.zeros(votes.shape[:3] + votes.shape[4:], votes.dtype)
  for _ in range(num_routing):
    route = _route_softmax(logits, leaky, xp)
    preactivate = xp.sum(route[:, :, :, None] * votes, axis=1) + biases
    activation = _squash(preactivate, axis=2, xp=xp)
    logits = logits + xp.sum(votes * activation[:, None], axis=3)
  return activation


def official_forward(params, images, labels, *, num_routing, leaky,
                     num_types=32, atoms=8, out_atoms=16, xp=np):
  """The official CapsuleModel.inference + evaluate, float64 (or complex128
  parameters for complex-step derivatives; ``xp``: numpy or jax.numpy).

  Args:
    params: the official variables: conv1 (weights [9, 9, C, 256], biases),
      conv_capsule1 (weights [9, 9, 256, T*8], biases [T, 8, 1, 1]), capsule2
      (weights [I, 8, K*16], biases [K, 16]) and recons (three (weights,
      biases) pairs).
    images: [B, C, H, W]; labels: int [B].
  Returns:
    logits [B, K] (capsule lengths), remakes [B, C*H*W], total loss.
  """
  batch = images.shape[0]
  conv1 = _conv_nchw(images, params['conv1_w'], 1, xp)
  relu1 = _relu(conv1 + params['conv1_b'][None, :, None, None])
  # conv_slim_capsule(input_dim=1, output_dim=T, num_routing=1): votes
  # [B, 1, T, 8, H', W'], routed once over the single input capsule.
  conv = _conv_nchw(relu1, params['caps1_w'], 2, xp)
  votes = conv.reshape(batch, 1, num_types, atoms, *conv.shape[2:])
  capsule1 = _routing(votes, params['caps1_b'][None], 1, leaky, xp)
  # [B, T, 8, H', W'] -> [B, T, H', W', 8] -> [B, T*H'*W', 8].
  capsule1_3d = xp.transpose(capsule1, (0, 1, 3, 4, 2)).reshape(
      batch, -1, atoms)
  # capsule(): votes [B, I, K, 16] from weights [I, 8, K*16].
  num_classes = params['caps2_b'].shape[0]
  votes2 = xp.einsum('bic,ico->bio', capsule1_3d, params['caps2_w']).reshape(
      batch, -1, num_classes, out_atoms)
  capsules = _routing(votes2, params['caps2_b'][None], num_routing, leaky, xp)
  logits = xp.sqrt(xp.sum(capsules**2, axis=-1))
  # reconstruction(): the label's capsule only, FC 512 ReLU, FC 1024 ReLU,
  # FC pixels sigmoid.
  one_hot = np.eye(num_classes)[labels]
  hidden = (capsules * one_hot[..., None]).reshape(batch, -1)
  for i, (w, b) in enumerate(params['recons']):
    hidden = hidden @ w + b
    hidden = _relu(hidden) if i < 2 else 1.0 / (1.0 + xp.exp(-hidden))
  remakes = hidden
  # _margin_loss on logits - 0.5 with margin 0.4, downweight 0.5, then
  # reduce_mean over batch and classes; + 0.0005 * batch mean of the summed
  # squared error.
  shifted = logits - 0.5
  positive = one_hot * (shifted.real < 0.4) * (shifted - 0.4)**2
  negative = (1 - one_hot) * (shifted.real > -0.4) * (shifted + 0.4)**2
  margin = xp.mean(0.5 * positive + 0.5 * 0.5 * negative)
  target = images.reshape(batch, -1)
  reconstruction = 0.0005 * xp.mean(xp.sum((remakes - target)**2, axis=-1))
  return logits, remakes, margin + reconstruction


def official_params(model: models.CapsNet) -> dict:
  """capsjax's CapsNet parameters, float64, in the official code's layout."""
  as_np = lambda p: np.asarray(p[...], np.float64)  # noqa: E731
  digit_w = as_np(model.digit.weights)  # [I, K, 8, 16], I in (row, col, type)
  num_in, num_classes, atoms, out_atoms = digit_w.shape
  types = model.primary.num_types
  grid = num_in // types
  # Official capsule i = type * grid + position; capsjax's position * types
  # + type.
  official_order = np.arange(num_in).reshape(grid, types).T.reshape(-1)
  caps2_w = digit_w[official_order].transpose(0, 2, 1, 3).reshape(
      num_in, atoms, num_classes * out_atoms)
  return {
      'conv1_w': as_np(model.conv1.kernel), 'conv1_b': as_np(model.conv1.bias),
      'caps1_w': as_np(model.primary.conv.kernel),
      'caps1_b': as_np(model.primary.conv.bias).reshape(types, -1, 1, 1),
      'caps2_w': caps2_w, 'caps2_b': as_np(model.digit.bias),
      'recons': [(as_np(layer.kernel), as_np(layer.bias))
                 for layer in model.decoder.layers]}


# ----------------------------------------------------------------------------
# Tests.


def _official_model(seed, **options):
  """An official-form CapsNet, float64, its biases made distinct (the 0.1
  constants would hide a bias added on the wrong axis)."""
  model = models.create_model('capsnet', rngs=nnx.Rngs(seed), form='official',
                              **options)
  state = nnx.state(model, nnx.Param)
  rng = np.random.default_rng(seed)

  def widen(path, leaf):
    value = np.asarray(leaf, np.float64)
    if 'bias' in jax.tree_util.keystr(path):
      value = value + 0.05 * rng.standard_normal(value.shape)
    return jnp.asarray(value, jnp.float64)

  nnx.update(model, jax.tree_util.tree_map_with_path(widen, state))
  return model


_SMALL = {'input_shape': (20, 20, 1), 'conv1_channels': 12,
          'primary_types': 5, 'decoder_widths': (24, 32)}


@pytest.mark.parametrize('options, num_routing, leaky', [
    # Smaller widths, leaky routing in both layers, 2 iterations (first: it
    # fails fastest, and the mutation check stops at the first failure).
    (_SMALL | {'num_iterations': 2, 'leaky': True}, 2, True),
    # The same widths routed as the MNIST model is: 3 iterations, not leaky.
    (_SMALL, 3, False),
    # The MNIST model as the official code builds it: the same code at full
    # size, 19 s on an idle 2-core CPU, so in the slow tier.
    pytest.param({}, 3, False, marks=pytest.mark.slow),
])
def test_official_capsnet_matches_the_official_code(options, num_routing,
                                                    leaky):
  """Outputs, loss and the gradient of every parameter, in float64.

  The reference gradient is jax.grad of the reference run on jax.numpy,
  checked itself against complex-step derivatives of the NumPy reference
  along a random direction per parameter. capsjax's gradient must match it
  element by element to 1e-9 relative, each element within 1e-10 of its
  parameter's largest gradient entry absolute (entries near zero).
  """
  height, width, _ = options.get('input_shape', (28, 28, 1))
  rng = np.random.default_rng(7)
  images = rng.uniform(size=(3, height, width, 1))
  labels = np.array([3, 0, 9])
  types = options.get('primary_types', 32)
  with jax.enable_x64(True):
    model = _official_model(1, **options)
    config = ml_collections.ConfigDict({'reconstruction_weight': 0.0005,
                                        'loss_form': 'official'})
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def forward(params, x, y):
      def loss_of(params):
        model = nnx.merge(graphdef, params, rest)
        outputs = model(x, y, train=True)
        loss, _ = families.of(model).loss(outputs, y, config, images=x)
        return jnp.mean(loss), (outputs['class_scores'],
                                outputs['reconstructions'])

      (loss, (lengths, remakes)), grads = jax.value_and_grad(
          loss_of, has_aux=True)(params)
      return lengths, remakes, loss, grads

    inputs = (params, jnp.asarray(images, jnp.float64), jnp.asarray(labels))
    # The full-size model compiled optimised: at the suite's level 0
    # (conftest) its float64 step runs about 130 s on a 2-core CPU, at level
    # 2 about 6 s. The small ones compile faster at level 0.
    level = 0 if options else 2
    lengths, remakes, loss, grads = jax.jit(forward).lower(*inputs).compile(
        compiler_options={'xla_backend_optimization_level': level})(*inputs)
    assert lengths.dtype == jnp.float64
    assert {g.dtype for g in jax.tree.leaves(grads)} == {
        jnp.dtype(jnp.float64)}
    ref_params = official_params(model)
    got_grads = official_params(nnx.merge(graphdef, grads, rest))
    reference = functools.partial(
        official_forward, images=images.transpose(0, 3, 1, 2), labels=labels,
        num_routing=num_routing, leaky=leaky, num_types=types)
    # The reference broadcasts as NumPy does ([B, F] + [F]).
    with jax.numpy_rank_promotion('allow'):
      want_grads = jax.jit(jax.grad(lambda p: reference(p, xp=jnp)[2]))(
          ref_params)
  want = reference(ref_params)
  for got, expected in zip((lengths, remakes, loss), want, strict=True):
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-10,
                               atol=1e-12)
  # Every parameter: capsjax's 12 tensors are the reference's 12.
  names = [jax.tree_util.keystr(path) for path, _ in
           jax.tree_util.tree_leaves_with_path(ref_params)]
  assert len(names) == len(jax.tree.leaves(params)) == 12
  flat_got = jax.tree.leaves(got_grads)
  flat_want = [np.asarray(g) for g in jax.tree.leaves(want_grads)]
  for name, got, expected in zip(names, flat_got, flat_want, strict=True):
    np.testing.assert_allclose(got, expected, rtol=1e-9,
                               atol=1e-10 * np.max(np.abs(expected)),
                               err_msg=name)
  # The reference gradient against complex-step derivatives of the NumPy
  # reference: exact to rounding (no subtraction), one direction a tensor.
  leaves, treedef = jax.tree.flatten(ref_params)
  step = 1e-30
  for index, (name, expected) in enumerate(zip(names, flat_want,
                                               strict=True)):
    direction = rng.standard_normal(expected.shape)
    perturbed = list(leaves)
    perturbed[index] = leaves[index] + 1j * step * direction
    derivative = reference(jax.tree.unflatten(treedef, perturbed))[2].imag
    np.testing.assert_allclose(
        np.sum(expected * direction), derivative / step, rtol=1e-9,
        atol=1e-12 * np.sum(np.abs(expected * direction)), err_msg=name)


def test_text_form_differs_from_the_official_one_by_its_coupling():
  """The same weights in the text form: squash(conv + b) instead of
  squash(conv / 32 + b), so the primary capsules differ."""
  x = np.random.default_rng(0).uniform(size=(2, 12, 12, 6)).astype(np.float32)
  official = layers.PrimaryCapsules(6, 4, 8, 5, 2, form='official',
                                    rngs=nnx.Rngs(0))
  text = layers.PrimaryCapsules(6, 4, 8, 5, 2, rngs=nnx.Rngs(0))
  kernel = np.asarray(official.conv.kernel[...])
  bias = np.random.default_rng(1).standard_normal(32).astype(np.float32)
  for layer in (official, text):
    layer.conv.kernel[...] = kernel
    layer.conv.bias[...] = bias
  leaky = layers.PrimaryCapsules(6, 4, 8, 5, 2, form='official', leaky=True,
                                 rngs=nnx.Rngs(0))
  leaky.conv.kernel[...] = kernel
  leaky.conv.bias[...] = bias
  assert official.coupling == 1 / 4 and leaky.coupling == 1 / 5
  conv = np.asarray(kernels.conv2d(x, kernel, 2)).reshape(2, -1, 8)
  bias = bias.reshape(-1, 8)
  tiled = np.tile(bias, (conv.shape[1] // 4, 1))[None]
  for layer, scale in ((official, 1 / 4), (leaky, 1 / 5), (text, 1.0)):
    np.testing.assert_allclose(
        layer(x), np.asarray(_squash(conv * scale + tiled, axis=-1)),
        rtol=2e-5, atol=1e-6)


def test_official_initialisers():
  model = models.create_model('capsnet', rngs=nnx.Rngs(0), form='official')
  for param, std in ((model.conv1.kernel, 0.05),
                     (model.primary.conv.kernel, 0.1),
                     (model.digit.weights, 0.1),
                     (model.decoder.layers[1].kernel, 0.1)):
    values = np.asarray(param[...])
    # TF's truncated normal: cut at 2 std, so its std is 0.88 of the
    # normal's.
    assert np.max(np.abs(values)) <= 2 * std
    np.testing.assert_allclose(values.std(), 0.8796 * std, rtol=0.03)
  for bias in (model.conv1.bias, model.primary.conv.bias, model.digit.bias,
               model.decoder.layers[0].bias, model.decoder.layers[2].bias):
    np.testing.assert_array_equal(np.asarray(bias[...]), np.float32(0.1))
  text = models.create_model('capsnet', rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(np.asarray(text.conv1.bias[...]), 0.0)
  np.testing.assert_array_equal(np.asarray(text.decoder.layers[0].bias[...]),
                                0.0)
  # LeCun normal: std 1/sqrt(fan_in) = 1/9 for Conv1's 9x9x1 kernel.
  np.testing.assert_allclose(np.asarray(text.conv1.kernel[...]).std(), 1 / 9,
                             rtol=0.05)


def test_official_margin_loss_is_the_text_one_over_twice_the_classes():
  rng = np.random.default_rng(3)
  lengths = rng.uniform(size=(6, 10))
  labels = np.eye(10)[rng.integers(0, 10, 6)]
  text = np.asarray(losses.margin_loss(lengths, labels))
  official = np.asarray(losses.margin_loss(lengths, labels, form='official'))
  np.testing.assert_allclose(official, text / 20, rtol=1e-6)
  # And against the official _margin_loss written out.
  shifted = lengths - 0.5
  per_class = (0.5 * labels * (shifted < 0.4) * (shifted - 0.4)**2 +
               0.25 * (1 - labels) * (shifted > -0.4) * (shifted + 0.4)**2)
  np.testing.assert_allclose(official, per_class.mean(-1), rtol=1e-6)
  with pytest.raises(ValueError, match="form must be 'text' or 'official'"):
    losses.margin_loss(lengths, labels, form='authors')


def test_bad_form_raises_a_clear_error():
  with pytest.raises(ValueError, match='form must be one of'):
    models.create_model('capsnet', rngs=nnx.Rngs(0), form='tf')
