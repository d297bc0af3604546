"""FGSM and BIM against NumPy references, their invariants, the attack losses,
``evaluate_attacks`` on small models, and the experiment end to end (smoke)."""

import json
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from capsjax import adversarial
from capsjax import families
from capsjax import losses
from capsjax import models
from capsjax.evaluators import adversarial as adversarial_evaluator
from experiments import adversarial as adversarial_experiment
from experiments.configs import adversarial as adversarial_config
from tests import conftest
from tests.conftest import REPO
from tests.conftest import needs_mnist

B, H, W, C, K = 8, 5, 4, 1, 3


@pytest.fixture(scope='module')
def problem():
  """Images in [0, 1] (some pixels at 0 and 1), labels, a linear classifier."""
  rng = np.random.default_rng(0)
  images = rng.uniform(0, 1, (B, H, W, C)).astype(np.float32)
  images[:, 0, 0] = 0.0
  images[:, 1, 1] = 1.0
  labels = rng.integers(0, K, B).astype(np.int32)
  weights = rng.normal(0, 1, (H * W * C, K)).astype(np.float32)
  bias = rng.normal(0, 1, K).astype(np.float32)
  return images, labels, weights, bias


def linear_ce(weights, bias):
  """Per-example softmax cross-entropy of a linear classifier (JAX)."""
  def loss_fn(x, y):
    logits = x.reshape(x.shape[0], -1) @ weights + bias[None]
    return losses.cross_entropy_loss(logits, y)
  return loss_fn


# Attacks of a loss_fn passed again (the same object) reuse their compiled
# program; run eagerly, each operation would compile its own.
_fgsm = jax.jit(adversarial.fgsm, static_argnums=0)
_bim = jax.jit(adversarial.bim, static_argnums=0,
               static_argnames=('step_size', 'num_steps'))
_input_gradient = jax.jit(adversarial.input_gradient, static_argnums=0)
_attack = jax.jit(adversarial.attack, static_argnums=(0, 1))


def numpy_ce_gradient(x, y, weights, bias):
  """d CE / d x of logits = x W + b, float64: (softmax - onehot) W^T."""
  x = x.astype(np.float64)
  logits = x.reshape(len(x), -1) @ weights.astype(np.float64) + bias
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  p[np.arange(len(y)), y] -= 1.0
  return (p @ weights.T.astype(np.float64)).reshape(x.shape)


def numpy_bim(x, y, weights, bias, eps, step, steps):
  x0 = x.astype(np.float64)
  x = x0.copy()
  for _ in range(steps):
    x = x + step * np.sign(numpy_ce_gradient(x, y, weights, bias))
    x = np.clip(np.clip(x, x0 - eps, x0 + eps), 0.0, 1.0)
  return x


def test_fgsm_is_eps_times_sign_of_gradient_clipped(problem):
  """A loss linear in x with a per-example weight: grad_b = w[y_b] exactly."""
  images, labels, _, _ = problem
  w = np.random.default_rng(1).normal(0, 1, (K, H, W, C)).astype(np.float32)
  w[:, 2, 2] = 0.0  # no gradient there: the pixel must not move
  loss_fn = lambda x, y: jnp.sum(x * jnp.asarray(w)[y], axis=(1, 2, 3))
  for eps in (0.0, 0.03, 0.3, 2.0):
    out = _fgsm(loss_fn, images, labels, eps)
    expected = np.clip(images + np.float32(eps) * np.sign(w[labels]), 0, 1)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(out[:, 2, 2], images[:, 2, 2])


def test_fgsm_matches_numpy_on_a_linear_classifier(problem):
  images, labels, weights, bias = problem
  grad = numpy_ce_gradient(images, labels, weights, bias)
  assert np.abs(grad).min() > 1e-4  # no sign is a rounding accident
  loss_fn = linear_ce(weights, bias)
  np.testing.assert_allclose(
      _input_gradient(loss_fn, images, labels), grad, rtol=1e-4, atol=1e-6)
  loss = jax.jit(loss_fn)
  for eps in (0.05, 0.2):
    out = _fgsm(loss_fn, images, labels, eps)
    np.testing.assert_allclose(out, np.clip(images + eps * np.sign(grad), 0, 1),
                               atol=1e-7)
    # A first-order step on a loss convex in x raises it.
    assert np.all(np.asarray(loss(out, labels))
                  > np.asarray(loss(images, labels)))


@pytest.mark.parametrize('eps,step,steps', [(0.1, 0.02, 10), (0.3, 0.05, 8),
                                            (0.05, 0.1, 3)])
