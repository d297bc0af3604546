"""Sabour et al. section 7's other datasets: the CIFAR-10, SVHN and smallNORB
configs, their input pipelines, their smoke runs on release files the tests
write, and the ensemble evaluation."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from benchmarks import harness
from capsjax import data as data_lib
from capsjax import evaluators
from capsjax import models
from capsjax import training
from capsjax.evaluators import ensemble
from capsjax.training import state as state_lib
from capsjax.training import vector_capsules
from experiments import reproduce
from experiments.configs import capsnet_cifar10
from experiments.configs import capsnet_mnist
from experiments.configs import capsnet_smallnorb
from experiments.configs import capsnet_svhn
from tests import conftest
from tests.conftest import unit_tier_keeps
from tests.helpers import make_cifar10_release
from tests.helpers import make_norb_release
from tests.helpers import make_svhn_release

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {'cifar10': capsnet_cifar10, 'svhn': capsnet_svhn,
           'smallnorb': capsnet_smallnorb}
# A few steps of small batches: the plumbing, not the accuracy.
TINY = dict(batch_size=8, validation_size=6, num_train_steps=4,
            eval_every_steps=2, checkpoint_every_steps=2, log_every_steps=1,
            eval_batch_size=16)


# ----------------------------------------------------------------------------
# Configs and models.


def test_configs_hold_the_papers_options():
  mnist = capsnet_mnist.get_config().model_options
  cifar = capsnet_cifar10.get_config()
  options = cifar.model_options
  assert cifar.dataset == 'cifar10' and cifar.ensemble_size == 7
  assert tuple(options.input_shape) == (24, 24, 3)
  assert options.primary_types == 64 and options.num_iterations == 3
  # The official run: leaky routing, 'SAME' padding, no decoder.
  assert options.leaky and options.padding == 'SAME'
  assert not options.reconstruction
  assert cifar.random_flip and cifar.pixel_max == 255.0
  norb = capsnet_smallnorb.get_config()
  # The MNIST architecture unchanged, on 32x32 stereo crops of 48x48.
  assert tuple(norb.model_options.input_shape) == (32, 32, 2)
  assert norb.model_options.num_classes == 5
  for key in ('conv1_channels', 'primary_types', 'padding', 'leaky'):
    assert key not in norb.model_options or (
        norb.model_options[key] == mnist.get(key)), key
  assert (norb.downsample, norb.augment_order) == ('pick', 'released')
  svhn = capsnet_svhn.get_config().model_options
  assert (svhn.conv1_channels, svhn.primary_types, svhn.primary_dim,
          svhn.digit_dim) == (64, 16, 6, 8)
  for module in CONFIGS.values():
    for variant in ('', 'smoke'):
      config = module.get_config(variant)
      # The official form and loss, as capsnet_mnist.py.
      assert config.model_options.form == 'official'
      assert config.loss_form == 'official'
      assert config.model == 'capsnet'
    with pytest.raises(ValueError, match='unknown variant'):
      module.get_config('nonsense')


def _abstract_model(config):
  return nnx.eval_shape(lambda: state_lib.create_model(config))


def test_official_cifar10_model_shapes_and_size():
  model = _abstract_model(capsnet_cifar10.get_config())
  # 'SAME': a 24x24 Conv1 grid, 12x12 x 64 primary capsules.
  assert model.primary.num_capsules(24, 24) == 12 * 12 * 64
  assert model.decoder is None
  conv1 = 9 * 9 * 3 * 256 + 256
  primary = 9 * 9 * 256 * 64 * 8 + 64 * 8
  digit = 12 * 12 * 64 * 8 * 10 * 16 + 10 * 16
  assert models.count_params(model) == conv1 + primary + digit == 22_476_448
  svhn = _abstract_model(capsnet_svhn.get_config())
  assert svhn.primary.num_capsules(24, 24) == 8 * 8 * 16
  norb = _abstract_model(capsnet_smallnorb.get_config())
  assert norb.primary.num_capsules(24, 24) == 8 * 8 * 32


def test_same_padding_capsnet_runs():
  model = models.create_model(
      'capsnet', rngs=nnx.Rngs(0), input_shape=(12, 12, 3), conv1_channels=4,
      primary_types=2, padding='SAME', leaky=True, form='official',
      reconstruction=False)
  out = nnx.jit(lambda m, x: m(x))(model, np.zeros((2, 12, 12, 3),
                                                    np.float32))
  assert out['coupling'].shape == (2, 6 * 6 * 2, 10)
  assert out['class_scores'].shape == (2, 10)
  # The official leaky primary capsules: coupling 1/(types + 1).
  assert model.primary.coupling == 1 / 3
  with pytest.raises(ValueError, match='padding'):
    models.create_model('capsnet', rngs=nnx.Rngs(0), padding='FULL')


def test_benchmark_feeds_the_stored_image_sizes():
  for name, shape in (('capsnet_cifar10', (32, 32, 3)),
                      ('capsnet_svhn', (32, 32, 3)),
                      ('capsnet_smallnorb', (48, 48, 2))):
    assert harness.image_shape(harness.resolve_config(name)) == shape


# ----------------------------------------------------------------------------
# Input pipelines of the dynamic family.


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_preprocess_train_and_eval(name):
  config = CONFIGS[name].get_config('smoke')
  height, width, channels = {'cifar10': (32, 32, 3), 'svhn': (32, 32, 3),
                             'smallnorb': (48, 48, 2)}[name]
  images = np.random.default_rng(0).integers(
      0, 256, (4, height, width, channels), dtype=np.uint8)
  train = jax.jit(lambda x, k: vector_capsules.preprocess(config, x, k))(
      images, jax.random.key(0))
  # Jitted, as the training loop runs it: one program, not one per operation.
  evaluation = jax.jit(vector_capsules.make_steps(
      config, state_lib.make_optimizer(config)).eval_inputs)(images)
  shape = (4, *config.model_options.input_shape)
  assert train.shape == evaluation.shape == shape
  assert train.dtype == evaluation.dtype == np.float32
  if name == 'svhn':  # the digits' input: [0, 1], shifted
    np.testing.assert_allclose(evaluation, images / 255, atol=1e-7)
    return
  # Standardised crops (the official input), the central one at test.
  np.testing.assert_allclose(np.mean(train, axis=(1, 2, 3)), 0, atol=1e-4)
  s = shape[1]
  top = (height - s) // 2
  centre = images[:, top:top + s, top:top + s].astype(np.float64)
  mean = centre.mean(axis=(1, 2, 3), keepdims=True)
  std = centre.std(axis=(1, 2, 3), keepdims=True)
  np.testing.assert_allclose(evaluation, (centre - mean) / std, atol=1e-4)


# ----------------------------------------------------------------------------
# The smoke configs end to end on release files in the official formats.


def write_release(name, directory):
  """Tiny releases: CIFAR-10's binary batches, SVHN's .mat files, the six
  smallNORB matrix files."""
  if name == 'cifar10':
    make_cifar10_release(directory / 'cifar-10-batches-bin',
                                   n_per_batch=6, n_test=8)
  elif name == 'svhn':
    make_svhn_release(directory / 'svhn', n_train=30, n_test=8)
  else:
    make_norb_release(directory / 'smallnorb', n_train=30,
                                     n_test=8)
  return str(directory)


def tiny_config(name, data_dir):
  config = CONFIGS[name].get_config('smoke')
  config.update(TINY)
  config.data_dir = data_dir
  return config


@pytest.mark.parametrize('name', unit_tier_keeps(sorted(CONFIGS), 'cifar10'))
def test_smoke_config_trains_end_to_end(tmp_path, name):
  config = tiny_config(name, write_release(name, tmp_path / 'data'))
  summary = training.train(config, str(tmp_path / 'work'))
  assert summary['dataset'] == name
  assert summary['steps'] == config.num_train_steps
  assert 0.0 <= summary['test']['accuracy'] <= 1.0
  assert summary['num_params'] == models.count_params(
      _abstract_model(config))
  for line in open(tmp_path / 'work' / 'metrics.jsonl'):
    record = json.loads(line)
    assert all(np.isfinite(v) for v in record.values()
               if isinstance(v, float)), record


# ----------------------------------------------------------------------------
# The ensemble.


def test_average_scores():
  scores = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
  np.testing.assert_allclose(jax.jit(ensemble.average_scores)(scores),
                             scores.mean(axis=0))
  assert ensemble.accuracy([[0.1, 0.9], [0.8, 0.2]], [1, 1]) == 0.5
  with pytest.raises(ValueError, match=r'\[M, N, K\]'):
    ensemble.average_scores(np.zeros((3, 4)))


def _tiny_contexts(tmp_path, dataset, num):
  """Untrained tiny CIFAR-10 CapsNets (seeds 0 .. num - 1) as contexts."""
  config = capsnet_cifar10.get_config('smoke')
  config.model_options.update(conv1_channels=4, primary_types=2)
  steps = vector_capsules.make_steps(config, state_lib.make_optimizer(config))
  contexts = {}
  # Opens the other members as training.load_context would.
  load_workdir = lambda workdir, which, data_dir: contexts[workdir]  # noqa: E731
  for seed in range(num):
    workdir = tmp_path / f'model_{seed}'
    workdir.mkdir()
    contexts[str(workdir)] = evaluators.Context(
        model=state_lib.create_model(config, seed=seed), config=config,
        workdir=str(workdir), evaluate_split=None,
        eval_inputs=steps.eval_inputs, load_dataset=lambda: dataset,
        load_workdir=load_workdir)
  return contexts


def test_ensemble_averages_the_members_scores(tmp_path):
  rng = np.random.default_rng(0)
  split = data_lib.Split(rng.integers(0, 256, (40, 32, 32, 3), np.uint8),
                         rng.integers(0, 10, 40).astype(np.int32))
  dataset = data_lib.Dataset(split, split, split, 10, 'cifar10')
  contexts = _tiny_contexts(tmp_path, dataset, 3)
  first, *members = contexts
  result = ensemble.evaluate(contexts[first], members=members)
  # Each model's scores, counted directly.
  inputs = data_lib.cifar10_eval_preprocess(split.images)
  lengths = nnx.jit(lambda model, x: model(x)['class_scores'])
  scores = np.stack([np.asarray(lengths(c.model, inputs))
                     for c in contexts.values()])
  mean = scores.mean(axis=0)
  assert result['num_models'] == 3 and result['num_examples'] == 40
  assert result['accuracy'] == np.mean(mean.argmax(-1) == split.labels)
  assert result['error'] == 1 - result['accuracy']
  np.testing.assert_allclose(
      result['member_accuracies'],
      [np.mean(s.argmax(-1) == split.labels) for s in scores])
  # ensemble_workdirs: the same from the workdirs, both splits at once.
  both = ensemble.ensemble_workdirs(
      list(contexts), load_context=contexts[first].load_workdir,
      splits=('test', 'validation'))
  assert both['test'] == both['validation'] == result
  # A context that cannot open workdirs says so.
  alone = dataclasses.replace(contexts[first], load_workdir=None)
  with pytest.raises(ValueError, match='this context has none'):
    ensemble.evaluate(alone, members=members)
  with pytest.raises(ValueError, match='split'):
    ensemble.evaluate(contexts[first], split='train')
  with pytest.raises(ValueError, match='not a directory'):
    ensemble.evaluate(contexts[first], members=[str(tmp_path / 'none')])
  other = contexts[members[0]]
  other.config = other.config.copy_and_resolve_references()
  other.config.dataset = 'svhn'
  with pytest.raises(ValueError, match='must share their data'):
    ensemble.evaluate(contexts[first], members=members)


@pytest.mark.slow
def test_ensemble_experiment_trains_and_tests_from_the_command_line(tmp_path):
  """experiments.capsnet_ensemble on a CIFAR-10 binary release the test
  writes: two smoke models, then their ensemble; a rerun trains nothing."""
  data_dir = write_release('cifar10', tmp_path / 'data')
  workdir = tmp_path / 'ensemble'
  argv = [sys.executable, '-m', 'experiments.capsnet_ensemble',
          f'--workdir={workdir}',
          '--config=experiments/configs/capsnet_cifar10.py:smoke',
          f'--config.data_dir={data_dir}',
          '--config.model_options.conv1_channels=8',
          '--config.model_options.primary_types=2'] + [
              f'--config.{k}={v}' for k, v in TINY.items()]
  run = lambda: subprocess.run(  # noqa: E731
      argv, cwd=REPO, env=conftest.training_env(), capture_output=True,
      text=True, timeout=600)
  first = run()
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  record = json.load(open(workdir / 'ensemble_summary.json'))
  assert record['num_models'] == 2 and record['paper_test_error'] == 0.106
  assert [m['seed'] for m in record['models']] == [0, 1]
  for split in ('test', 'validation'):
    # Each model's accuracy in the ensemble is its own run's.
    assert record[split]['member_accuracies'] == [
        m[split]['accuracy'] for m in record['models']]
  # The ensemble counted again from the two trained workdirs.
  contexts = [training.load_context(m['workdir']) for m in record['models']]
  test = contexts[0].dataset.test
  scores = [ensemble.class_scores(c, test.images) for c in contexts]
  assert record['test']['accuracy'] == ensemble.accuracy(
      np.mean(scores, axis=0), test.labels)
  assert 'ensemble of 2: test error' in first.stdout
  rows = reproduce._ensemble_rows(str(workdir))
  assert rows[0]['row'] == 'CapsNet, CIFAR-10, ensemble of 2'
  assert rows[0]['paper'] == '10.6%'
  assert rows[0]['test'] == record['test']['error']
  second = run()
  assert second.returncode == 0, second.stderr[-3000:]
  assert second.stdout.count('has finished training') == 2
