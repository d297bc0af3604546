"""Efficient-CapsNet: its model, augmentation, training step and configs.

The references are float64 NumPy transcriptions of the authors' code
(EscVM/Efficient-CapsNet: utils/layers.py, utils/pre_process_mnist.py),
of OpenCV's warpAffine (before 4.11) and of TF's ScaleAndTranslate.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from capsjax import families
from capsjax import models
from capsjax import nn
from capsjax.data import augment
from capsjax.training import state as state_lib
from capsjax.training import vector_capsules
from experiments.configs import efficient_capsnet_mnist
from experiments.configs import own_images
from tests.helpers import conv_reference
from tests.helpers import output_and_grads

# Small widths: primary 8 channels -> 2 capsules of 4 at 1x1 (28x28).
TINY = dict(conv_channels=(4, 4, 4, 8), primary_dim=4, digit_dim=4,
            decoder_widths=(8, 8), num_classes=3)
F64 = dict(rtol=1e-10, atol=1e-12)


def _abstract(**options):
  return nnx.eval_shape(lambda: models.create_model(
      'efficient_capsnet', rngs=nnx.Rngs(0), **options))


# One compiled program for the initialisers, not one per op and shape.
_tiny_model = nnx.jit(lambda: models.create_model(
    'efficient_capsnet', rngs=nnx.Rngs(0), **TINY))


def _images(seed, shape):
  return np.random.default_rng(seed).uniform(size=shape).astype(np.float32)


# ----------------------------------------------------------------------------
# The model.


def test_parameter_count_is_the_papers():
  model = _abstract(reconstruction=False)
  assert models.count_params(model) == 161_824
  assert [models.count_params(c) for c in model.convs] == [
      832, 18_496, 36_928, 73_856]
  assert sum(models.count_params(n) for n in model.norms) == 576
  # Keras' count also holds the running means and variances.
  stats = jax.tree.leaves(nnx.state(model, nnx.BatchStat))
  assert sum(x.size for x in stats) == 576
  assert models.count_params(model.primary) == 10_496
  assert model.digit.weights.shape == (16, 10, 8, 16)
  assert models.count_params(model.digit) == 20_480 + 160
  assert models.count_params(_abstract()) == 161_824 + 1_411_344
  assert families.of(model).name == 'capsnet'


@nnx.jit(static_argnames='train')
def _call(model, images, labels=None, train=False):
  return model(images, labels, train=train)


def test_shapes_and_modes():
  model = _tiny_model()
  images = _images(0, (5, 28, 28, 1))
  out = _call(model, images, np.array([0, 1, 2, 0, 1]), train=True)
  chex.assert_shape(out['class_scores'], (5, 3))
  chex.assert_shape(out['capsules'], (5, 3, 4))
  chex.assert_shape(out['coupling'], (5, 2, 3))
  chex.assert_shape(out['primary_lengths'], (5, 2))
  chex.assert_shape(out['reconstructions'], (5, 784))
  chex.assert_tree_all_finite(out)
  assert np.all(np.asarray(out['class_scores']) < 1)
  # Training moved the running statistics; evaluation reads them and
  # leaves them.
  stats = nnx.state(model, nnx.BatchStat)
  assert float(np.asarray(stats['norms'][0]['var'][...])[0]) != 1.0
  before = jax.tree.map(np.asarray, stats)
  _call(model, images)
  chex.assert_trees_all_equal(before, jax.tree.map(
      np.asarray, nnx.state(model, nnx.BatchStat)))
  # Larger images keep the layers: a 3x3 grid of 2 capsules each.
  wide = _abstract(input_shape=(32, 32, 3), **TINY)
  out = nnx.eval_shape(lambda m: m(jnp.zeros((2, 32, 32, 3))), wide)
  chex.assert_shape(out['coupling'], (2, 18, 3))


@pytest.mark.parametrize('options,message', [
    ({'conv_channels': (4, 4, 4)}, 'conv_channels must name 4'),
    ({'conv_channels': (4, 4, 4, 6), 'primary_dim': 4}, 'multiple of'),
    ({'input_shape': (20, 20, 1)}, 'larger than the input'),
    ({'primary_kernel': 0}, 'primary_kernel must be a positive'),
    ({'batch_norm_momentum': 1.0}, 'batch_norm_momentum'),
])
def test_bad_options_raise_clear_errors(options, message):
  with pytest.raises(ValueError, match=message):
    _abstract(**options)


def _np_authors_forward(p, images, train):
  """float64: the authors' graph (efficient_capsnet_graph, PrimaryCaps,
  Squash, FCCaps) and decoder on parameters ``p`` (NumPy)."""
  x = images
  stats = []
  for i, stride in enumerate((1, 1, 1, 2)):
    conv = p['convs'][i]
    kernel = conv['kernel']
    # conv_reference has no stride for 'VALID' beyond what it is given.
    y = conv_reference(x, kernel, np.zeros(
        (x.shape[0], (x.shape[1] - kernel.shape[0]) // stride + 1,
         (x.shape[2] - kernel.shape[1]) // stride + 1, kernel.shape[-1])),
                       stride=stride)[0]
    y = np.maximum(y + conv['bias'], 0.0)
    norm = p['norms'][i]
    if train:
      mean, var = y.mean((0, 1, 2)), y.var((0, 1, 2))
      stats.append((mean, var, y[..., 0].size))
    else:
      mean, var = norm['mean'], norm['var']
    x = (y - mean) / np.sqrt(var + 1e-3) * norm['scale'] + norm['bias']
  # PrimaryCaps: depthwise conv (groups = channels), Reshape((N, D)),
  # Squash (eps 10e-21).
  kernel, bias = p['primary']['kernel'], p['primary']['bias']
  k = kernel.shape[0]
  rows, cols = x.shape[1] - k + 1, x.shape[2] - k + 1
  s = np.zeros((x.shape[0], rows, cols, x.shape[-1]))
  for i in range(rows):
    for j in range(cols):
      s[:, i, j] = np.einsum('buvc,uvc->bc', x[:, i:i + k, j:j + k],
                             kernel[:, :, 0])
  s = (s + bias).reshape(x.shape[0], -1, 4)

  def squash(s):
    n = np.linalg.norm(s, axis=-1, keepdims=True)
    return (1 - 1 / (np.exp(n) + 10e-21)) * (s / (n + 10e-21))

  primary = squash(s)
  # FCCaps with W [N, input_N, input_D, D] and b [N, input_N, 1].
  w = np.transpose(p['digit']['weights'], (1, 0, 2, 3))
  b = p['digit']['log_priors'].T[..., None]
  u = np.einsum('...ji,kjiz->...kjz', primary, w)
  c = np.einsum('...ij,...kj->...i', u, u)[..., None]
  c = c / np.sqrt(u.shape[-1])
  c = np.exp(c - c.max(1, keepdims=True))
  c = c / c.sum(1, keepdims=True) + b
  capsules = squash(np.sum(u * c, axis=-2))
  lengths = np.linalg.norm(capsules, axis=-1)
  # Mask (the longest capsule at test time) and the generator.
  masked = capsules * np.eye(lengths.shape[1])[lengths.argmax(1)][..., None]
  h = masked.reshape(len(masked), -1)
  dense = p['decoder']['layers']
  for i in range(3):
    h = h @ dense[i]['kernel'] + dense[i]['bias']
    h = np.maximum(h, 0) if i < 2 else 1 / (1 + np.exp(-h))
  return {'capsules': capsules, 'class_scores': lengths,
          'reconstructions': h, 'primary': primary}, stats


def test_forward_matches_float64_reference_of_the_authors_graph():
  model = _tiny_model()
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(1)

  def draw(path, x):
    name = path[-1].key
    if name == 'var':  # running variances > 0
      return rng.uniform(0.5, 2.0, x.shape)
    scale = {'kernel': 0.3, 'weights': 0.5, 'log_priors': 0.1}.get(name, 0.2)
    return scale * rng.standard_normal(x.shape)

  params = jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state))
  images = rng.uniform(size=(3, 28, 28, 1))
  with jax.enable_x64(True):
    nnx.replace_by_pure_dict(state, jax.tree.map(
        lambda x: jnp.asarray(x, jnp.float64), params))
    for train in (False, True):
      model64 = nnx.merge(graphdef, state, copy=True)
      out = _call(model64, jnp.asarray(images), train=train)
      ref, stats = _np_authors_forward(params, images, train)
      for key in ('capsules', 'class_scores', 'reconstructions'):
        assert out[key].dtype == jnp.float64, key
        np.testing.assert_allclose(out[key], ref[key], **F64, err_msg=key)
      np.testing.assert_allclose(out['primary_lengths'],
                                 np.linalg.norm(ref['primary'], axis=-1),
                                 **F64)
      if not train:
        continue
      for norm, (mean, var, count), old in zip(
          model64.norms, stats, params['norms'].values(), strict=True):
        # Running averages at momentum 0.99; the variance's is TF's fused
        # kernel's (FusedBatchNorm, Keras 2 on 4-D inputs): the batch
        # variance times rest_size / (rest_size - 1), rest_size = B*H*W.
        np.testing.assert_allclose(
            norm.mean[...], 0.99 * old['mean'] + 0.01 * mean, **F64)
        np.testing.assert_allclose(
            norm.var[...], 0.99 * old['var'] + 0.01 * var * count / (count - 1),
            **F64)


@pytest.mark.parametrize('shape,k,stride,padding', [
    ((2, 6, 6, 3), 3, 2, 'VALID'), ((2, 9, 9, 4), 9, 1, 'VALID'),
    ((1, 7, 5, 2), 3, 2, 'SAME'), ((1, 4, 4, 2), 1, 1, 'VALID')])
def test_depthwise_conv_is_per_channel(shape, k, stride, padding):
  """Values and both gradients against a float64 reference convolution of
  each channel with its own kernel."""
  x = _images(2, shape)
  kernel = _images(3, (k, k, 1, shape[-1]))
  conv = lambda x, w: nn.depthwise_conv2d(  # noqa: E731
      x, w, stride=stride, padding=padding)
  cotangent = _images(4, jax.eval_shape(conv, x, kernel).shape)
  # The gradients of <cotangent, conv(x, w)>, in one compiled program.
  got, (grad_x, grad_kernel) = jax.jit(functools.partial(
      output_and_grads, conv))(x, kernel, cotangent)
  got, grad_x, grad_kernel = map(np.asarray, (got, grad_x, grad_kernel))
  pads = jax.lax.padtype_to_pads(shape[1:3], (k, k), (stride, stride), padding)
  for c in range(shape[-1]):
    want, want_gx, want_gk = conv_reference(
        x[..., c:c + 1], kernel[..., c:c + 1], cotangent[..., c:c + 1],
        stride=stride, padding=pads)
    np.testing.assert_allclose(got[..., c:c + 1], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad_x[..., c:c + 1], want_gx, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(grad_kernel[..., c:c + 1], want_gk, rtol=1e-5,
                               atol=1e-5)


def test_depthwise_conv_checks_its_kernel():
  x = _images(2, (2, 6, 6, 3))
  with pytest.raises(ValueError, match=r'\[K, K, 1, C\]'):
    nn.depthwise_conv2d(x, _images(3, (3, 3, 1, 2)))


# ----------------------------------------------------------------------------
# The augmentation, against float64 NumPy references.


def _np_opencv_rotate(image, degrees, center):
  """cv2.warpAffine(image, getRotationMatrix2D(center, degrees, 1), (W, H))
  as OpenCV computes it before 4.11: INTER_LINEAR with 1/32-pixel sample
  positions from 1/1024-pixel fixed point, BORDER_CONSTANT 0. [H, W]."""
  h, w = image.shape
  a = np.deg2rad(degrees)
  alpha, beta = np.cos(a), np.sin(a)
  cx, cy = center
  m = [alpha, beta, (1 - alpha) * cx - beta * cy,
       -beta, alpha, beta * cx + (1 - alpha) * cy]
  det = 1.0 / (m[0] * m[4] - m[1] * m[3])
  a11, a22 = m[4] * det, m[0] * det
  m[0], m[4], m[1], m[3] = a11, a22, -m[1] * det, -m[3] * det
  b1, b2 = -m[0] * m[2] - m[1] * m[5], -m[3] * m[2] - m[4] * m[5]
  m[2], m[5] = b1, b2
  out = np.zeros((h, w))
  for y in range(h):
    x0 = int(np.rint((m[1] * y + m[2]) * 1024)) + 16
    y0 = int(np.rint((m[4] * y + m[5]) * 1024)) + 16
    for x in range(w):
      sx = (x0 + int(np.rint(m[0] * x * 1024))) >> 5
      sy = (y0 + int(np.rint(m[3] * x * 1024))) >> 5
      fx, fy = (sx & 31) / 32, (sy & 31) / 32
      for dy, wy in ((0, 1 - fy), (1, fy)):
        for dx, wx in ((0, 1 - fx), (1, fx)):
          r, c = (sy >> 5) + dy, (sx >> 5) + dx
          if 0 <= r < h and 0 <= c < w:
            out[y, x] += wy * wx * image[r, c]
  return out


def _np_shift(image, amounts, directions):
  """image_shift_rand on [H, W] with its draws given."""
  size = image.shape[0]
  cols = np.nonzero(image.sum(0) > 0)[0]
  rows = np.nonzero(image.sum(1) > 0)[0]
  left, right = cols.min(), size - cols.max() - 1
  top, bottom = rows.min(), size - rows.max() - 1
  x_amts = [np.floor(-amounts[0] * left), np.floor(amounts[0] * (1 + right))]
  y_amts = [np.floor(-amounts[1] * top), np.floor(amounts[1] * (1 + bottom))]
  x_amt, y_amt = int(x_amts[directions[1]]), int(y_amts[directions[0]])
  flat = np.roll(image.reshape(-1), y_amt * size).reshape(size, size).T
  flat = np.roll(flat.reshape(-1), x_amt * size).reshape(size, size)
  return flat.T


def _np_lanczos3(x):
  x = np.abs(x)
  safe = np.where(x < 1e-3, 1.0, x)
  y = 3 * np.sin(np.pi * safe) * np.sin(np.pi * safe / 3) / (np.pi * safe) ** 2
  return np.where(x > 3, 0.0, np.where(x < 1e-3, 1.0, y))


def _np_squish(image, amounts):
  """image_squish_random on [H, W]: tf.image.resize to W - n columns
  (LANCZOS3, antialias: TF's ScaleAndTranslate spans), padded at the
  offset, cropped."""
  h, w = image.shape
  n = int(np.floor(amounts[0] * (w / 4) + 1))
  offset_mod = int(np.floor(amounts[1] * 2.0))
  offset = n // 2 + offset_mod
  out_w = w - n
  scale = out_w / w
  kernel_scale = max(1 / scale, 1.0)
  resized = np.zeros((h, out_w))
  for j in range(out_w):
    sample = (j + 0.5) / scale
    start = max(int(np.ceil(sample - 3 * kernel_scale - 0.5)), 0)
    end = min(int(np.floor(sample + 3 * kernel_scale - 0.5)) + 1, w)
    taps = np.arange(start, end)
    weights = _np_lanczos3((taps + 0.5 - sample) / kernel_scale)
    weights = weights / weights.sum()
    resized[:, j] = image[:, taps] @ weights
  padded = np.zeros((h, w + offset_mod))
  padded[:, offset:offset + out_w] = resized
  return padded[:, :w]


def _np_erase(image, corner):
  mask = np.pad(np.zeros((4, 4)), [[corner[0], image.shape[0] - corner[0] - 4],
                                   [corner[1], image.shape[1] - corner[1] - 4]],
                constant_values=1)
  return image * mask


def _digits(seed, count):
  """Digit-like images: a blob of ink inside an empty margin."""
  rng = np.random.default_rng(seed)
  images = np.zeros((count, 28, 28, 1), np.float32)
  for image in images:
    top, left = rng.integers(2, 9, 2)
    image[top:top + 14, left:left + 12, 0] = rng.uniform(size=(14, 12))
  return images


def _draws(seed, count):
  rng = np.random.default_rng(seed)
  return {
      'degrees': rng.integers(-29, 30, count),
      'shift_amounts': rng.uniform(0, 0.9999, (count, 2)),
      'shift_directions': rng.integers(0, 2, (count, 2)),
      'squeeze_amounts': rng.uniform(0, 0.9999, (count, 2)),
      'erase_corners': rng.integers(4, 23, (count, 2)),
  }


def test_augmentation_steps_match_references():
  images, draws = _digits(0, 6), _draws(1, 6)
  draws['degrees'][0] = 0  # not rotated: the identity

  @jax.jit
  def steps(images, draws):
    rotated = augment.rotate_opencv(images, draws['degrees'])
    shifted = augment.margin_shift(rotated, draws['shift_amounts'],
                                   draws['shift_directions'])
    squeezed = augment.squeeze_width(shifted, draws['squeeze_amounts'])
    return (rotated, shifted, squeezed,
            augment.erase(squeezed, draws['erase_corners']))

  draws32 = {k: v.astype(np.float32) if v.dtype == np.float64 else v
             for k, v in draws.items()}
  rotated, shifted, squeezed, erased = map(np.asarray, steps(images, draws32))
  np.testing.assert_array_equal(rotated[0], images[0])
  for i in range(len(images)):
    want = _np_opencv_rotate(images[i, ..., 0].astype(np.float64),
                             int(draws['degrees'][i]), (14.0, 14.0))
    np.testing.assert_allclose(rotated[i, ..., 0], want, atol=1e-6)
    # Each step from the previous step's float32 output.
    amounts = draws['shift_amounts'][i].astype(np.float32)
    np.testing.assert_array_equal(
        shifted[i, ..., 0],
        _np_shift(rotated[i, ..., 0], amounts, draws['shift_directions'][i]))
    want = _np_squish(shifted[i, ..., 0].astype(np.float64),
                      draws['squeeze_amounts'][i].astype(np.float32))
    np.testing.assert_allclose(squeezed[i, ..., 0], want, atol=1e-5)
    np.testing.assert_array_equal(
        erased[i, ..., 0],
        _np_erase(squeezed[i, ..., 0], draws['erase_corners'][i]))
  # The squeeze is tf.image.resize to fewer columns, then placed: 3 fewer
  # (floor(7 a + 1)) from column 1 (3 // 2 + floor(2 b)).
  one, resized = map(np.asarray, jax.jit(lambda shifted: (
      augment.squeeze_width(shifted[:1], [[0.3, 0.2]]),
      jax.image.resize(shifted[0], (28, 25, 1), 'lanczos3')))(shifted))
  np.testing.assert_allclose(one[0, :, 1:26], resized, atol=1e-5)
  assert not one[0, :, :1].any() and not one[0, :, 26:].any()


def test_augment_draws_and_determinism():
  key = jax.random.key(0)
  draws = jax.jit(augment.efficient_capsnet_draws, static_argnums=1)(key, 2000)
  draws = jax.tree.map(np.asarray, draws)
  degrees = draws['degrees']
  assert degrees.min() >= -29 and degrees.max() <= 29
  # Half the images keep their angle, and |30 r| < 1 keeps some more.
  assert 0.5 < np.mean(degrees == 0) < 0.6
  assert set(np.unique(draws['erase_corners'])) == set(range(4, 23))
  assert set(np.unique(draws['shift_directions'])) == {0, 1}
  for name in ('shift_amounts', 'squeeze_amounts'):
    assert draws[name].min() >= 0 and draws[name].max() <= 0.9999
  images = _digits(2, 4)
  run = jax.jit(augment.efficient_capsnet_augment)
  first = run(key, images)
  chex.assert_shape(first, images.shape)
  chex.assert_trees_all_equal(first, run(key, images))
  assert not np.array_equal(first, run(jax.random.key(1), images))


# ----------------------------------------------------------------------------
# Training and configs.


def _tiny_config():
  config = efficient_capsnet_mnist.get_config('smoke')
  config.model_options.update(TINY)
  config.learning_rate = 1e-2
  return config


def test_train_step_lowers_the_loss_and_moves_running_statistics():
  config = _tiny_config()
  optimizer = state_lib.make_optimizer(config)
  steps = vector_capsules.make_steps(config, optimizer)
  # One compiled program for the initialisers and the optimiser's zeros.
  graphdef, state = nnx.jit(lambda: state_lib.init_train_state(
      state_lib.create_model(config), optimizer))()
  rng = np.random.default_rng(0)
  images = (255 * _digits(3, 8)).astype(np.uint8)
  labels = rng.integers(0, 3, 8).astype(np.int32)
  train_step = jax.jit(lambda s, k: steps.train_step(graphdef, s, images,
                                                     labels, k))
  first_stats = jax.tree.map(np.asarray, state.model_state)
  losses = []
  for step in range(8):
    state, metrics = train_step(state, jax.random.key(step))
    losses.append(float(metrics['loss']))
  assert np.all(np.isfinite(losses)) and int(state.nonfinite_step) == -1
  assert losses[-1] < losses[0], losses
  assert {'margin_loss', 'reconstruction_loss'} <= set(metrics)
  moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), first_stats,
                       jax.tree.map(np.asarray, state.model_state))
  assert all(jax.tree.leaves(moved))
  sums = jax.jit(functools.partial(steps.eval_step, graphdef))(
      state.params, state.model_state, images, labels, np.ones(8, np.float32))
  assert int(sums['count']) == 8 and np.isfinite(float(sums['loss']))


def test_config_is_the_authors_protocol_and_smoke_differs_as_stated():
  config = efficient_capsnet_mnist.get_config()
  assert config.model == 'efficient_capsnet'
  assert (config.batch_size, config.learning_rate, config.adam_epsilon) == (
      16, 5e-4, 1e-7)
  assert config.num_train_steps == 150 * 3750
  assert (config.loss_form, config.reconstruction_weight) == ('text', 0.0005)
  assert (config.augment, config.max_shift) == ('efficient_capsnet', 0)
  schedule = state_lib.learning_rate_schedule(config)
  # learn_scheduler: 5e-4 * 0.97^epoch, at least 5e-5, per epoch of 3,750.
  for step, epoch in ((0, 0), (3749, 0), (3750, 1), (7600, 2), (3750 * 80, 80),
                      (3750 * 149, 149)):
    np.testing.assert_allclose(
        float(schedule(step)), max(5e-4 * 0.97**epoch, 5e-5), rtol=1e-5)
  smoke = efficient_capsnet_mnist.get_config('smoke')
  config = efficient_capsnet_mnist.get_config()  # unfilled, as smoke
  differ = {k for k in config if config[k] != smoke[k]}
  assert differ == {'batch_size', 'num_train_steps', 'learning_rate',
                    'lr_decay_steps', 'lr_decay_rate', 'lr_staircase',
                    'max_train_seconds', 'eval_every_steps',
                    'checkpoint_every_steps', 'log_every_steps',
                    'model_options'}
  assert (smoke.batch_size, smoke.num_train_steps) == (32, 200)
  assert smoke.model_options.to_dict() == {'reconstruction': True,
                                           'batch_norm_momentum': 0.9}
  assert 'batch_norm_momentum' not in config.model_options
  with pytest.raises(ValueError, match='known: smoke'):
    efficient_capsnet_mnist.get_config('fast')


@pytest.mark.parametrize('variant', ['efficient', 'efficient,smoke'])
def test_own_images_efficient_variant_builds(variant):
  config = own_images.get_config(variant)
  assert config.model == 'efficient_capsnet'
  config.model_options.input_shape = (32, 32, 3)
  config.model_options.num_classes = 4
  model = nnx.eval_shape(lambda: state_lib.create_model(config))
  out = nnx.eval_shape(lambda m: m(jnp.zeros((2, 32, 32, 3))), model)
  chex.assert_shape(out['class_scores'], (2, 4))
  assert families.of(model).name == 'capsnet'
