"""The released EM code's training protocol as capsjax options.

Each option against a float64 NumPy reference written from the released
code (google-research capsule_em: layers.py, utils.py, model.py,
norb/norb_record.py, experiment.py) and the TF ops it calls, on small
hand-checkable cases; the defaults keep capsjax's forms.
"""

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from capsjax import families
from capsjax import losses
from capsjax.data import load_dataset
from capsjax.data import smallnorb as norb
from capsjax.data import write_norb_matrix
from capsjax.training import matrix_capsules
from experiments.configs import matrix_capsnet_mnist
from experiments.configs import matrix_capsnet_smallnorb


def _em_loss(activations, labels, step, config):
  """The 'em' family's per-example loss [B] of class activations [B, K]."""
  return families.of('matrix_capsnet').loss(
      {'class_scores': activations}, labels, config, step=step)[0]


# ----------------------------------------------------------------------------
# References of the released code and of the TF ops it uses.


def released_spread_batch_loss(a, labels, margin):
  """layers.optimizer: tf.reduce_mean of order_loss over [B, K]."""
  a = np.asarray(a, np.float64)
  one_hot = np.eye(a.shape[1])[labels]
  label_act = np.sum(one_hot * a, axis=-1, keepdims=True)
  cost = (1 - one_hot) * (a > label_act - margin) * (a + margin - label_act)**2
  return cost.mean()


def tf_l2_loss(w):
  return np.sum(np.asarray(w, np.float64)**2) / 2


def legacy_bilinear_resize(image, out_h, out_w):
  """tf.image.resize_images' TF1 default: bilinear, align_corners=False,
  source coordinate = destination * (in / out), no half-pixel offset.

  image: [H, W, C] -> [out_h, out_w, C], float64.
  """
  image = np.asarray(image, np.float64)
  h, w = image.shape[:2]

  def taps(out, size):
    src = np.arange(out) * (size / out)
    low = np.floor(src).astype(int)
    return low, np.minimum(low + 1, size - 1), src - low

  y0, y1, fy = taps(out_h, h)
  x0, x1, fx = taps(out_w, w)
  top = image[y0][:, x0] * (1 - fx)[None, :, None] + \
      image[y0][:, x1] * fx[None, :, None]
  bottom = image[y1][:, x0] * (1 - fx)[None, :, None] + \
      image[y1][:, x1] * fx[None, :, None]
  return top * (1 - fy)[:, None, None] + bottom * fy[:, None, None]


def per_image_standardization(x):
  x = np.asarray(x, np.float64)
  return (x - x.mean()) / max(x.std(), 1 / math.sqrt(x.size))


def released_distort(image, top, left, delta, factor, crop=32):
  """norb_record._read_and_decode, distort=1, for given random draws, on
  the 0-255 floats: random_brightness, random_contrast (about each
  channel's mean over the whole image), random_crop, standardisation."""
  x = np.asarray(image, np.float64) + delta
  mean = x.mean(axis=(0, 1), keepdims=True)
  x = (x - mean) * factor + mean
  return per_image_standardization(x[top:top + crop, left:left + crop])


def adam_reference(grads_per_step, lr, decay_steps, decay_rate, clip=None,
                   b1=0.9, b2=0.999, eps=1e-8):
  """Adam updates (optax's form) of a list of gradients, each first clipped
  to [-clip, clip] as tf.clip_by_value in model._average_gradients."""
  m = v = 0.0
  updates = []
  for t, g in enumerate(grads_per_step, start=1):
    g = np.asarray(g, np.float64)
    if clip is not None:
      g = np.clip(g, -clip, clip)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g**2
    rate = lr * decay_rate**((t - 1) / decay_steps)
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    updates.append(-rate * m_hat / (np.sqrt(v_hat) + eps))
  return updates


# ----------------------------------------------------------------------------
# Losses.

# Jitted, one function for every call: one compilation per shape and
# reduction, not one per operation.
_spread_loss = jax.jit(losses.spread_loss, static_argnames='class_reduction')
_mean_spread_loss = jax.jit(lambda *args, **kwargs: jnp.mean(
    losses.spread_loss(*args, **kwargs)), static_argnames='class_reduction')


