"""Tests of capsjax.evaluators and of how training runs them.

A tiny CapsNet is trained once on random digits; what ``fit`` reports and
what the evaluators return are checked against direct counts over the saved
model, written here from the paper's definitions, not from the code tested.
"""

import json
import os

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from capsjax import data as data_lib
from capsjax import evaluators
from capsjax import models
from capsjax import training
from capsjax.evaluators import adversarial as adversarial_evaluator
from capsjax.evaluators import affine
from capsjax.evaluators import two_digit_transfer
from experiments.configs import capsnet_mnist
from tests import conftest
from tests.helpers import TINY
from tests.helpers import TINY_OPTIONS
from tests.helpers import write_release_mat
from tests.helpers import write_tiny_mnist

_NUM_TEST = 40
# 40 test images in batches of 16: the last batch is padded with 8 masked
# copies, which a count that ignored the mask would include.
_EVAL_BATCH = 16

# A model's test-time outputs, jitted: one compilation, not one per
# operation.
_outputs = nnx.jit(lambda model, images: model(images, train=False))


def _config(data_dir, **overrides):
  config = capsnet_mnist.get_config('smoke')
  config.model_options.update(TINY_OPTIONS)
  config.update(TINY)
  config.data_dir = data_dir
  config.eval_batch_size = _EVAL_BATCH
  config.update(overrides)
  return config


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  root = tmp_path_factory.mktemp('evaluators')
  data_dir = write_tiny_mnist(root / 'mnist', num_test=_NUM_TEST)
  config = _config(data_dir)
  config.evals = {'test_again': dict(type='classification'),
                  'routing': dict(type='routing_picture', index=3)}
  workdir = str(root / 'run')
  summary = training.train(config, workdir)
  test = data_lib.load_dataset('mnist', data_dir=data_dir,
                               validation_size=0).test
  return workdir, summary, config, test


def test_fit_runs_the_config_evals_on_the_selected_model(trained):
  workdir, summary, _, test = trained
  assert summary['evals']['test_again'] == summary['test']
  routing = summary['evals']['routing']
  assert routing['label'] == int(test.labels[3])
  assert os.path.getsize(routing['figure']) > 1000
  assert routing['figure'] == os.path.join(workdir, 'figures', 'routing.png')


def test_reported_test_numbers_are_a_direct_count_on_the_selected_model(
    trained):
  workdir, summary, config, test = trained
  # The selected step is the first step of the best validation accuracy.
  records = [json.loads(line) for line in open(
      os.path.join(workdir, 'metrics.jsonl'))]
  validation = [(r['step'], r['validation/accuracy']) for r in records
                if 'validation/accuracy' in r]
  best = max(accuracy for _, accuracy in validation)
  assert summary['selected_step'] == min(
      step for step, accuracy in validation if accuracy == best)
  assert summary['validation']['accuracy'] == best
  # The test numbers are those of that checkpoint, over all 40 images.
  model = training.load_trained_model(workdir, 'best')
  images = test.images.astype(np.float32) / 255.0
  outputs = jax.device_get(_outputs(model, images))
  lengths = np.asarray(outputs['class_scores'], np.float64)
  accuracy = np.mean(np.argmax(lengths, -1) == test.labels)
  reconstruction = np.sum((np.asarray(outputs['reconstructions'], np.float64)
                           - images.reshape(_NUM_TEST, -1)) ** 2, axis=-1)
  margin = conftest.np_margin_loss(lengths, test.labels)
  if config.loss_form == 'official':  # half the mean over the 10 classes
    margin = margin / 20
  loss = np.mean(margin + config.reconstruction_weight * reconstruction)
  assert summary['test']['accuracy'] == pytest.approx(accuracy, abs=1e-12)
  assert summary['test']['error'] == pytest.approx(1 - accuracy, abs=1e-12)
  assert summary['test']['loss'] == pytest.approx(loss, rel=1e-5)


def test_load_context_evaluates_a_workdir_as_fit_did(trained):
  workdir, summary, _, _ = trained
  context = training.load_context(workdir)
  assert context.evaluate_split(context.dataset.test) == pytest.approx(
      summary['test'])
  validation = evaluators.get('classification').evaluate(
      context, split='validation')
  assert validation == pytest.approx(
      {k: v for k, v in summary['validation'].items() if k != 'step'})


def test_attacks_at_epsilon_zero_are_the_clean_accuracy(trained):
  workdir, _, _, test = trained
  context = training.load_context(workdir)
  row = adversarial_evaluator.evaluate(context, epsilons=(0.0, 0.3), num_examples=20,
                         bim_steps=2, bim_step_size=0.2, batch_size=20)
  lengths = _outputs(context.model, test.images[:20] / 255.0)['class_scores']
  clean = np.mean(np.argmax(lengths, -1) == test.labels[:20])
  assert row['clean_accuracy'] == pytest.approx(clean)
  assert row['fgsm'][0] == row['bim'][0] == row['clean_accuracy']
  assert 'margin loss' in row['attack_loss']