def test_bim_matches_numpy_on_a_linear_classifier(problem, eps, step, steps):
  images, labels, weights, bias = problem
  out = adversarial.bim(linear_ce(weights, bias), images, labels, eps,
                        step_size=step, num_steps=steps)
  np.testing.assert_allclose(
      out, numpy_bim(images, labels, weights, bias, eps, step, steps),
      atol=1e-6)


def _mlp_loss():
  """A small nonlinear classifier: tanh MLP, cross-entropy."""
  rng = np.random.default_rng(2)
  w1 = jnp.asarray(rng.normal(0, 1, (H * W * C, 16)), jnp.float32)
  w2 = jnp.asarray(rng.normal(0, 1, (16, K)), jnp.float32)
  return lambda x, y: losses.cross_entropy_loss(
      jnp.tanh(x.reshape(x.shape[0], -1) @ w1) @ w2, y)


@pytest.mark.parametrize('eps', [0.0, 0.01, 0.1, 0.3])
def test_bim_stays_in_the_eps_ball_and_the_unit_box(problem, eps):
  images, labels, _, _ = problem
  out = np.asarray(adversarial.bim(_mlp_loss(), images, labels, eps,
                                   step_size=0.07, num_steps=12))
  assert np.all(np.abs(out - images) <= eps + 1e-6)
  assert out.min() >= 0.0 and out.max() <= 1.0
  if eps == 0.0:
    np.testing.assert_array_equal(out, images)
  else:
    # It moves, and many pixels reach the ball's boundary.
    distance = np.abs(out - images)
    inside = (images > eps) & (images < 1 - eps)
    assert np.mean(np.isclose(distance[inside], eps, atol=1e-6)) > 0.5


def test_bim_reaches_the_fgsm_corner_for_a_linear_loss(problem):
  """For a loss linear in x the best point of the ball is FGSM's corner."""
  images, labels, _, _ = problem
  w = jnp.asarray(np.random.default_rng(3).normal(0, 1, (H, W, C)), jnp.float32)
  loss_fn = lambda x, y: jnp.sum(x * w[None], axis=(1, 2, 3))
  for eps in (0.05, 0.2):
    out = _bim(loss_fn, images, labels, eps, step_size=0.03, num_steps=10)
    np.testing.assert_allclose(
        out, _fgsm(loss_fn, images, labels, eps), atol=1e-6)


def test_zero_epsilon_returns_the_input(problem):
  images, labels, _, _ = problem
  loss_fn = _mlp_loss()
  for name in adversarial.ATTACKS:
    out = _attack(name, loss_fn, images, labels, 0.0)
    np.testing.assert_array_equal(out, images)


def test_one_compilation_for_every_epsilon(problem):
  images, labels, weights, bias = problem

  @jax.jit
  @chex.assert_max_traces(n=1)
  def run(x, y, eps):
    return adversarial.bim(linear_ce(weights, bias), x, y, eps, step_size=0.01,
                           num_steps=3)

  for eps in (0.0, 0.1, 0.2):
    run(images, labels, jnp.float32(eps))


@jax.jit
def _attack_losses(labels, lengths, logits, log_odds):
  """Each family's attack loss beside its definition, in one compiled
  program: (default kind, 'cross_entropy' of the capsule families, the
  baseline's 'cross_entropy'), each a list of (got, expected)."""
  one_hot = jax.nn.one_hot(labels, K)
  cases = [
      ('baseline_cnn', {'class_scores': logits},
       losses.cross_entropy_loss(logits, labels)),
      ('capsnet', {'class_scores': lengths,
                   'reconstructions': jnp.zeros((B, 4))},
       losses.margin_loss(lengths, one_hot)),
      ('two_digit_baseline', {'class_scores': lengths},
       losses.margin_loss(lengths, one_hot, negative_weight=0.25)),
      ('matrix_capsnet', {'class_scores': lengths},
       losses.spread_loss(lengths, labels, 0.7)),
  ]
  default = [(families.of(model).attack_loss(outputs, labels,
                                             spread_margin=0.7), expected)
             for model, outputs, expected in cases]
  capsules = [(families.of(model).attack_loss(
      {'class_scores': lengths}, labels, kind='cross_entropy'),
               losses.cross_entropy_loss(log_odds, labels))
              for model in ('capsnet', 'two_digit_capsnet', 'matrix_capsnet')]
  baseline = [(families.of('baseline_cnn').attack_loss(
      {'class_scores': logits}, labels, kind='cross_entropy'),
               losses.cross_entropy_loss(logits, labels))]
  return default, capsules, baseline