def test_spread_loss_class_reduction_by_hand():
  a = np.array([[0.9, 0.5, 0.2], [0.1, 0.8, 0.7]])
  labels = np.array([0, 2])
  # Row 0: (0.5 - 0.4)^2 for class 1, class 2 is past the margin. Row 1:
  # class 0 is past it, class 1: (0.5 + 0.1)^2.
  total = np.array([0.01, 0.36])
  with jax.enable_x64(True):
    np.testing.assert_allclose(_spread_loss(a, labels, 0.5), total,
                               rtol=1e-12)
    np.testing.assert_allclose(
        _spread_loss(a, labels, 0.5, class_reduction='mean'), total / 3,
        rtol=1e-12)
  with pytest.raises(ValueError, match='class_reduction'):
    losses.spread_loss(a, labels, 0.5, class_reduction='max')


@pytest.mark.parametrize('num_classes', [5, 10])
def test_spread_loss_mean_is_the_released_batch_loss(num_classes):
  rng = np.random.default_rng(num_classes)
  a = rng.uniform(0, 1, (7, num_classes))
  labels = rng.integers(0, num_classes, 7)
  for margin in (0.2, 0.55, 0.99):
    expected = released_spread_batch_loss(a, labels, margin)
    with jax.enable_x64(True):
      mean = _mean_spread_loss(a, labels, margin, class_reduction='mean')
      # capsjax's sum is K times it: 5x on smallNORB, 10x on MNIST.
      total = _mean_spread_loss(a, labels, margin)
    np.testing.assert_allclose(mean, expected, rtol=1e-12)
    np.testing.assert_allclose(total, num_classes * expected, rtol=1e-12)


def test_em_loss_reads_the_class_reduction():
  a = np.array([[0.3, 0.6, 0.1, 0.9, 0.2]], np.float32)
  labels = np.array([1])
  config = matrix_capsnet_smallnorb.get_config('')
  config.margin_schedule, config.margin_steps = 'linear', 10
  expected = released_spread_batch_loss(a, labels, 0.9)  # step 10: m = 0.9
  # Jitted, traced anew for each config: one compilation per reduction, not
  # one per operation.
  got = jax.jit(functools.partial(_em_loss, config=config))(
      a, labels, np.int32(10))
  np.testing.assert_allclose(got, 5 * expected, rtol=1e-6)
  config.spread_class_reduction = 'mean'
  got = jax.jit(functools.partial(_em_loss, config=config))(
      a, labels, np.int32(10))
  np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_l2_penalty_forms_by_hand():
  params = {'w': jnp.array([[1.0, 2.0], [3.0, 4.0]]),
            'kernel': jnp.array([[[0.5]]]),
            'bias': jnp.array([5.0, 6.0])}  # one dimension: exempt
  # Jitted: one compilation per form, not one per operation.
  l2_penalty = jax.jit(matrix_capsules.l2_penalty, static_argnames='form')
  assert float(l2_penalty(params)) == pytest.approx(30.25)
  assert float(l2_penalty(params, form='half')) == pytest.approx(15.125)
  expected = tf_l2_loss(params['w']) + tf_l2_loss(params['kernel'])
  assert float(l2_penalty(params, form='half')) == pytest.approx(expected)
  with pytest.raises(ValueError, match="'sum' or 'half'"):
    matrix_capsules.l2_penalty(params, form='mean')


# ----------------------------------------------------------------------------
# Gradient clipping.


def test_clip_gradients_is_element_wise():
  grads = {'a': jnp.array([300.0, -250.0, 50.0]), 'b': jnp.array([[-1e3]])}
  clipper = matrix_capsules.clip_gradients(optax.identity(), 200.0)
  out, _ = clipper.update(grads, clipper.init(grads))
  np.testing.assert_array_equal(out['a'], [200.0, -200.0, 50.0])
  np.testing.assert_array_equal(out['b'], [[-200.0]])