def test_two_digit_transfer_counts_both_classes_of_each_pair(tmp_path):
  data_dir = write_tiny_mnist(tmp_path / 'mnist', num_test=60)
  test = data_lib.load_dataset('mnist', data_dir=data_dir,
                               validation_size=0).test
  model = models.create_model('two_digit_capsnet', rngs=nnx.Rngs(0),
                              trunk_widths=(4, 4, 8, 8), capsule_dim=4)
  config = ml_collections.ConfigDict({'seed': 3, 'dataset': 'mnist'})
  context = evaluators.Context(
      model=model, config=config, workdir=str(tmp_path),
      evaluate_split=None, eval_inputs=None,
      load_dataset=lambda: data_lib.Dataset(test, test, test, 10, 'mnist'))
  for layout in ('stacked', 'side_by_side'):
    result = two_digit_transfer.evaluate(context, num_pairs=25,
                                      confidence_threshold=0.3, layout=layout)
    # Direct: the pairs of seed 3, both classes among the two top scores.
    pairs = data_lib.digit_pairs(test.images, test.labels, 3, layout)
    images = pairs['image'][:25].astype(np.float32) / 255.0
    scores = np.asarray(_outputs(model, images)['class_scores'])
    right = conftest.np_both_in_top2(scores, pairs['labels'][:25])
    second = np.sort(scores, -1)[:, -2]
    assert result['num_pairs'] == 25 and result['layout'] == layout
    assert result['top2'] == pytest.approx(np.mean(right))
    assert result['top2_confident'] == pytest.approx(
        np.mean(right & (second > 0.3)))


def test_affine_evaluator_reads_the_affnist_test_files(tmp_path):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (7, 40, 40), dtype=np.uint8)
  labels = rng.integers(0, 10, 7)
  os.makedirs(tmp_path / 'affnist')
  write_release_mat(tmp_path / 'affnist' / 'test.mat', images, labels)
  config = ml_collections.ConfigDict({'data_dir': ''})
  split = affine.test_split(config, source='affnist',
                            directory=str(tmp_path / 'affnist'))
  np.testing.assert_array_equal(split.images[..., 0], images)
  np.testing.assert_array_equal(split.labels, labels)
  seen = []
  context = evaluators.Context(
      model=None, config=config, workdir=str(tmp_path),
      evaluate_split=lambda s: seen.append(s) or {'accuracy': 0.5},
      eval_inputs=None, load_dataset=None)
  assert affine.evaluate(context, source='affnist',
                         directory=str(tmp_path / 'affnist')) == {
                             'accuracy': 0.5}
  np.testing.assert_array_equal(seen[0].labels, labels)


def test_translated_mnist_places_the_test_digits_untransformed(tmp_path):
  data_dir = write_tiny_mnist(tmp_path / 'mnist', num_test=12)
  config = ml_collections.ConfigDict({'data_dir': data_dir})
  test = data_lib.load_dataset('mnist', data_dir=data_dir,
                               validation_size=0).test
  split = affine.test_split(config, source='translated_mnist', size=10)
  assert split.images.shape == (10, 40, 40, 1)
  np.testing.assert_array_equal(split.labels, test.labels[:10])
  for placed, digit in zip(split.images, test.images[:10], strict=True):
    rows, cols = np.nonzero(placed[..., 0] == digit[0, 0, 0])
    found = [(r, c) for r, c in zip(rows, cols, strict=True)
             if r <= 12 and c <= 12 and np.array_equal(
                 placed[r:r + 28, c:c + 28], digit)]
    assert found, 'each digit is a 28x28 window of its canvas, unchanged'
  again = affine.test_split(config, source='translated_mnist', size=10)
  np.testing.assert_array_equal(again.images, split.images)  # seeded


def test_bad_evals_fail_before_any_training(tmp_path):
  data_dir = write_tiny_mnist(tmp_path / 'mnist')
  cases = (
      ({'x': dict(type='nonsense')}, ValueError, 'unknown evaluator type'),
      ({'x': dict(split='test')}, ValueError, 'names no evaluator type'),
      ({'x': dict(type='classification', bogus=1)}, ValueError,
       'takes no option'),
      ({'x': dict(type='classification', split='train')}, ValueError,
       'split in'),
      ({'x': dict(type='affine', source='affnist',
                  directory=str(tmp_path / 'none'))}, FileNotFoundError,
       'no such affNIST'),
      ({'x': dict(type='two_digit_transfer', layout='diagonal')}, ValueError,
       'layout must be one of'),
      ({'x': dict(type='two_digit_transfer', num_pairs=-1)}, ValueError,
       'num_pairs'),
  )
  for i, (evals, error, match) in enumerate(cases):
    config = _config(data_dir)
    config.evals = evals
    workdir = tmp_path / f'run{i}'
    with pytest.raises(error, match=match):
      training.train(config, str(workdir))
    assert not os.path.exists(workdir / 'checkpoints'), evals
  assert set(evaluators.available()) >= {
      'adversarial', 'affine', 'classification', 'confusion',
      'multimnist_figure', 'reconstructions', 'routing_picture',
      'two_digit_transfer'}