def test_attack_losses():
  rng = np.random.default_rng(4)
  labels = rng.integers(0, K, B).astype(np.int32)
  lengths = rng.uniform(0.01, 0.99, (B, K)).astype(np.float32)
  logits = rng.normal(0, 2, (B, K)).astype(np.float32)
  log_odds = np.log(lengths) - np.log1p(-lengths)
  default, capsules, baseline = _attack_losses(labels, lengths, logits,
                                               log_odds)
  for got, expected in default:
    np.testing.assert_allclose(got, expected, rtol=1e-6)
  for got, expected in capsules:
    np.testing.assert_allclose(got, expected, rtol=1e-5)
  for got, expected in baseline:
    np.testing.assert_allclose(got, expected, rtol=1e-6)
  with pytest.raises(ValueError, match='unknown attack loss'):
    families.of('baseline_cnn').attack_loss({'class_scores': logits}, labels,
                                            kind='hinge')
  with pytest.raises(ValueError, match='unknown attack'):
    adversarial.attack('pgd', _mlp_loss(), np.zeros((1, H, W, C), np.float32),
                       np.zeros(1, np.int32), 0.1)


class _Linear(nnx.Module):
  """A linear classifier as a capsjax model of the 'cnn' family: logits."""

  FAMILY = 'cnn'

  def __init__(self, weights, bias):
    self.weights = nnx.Param(jnp.asarray(weights))
    self.bias = nnx.Param(jnp.asarray(bias))

  def logits(self, x):
    return x.reshape(x.shape[0], -1) @ self.weights + self.bias[None]

  def __call__(self, x, labels=None, *, train=False):
    return {'class_scores': self.logits(x)}


class _LinearCapsules(_Linear):
  """The same of the 'capsnet' family: capsule-like lengths sigmoid(logits)."""

  FAMILY = 'capsnet'

  def __call__(self, x, labels=None, *, train=False):
    return {'class_scores': jax.nn.sigmoid(self.logits(x))}


def test_evaluate_attacks_against_numpy(problem):
  images, labels, weights, bias = problem
  model = _Linear(weights, bias)
  epsilons = (0.0, 0.05, 0.2)
  out = adversarial.evaluate_attacks(
      model, images, labels, epsilons, step_size=0.02, num_steps=5,
      batch_size=3)  # 8 images: the last batch is padded
  predict = lambda x: np.argmax(x.reshape(B, -1) @ weights + bias, -1)
  clean = np.mean(predict(images) == labels)
  assert out['clean_accuracy'] == clean
  assert out['fgsm'][0] == out['bim'][0] == clean
  grad = numpy_ce_gradient(images, labels, weights, bias)
  for e, eps in enumerate(epsilons):
    fgsm = np.clip(images + eps * np.sign(grad), 0, 1)
    assert out['fgsm'][e] == np.mean(predict(fgsm) == labels)
    bim = numpy_bim(images, labels, weights, bias, eps, 0.02, 5)
    assert out['bim'][e] == np.mean(predict(bim) == labels)
  assert out['zero_gradient_fraction'] == 0.0


def test_margin_loss_saturation_shows_as_zero_gradients(problem):
  """Examples beyond both margins give the margin loss no gradient."""
  images, labels, _, _ = problem
  # |x W| <= 0.2: the bias decides every length.
  weights = np.random.default_rng(6).uniform(-0.01, 0.01, (H * W * C, K))
  weights = weights.astype(np.float32)
  target = np.zeros(B, np.int32)
  bias = np.full(K, -8.0, np.float32)  # every length < 0.001
  model = _LinearCapsules(weights, bias)
  out = adversarial.evaluate_attacks(model, images, target, (0.0, 0.1),
                                     num_steps=2)
  assert out['zero_gradient_fraction'] == 0.0  # class 0 is below 0.9: a push
  bias = np.array([8.0, -8.0, -8.0], np.float32)  # class 0 above 0.9
  model = _LinearCapsules(weights, bias)
  out = adversarial.evaluate_attacks(model, images, target, (0.0, 0.1),
                                     num_steps=2)
  assert out['zero_gradient_fraction'] == 1.0
  assert out['fgsm'] == [1.0, 1.0] and out['bim'] == [1.0, 1.0]
  out = adversarial.evaluate_attacks(model, images, target, (0.0, 0.1),
                                     num_steps=2, kind='cross_entropy')
  assert out['zero_gradient_fraction'] == 0.0


@pytest.mark.slow
def test_evaluate_attacks_on_capsule_models():
  """Every family's model runs through both attacks with finite results."""
  rng = np.random.default_rng(5)
  images = rng.integers(0, 256, (4, 28, 28, 1), dtype=np.uint8)
  labels = rng.integers(0, 10, 4)
  for name, options in (
      ('capsnet', dict(conv1_channels=8, primary_types=4,
                       decoder_widths=(8, 8))),
      ('matrix_capsnet', dict(input_shape=(28, 28, 1), num_classes=10, A=8,
                              B=2, C=2, D=2))):
    model = models.create_model(name, rngs=nnx.Rngs(0), **options)
    out = adversarial.evaluate_attacks(model, images, labels, (0.0, 0.2),
                                       num_steps=2, spread_margin=0.9)
    assert out['fgsm'][0] == out['bim'][0] == out['clean_accuracy']
    assert out['zero_gradient_fraction'] < 1.0, name