def _optimizer_config(grad_clip):
  config = ml_collections.ConfigDict()
  config.learning_rate, config.lr_decay_steps = 0.01, 2
  config.lr_decay_rate, config.adam_epsilon = 0.96, 1e-8
  config.grad_clip = grad_clip
  return config


def test_make_optimizer_clips_before_adam():
  params = jnp.zeros(3)
  steps = [np.array([1e4, -300.0, 5.0]), np.array([1.0, 1.0, -2.0]),
           np.array([3.0, -1.0, 0.5])]
  got = {}
  for clip in (0.0, 200.0):
    optimizer = matrix_capsules.make_optimizer(_optimizer_config(clip))
    # Jitted: one compilation per optimizer, not one per operation.
    update_fn = jax.jit(optimizer.update)
    state = optimizer.init(params)
    got[clip] = []
    for g in steps:
      update, state = update_fn(jnp.asarray(g), state, params)
      got[clip].append(np.asarray(update))
  for clip, reference in ((200.0, 200.0), (0.0, None)):
    expected = adam_reference(steps, 0.01, 2, 0.96, clip=reference)
    # float32 Adam: its bias corrections round at 1e-5.
    np.testing.assert_allclose(got[clip], expected, rtol=1e-4)
  # Clipping changes Adam's second moments, hence the later updates.
  assert not np.allclose(got[0.0][1], got[200.0][1], rtol=1e-3)
  # The state is the unclipped optimizer's: the loop builds it without the
  # clip.
  plain = matrix_capsules.make_optimizer(_optimizer_config(0.0)).init(params)
  clipped = matrix_capsules.make_optimizer(_optimizer_config(200.0)).init(params)
  assert jax.tree.structure(plain) == jax.tree.structure(clipped)
  with pytest.raises(ValueError, match='grad_clip'):
    matrix_capsules.make_optimizer(_optimizer_config(-1.0))


# ----------------------------------------------------------------------------
# Downsampling.


def test_pick_downsampling_by_hand():
  dat = np.arange(2 * 16, dtype=np.uint8).reshape(1, 2, 4, 4)
  dat[0, 1] += 100
  picked = norb.downsample(dat, method='pick')
  np.testing.assert_array_equal(picked[0, ..., 0], [[0, 2], [8, 10]])
  np.testing.assert_array_equal(picked[0, ..., 1], [[116, 118], [124, 126]])
  # The 2x2 means, rounded half up: (0 + 1 + 4 + 5) / 4 = 2.5 -> 3.
  np.testing.assert_array_equal(norb.downsample(dat)[0, ..., 0],
                                [[3, 5], [11, 13]])
  with pytest.raises(ValueError, match='method'):
    norb.downsample(dat, method='bilinear')


def test_pick_downsampling_is_tf1_resize_images():
  dat = np.random.default_rng(0).integers(0, 256, (2, 2, 96, 96), np.uint8)
  picked = norb.downsample(dat, method='pick')
  assert picked.shape == (2, 48, 48, 2) and picked.dtype == np.uint8
  for n in range(2):
    expected = legacy_bilinear_resize(dat[n].transpose(1, 2, 0), 48, 48)
    np.testing.assert_array_equal(picked[n], expected)
  assert not np.array_equal(norb.downsample(dat), picked)


def _write_release(directory, n=6, size=8):
  rng = np.random.default_rng(1)
  for split in ('training', 'testing'):
    dat = rng.integers(0, 256, (n, 2, size, size), np.uint8)
    i = np.arange(n)
    info = np.stack([i % 10, i % 9, 2 * (i % 18), i % 6], 1).astype(np.int32)
    for kind, array in (('dat', dat), ('cat', (i % 5).astype(np.int32)),
                        ('info', info)):
      write_norb_matrix(directory / f'{norb.SPLIT_FILES[split]}-{kind}.mat',
                        array)
    if split == 'testing':
      return dat


def test_loading_with_pick_downsampling(tmp_path):
  test_dat = _write_release(tmp_path)
  picked = load_dataset('smallnorb', data_dir=tmp_path, validation_size=0,
                        downsample='pick')
  np.testing.assert_array_equal(picked.test.images,
                                test_dat[:, :, ::2, ::2].transpose(0, 2, 3, 1))
  config = matrix_capsnet_smallnorb.get_config('authors')
  config.data_dir, config.validation_size = str(tmp_path), 0
  np.testing.assert_array_equal(matrix_capsules.load_data(config).test.images,
                                picked.test.images)
  config.downsample = 'mean'
  assert not np.array_equal(matrix_capsules.load_data(config).test.images,
                            picked.test.images)
  with pytest.raises(ValueError, match='downsample'):
    load_dataset('smallnorb', data_dir=tmp_path, downsample='area')


# ----------------------------------------------------------------------------
# The training distortions.


def _two_channel_images():
  """Channel 0 is brighter outside the central 32x32 than inside, channel 1
  is not: the channels' mean difference over 48x48 is not the crop's."""
  rng = np.random.default_rng(2)
  images = rng.integers(0, 120, (3, 48, 48, 2))
  ring = np.ones((48, 48), bool)
  ring[8:40, 8:40] = False
  images[:, ring, 0] += 130
  return images.astype(np.uint8)


# Jitted, one function for both tests: one compilation per shape and
# options, not one per operation.
_distort = jax.jit(norb.smallnorb_distort,
                   static_argnames=('crop_size', 'order', 'pixel_max'))


def test_released_order_equals_the_reference_for_fixed_draws():
  images = _two_channel_images()
  offsets = np.array([[0, 16], [8, 8], [5, 11]])
  delta = np.array([40.0, -63.0, 12.5])  # in 0-255
  factor = np.array([0.3, 1.8, 1.0])
  out = np.asarray(_distort(
      images, offsets, delta / 255, factor, order='released', pixel_max=255.0))
  assert out.shape == (3, 32, 32, 2)
  for b in range(3):
    expected = released_distort(images[b], *offsets[b], delta[b], factor[b])
    np.testing.assert_allclose(out[b], expected, atol=2e-5)
  # Cropping first takes the channel means of the crop: another result.
  crop_first = np.asarray(_distort(
      images, offsets, delta / 255, factor, order='crop_first',
      pixel_max=255.0))
  for b in (0, 1):
    assert np.abs(crop_first[b] - out[b]).max() > 0.1, b
  # factor 1: contrast is the identity, the two orders agree.
  np.testing.assert_allclose(crop_first[2], out[2], atol=2e-5)
  with pytest.raises(ValueError, match='order'):
    norb.smallnorb_distort(images, offsets, delta, factor, order='shuffled')


def test_pixel_max_moves_the_standardisation_floor():
  # Grey levels 100-104: a std of ~1.4 in 0-255, above the floor
  # 1/sqrt(32 * 32 * 2) = 0.0221; ~0.0055 in [0, 1], below it.
  image = np.random.default_rng(3).integers(100, 105, (1, 48, 48, 2))
  image = image.astype(np.uint8)
  # The centre crop, no brightness delta, a contrast factor of 1.
  draws = (np.full((1, 2), 8), np.zeros(1), np.ones(1))
  out = {}
  for pixel_max in (1.0, 255.0):
    out[pixel_max] = np.asarray(_distort(image, *draws,
                                         pixel_max=pixel_max))[0]
    x = image[0, 8:40, 8:40] * (pixel_max / 255)
    # float32 sums of 2048 equal-ish values: 1e-3 of the unit std.
    np.testing.assert_allclose(out[pixel_max], per_image_standardization(x),
                               atol=1e-3)
  assert out[255.0].std() == pytest.approx(1.0, abs=1e-3)
  assert out[1.0].std() < 0.3