def _check(config):
  """The experiment's check of its attack keys, before any training."""
  adversarial_evaluator.check(ml_collections.ConfigDict({'dataset': 'mnist'}),
                **adversarial_experiment.attack_options(config))


def test_config_checks():
  config = adversarial_config.get_config()
  _check(config)
  assert config.epsilons == (0.0, 0.05, 0.1, 0.2, 0.3)
  # BIM can reach the largest epsilon.
  assert config.bim_steps * config.bim_step_size >= max(config.epsilons)
  for key, value, match in (('attacks', ('fgsm', 'cw'), 'attacks must'),
                            ('epsilons', (0.1, 2.0), 'epsilons must'),
                            ('loss', 'hinge', 'loss must'),
                            ('bim_steps', -1, 'bim_steps must')):
    bad = adversarial_config.get_config()
    bad[key] = value
    with pytest.raises(ValueError, match=match):
      _check(bad)
  with pytest.raises(ValueError, match='unknown variant'):
    adversarial_config.get_config('nonsense')


def _run(*args):
  return subprocess.run(
      [sys.executable, '-m', 'experiments.adversarial', *args], cwd=REPO,
      capture_output=True, text=True, timeout=900, env=conftest.training_env())


def test_help_and_bad_flags(tmp_path):
  result = _run('--help')
  assert result.returncode in (0, 1), result.stderr
  for text in ('--workdir', '--models', '--config', 'bim_steps'):
    assert text in result.stdout, text
  # Flags and keys are read before JAX is imported, a missing workdir after:
  # one of run()'s errors, each one line (the others: the test below).
  for bad in ('--bogus=1', '--config.bim_stepz=3',
              f'--models={tmp_path / "missing"}'):
    result = _run(f'--workdir={tmp_path / "out"}', bad)
    assert result.returncode == 2, (bad, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error:'), result.stderr
  assert 'is not a capsjax workdir' in lines[0], lines


@pytest.mark.parametrize('overrides', [{}, {'loss': 'hinge'}])
def test_nothing_to_attack_is_refused_before_anything_runs(tmp_path,
                                                            overrides):
  config = adversarial_config.get_config()
  config.update(overrides)
  assert not config.train
  with pytest.raises(ValueError, match='no models to attack: pass --models'):
    adversarial_experiment.run(config, str(tmp_path / 'out'))


@needs_mnist
@pytest.mark.slow
def test_smoke_trains_attacks_and_writes_table_and_plot(tmp_path):
  # The first 1,000 training and 500 test digits: the plumbing, not the
  # accuracy, counts.
  mnist_dir = conftest.write_mnist_subset(tmp_path / 'mnist', 1000, 500)
  workdir = tmp_path / 'out'
  result = _run(f'--workdir={workdir}',
                '--config=experiments/configs/adversarial.py:smoke',
                '--config.data_dir=' + mnist_dir)
  assert result.returncode == 0, result.stdout + result.stderr
  summary = json.load(open(workdir / 'summary.json'))
  assert summary['epsilons'] == [0.0, 0.1, 0.3]
  assert set(summary['models']) == {'capsnet', 'baseline_cnn'}
  print(json.dumps(summary['models'], indent=1))
  for name in ('capsnet', 'baseline_cnn'):
    # Trained on the same 1,000 digits: 10 steps of 16 are about 0.18 of an
    # epoch of the 900 beside the 100 for validation (0.003 of the full
    # training set's 59,900).
    trained = json.load(open(workdir / 'train' / name / 'summary.json'))
    assert 0.15 < trained['epochs'] < 0.2, trained
  for name, row in summary['models'].items():
    for attack in ('fgsm', 'bim'):
      assert len(row[attack]) == 3
      assert row[attack][0] == row['clean_accuracy']
      assert all(0.0 <= a <= 1.0 for a in row[attack])
      # The attacks work: accuracy falls as epsilon grows.
      assert row[attack][2] < row[attack][0], (name, attack, row)
    # BIM (iterated, same budget) is at least as strong as FGSM, to within
    # 2 of the 50 attacked images.
    for e in (1, 2):
      assert row['bim'][e] <= row['fgsm'][e] + 0.04, (name, row)
    assert row['test_accuracy_full_test_set'] is not None
  with open(workdir / 'accuracy_vs_epsilon.png', 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