def test_keyed_preprocess_is_distort_of_its_draws():
  images = _two_channel_images()
  key = jax.random.key(5)
  offsets, delta, factor = norb.smallnorb_train_draws(key, 3, 48, 48)
  assert offsets.min() >= 0 and offsets.max() <= 16
  assert np.all(np.abs(delta) <= 63 / 255)
  assert np.all((factor >= 0.2) & (factor <= 1.8))
  for order, pixel_max in (('crop_first', 1.0), ('released', 255.0)):
    np.testing.assert_array_equal(
        norb.smallnorb_train_preprocess(key, images, order=order,
                                        pixel_max=pixel_max),
        norb.smallnorb_distort(images, offsets, delta, factor, order=order,
                               pixel_max=pixel_max))
  # The config's options reach matrix_capsules.preprocess, training and evaluation.
  config = matrix_capsnet_smallnorb.get_config('authors')
  np.testing.assert_array_equal(
      matrix_capsules.preprocess(config, images, key),
      norb.smallnorb_distort(images, offsets, delta, factor, order='released',
                             pixel_max=255.0))
  np.testing.assert_allclose(
      matrix_capsules.preprocess(config, images, None)[1],
      per_image_standardization(images[1, 8:40, 8:40]), atol=2e-5)


# ----------------------------------------------------------------------------
# The 13-crop test.

# tf.compat.v1.image.extract_glimpse(size [32, 32], centered=True,
# normalized=False) of 48x48 images at glimpse centres k (dy, dx): the op
# computes the corner as trunc(offset / 2 + 48 / 2 - 32 / 2) (also checked
# against TF 2.21's op); the first crop is the centre crop.
RELEASED_CORNERS = ((8, 8),
                    (8, 8), (8, 7), (7, 8), (7, 7),
                    (9, 9), (9, 7), (7, 9), (7, 7),
                    (9, 9), (9, 6), (6, 9), (6, 6))


def test_released_crop_corners():
  glimpse_centres = [k * np.array(s) for k in (1, 2, 3)
                     for s in ((1, 1), (1, -1), (-1, 1), (-1, -1))]
  derived = [(8, 8)] + [tuple(int(np.trunc(c / 2 + 24 - 16))
                              for c in centre) for centre in glimpse_centres]
  assert tuple(derived) == RELEASED_CORNERS
  assert norb.multicrop_offsets(48, 48, pattern='released') == RELEASED_CORNERS
  assert norb.multicrop_offsets(48, 48, 5, pattern='released') == \
      RELEASED_CORNERS[:5]
  with pytest.raises(ValueError, match='pattern'):
    norb.multicrop_offsets(48, 48, pattern='ring')


def test_released_crops_are_standardised_in_bytes():
  images = _two_channel_images()
  crops = np.asarray(norb.smallnorb_multicrop(images, pattern='released',
                                              pixel_max=255.0))
  assert crops.shape == (13, 3, 32, 32, 2)
  for n, (top, left) in enumerate(RELEASED_CORNERS):
    np.testing.assert_allclose(
        crops[n, 2],
        per_image_standardization(images[2, top:top + 32, left:left + 32]),
        atol=2e-5)


def test_combining_crops_by_hand():
  # Crop 0 sums to 1.8, crop 1 to 0.2: normalised they weigh the same and
  # class 1 wins (0.75, 0.944, 0.306), where the raw sum picks class 0.
  a = np.array([[[0.9, 0.8, 0.1]], [[0.05, 0.1, 0.05]]])
  silent = np.concatenate([a, np.zeros((1, 1, 3))])
  # Jitted: one compilation per shape, not one per operation.
  combine = jax.jit(norb.combine_crop_activations)
  with jax.enable_x64(True):
    scores = np.asarray(combine(a))
    # A crop with no activation adds nothing rather than NaN.
    with_silent = np.asarray(combine(silent))
  np.testing.assert_allclose(
      scores, [[0.75, 0.5 + 0.8 / 1.8, 0.25 + 0.1 / 1.8]], rtol=1e-12)
  assert scores.argmax() == 1 and a.sum(0).argmax() == 0
  np.testing.assert_array_equal(with_silent, scores)


class _LinearSigmoid(nnx.Module):
  """A stand-in model: activations sigmoid(flattened input @ w)."""

  def __init__(self, w):
    self.w = nnx.Param(jnp.asarray(w, jnp.float32))

  def __call__(self, images, *args, **kwargs):
    features = images.reshape(images.shape[0], -1)
    return {'class_scores': jax.nn.sigmoid(features @ self.w[...])}


def test_eval_step_combines_the_13_crops():
  rng = np.random.default_rng(4)
  images = rng.integers(0, 256, (16, 48, 48, 2)).astype(np.uint8)
  w = rng.normal(0, 0.02, (32 * 32 * 2, 5))
  per_crop = []
  for top, left in RELEASED_CORNERS:
    x = np.stack([per_image_standardization(image[top:top + 32,
                                                  left:left + 32])
                  for image in images]).reshape(16, -1)
    per_crop.append(1 / (1 + np.exp(-x @ w)))
  per_crop = np.stack(per_crop)
  combined = (per_crop / per_crop.sum(-1, keepdims=True)).sum(0)
  labels = combined.argmax(-1)
  # Enough images whose centre crop alone predicts another class.
  assert np.sum(per_crop[0].argmax(-1) != labels) >= 3

  graphdef, params, model_state = nnx.split(_LinearSigmoid(w), nnx.Param, ...)
  mask = np.ones(16, bool)
  config = matrix_capsnet_smallnorb.get_config('authors')
  for crops, expected_correct in (
      ('released13', 16), ('centre', np.sum(per_crop[0].argmax(-1) == labels))):
    config.test_crops = crops
    steps = matrix_capsules.make_steps(config, matrix_capsules.make_optimizer(config))
    sums = jax.jit(functools.partial(steps.eval_step, graphdef))(
        params, model_state, images, labels, mask)
    assert int(sums['correct']) == expected_correct, crops
    assert int(sums['count']) == 16
    # The loss is the centre crop's in both.
    margin = 0.2 + 0.79 / (1 + math.exp(-10))
    expected_loss = 16 * released_spread_batch_loss(per_crop[0], labels,
                                                    margin)
    np.testing.assert_allclose(float(sums['loss']), expected_loss, rtol=1e-4)

  config = matrix_capsnet_mnist.get_config('')
  config.test_crops = 'released13'
  with pytest.raises(ValueError, match='smallNORB'):
    matrix_capsules.make_steps(config, matrix_capsules.make_optimizer(config))


# ----------------------------------------------------------------------------
# The configs.


def _released_margin(step):
  """layers.optimizer: 0.2 + 0.79 sigmoid(min(10, step / 50000 - 4))."""
  return 0.2 + 0.79 / (1 + math.exp(-min(10.0, step / 50_000 - 4)))


@pytest.mark.parametrize('module', [matrix_capsnet_mnist,
                                    matrix_capsnet_smallnorb])
def test_authors_variant_switches_to_the_released_protocol(module):
  default = module.get_config('')
  assert (default.learning_rate, default.grad_clip) == (3e-3, 0.0)
  assert (default.spread_class_reduction, default.l2_form) == ('sum', 'sum')
  config = module.get_config('authors')
  assert config.learning_rate == 0.01 and config.grad_clip == 200.0
  assert (config.lr_decay_steps, config.lr_decay_rate) == (20_000, 0.96)
  assert config.batch_size == 64 and config.weight_decay == 2e-7
  assert (config.spread_class_reduction, config.l2_form) == ('mean', 'half')
  # The released 50,000-step scale, whatever the length of the run.
  config.num_train_steps = 3000
  assert config.margin_steps == 50_000
  for step in (0, 50_000, 300_000, 2_000_000):
    assert float(losses.spread_loss_margin(
        step, schedule=config.margin_schedule,
        total_steps=config.margin_steps)) == pytest.approx(
            _released_margin(step), rel=1e-6)


def test_smallnorb_authors_variant_data_options():
  default = matrix_capsnet_smallnorb.get_config('')
  assert (default.downsample, default.augment_order, default.pixel_max,
          default.test_crops) == ('mean', 'crop_first', 1.0, 'centre')
  assert default.num_train_steps == 150_000
  config = matrix_capsnet_smallnorb.get_config('authors')
  assert (config.downsample, config.augment_order, config.pixel_max,
          config.test_crops) == ('pick', 'released', 255.0, 'released13')
  assert config.num_train_steps == 2_000_000
