"""affNIST generalisation (Sabour et al. section 5.2): digits on a 40x40
canvas, stopping at a target accuracy, extra test sets, the experiment."""

import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from capsjax import data as data_lib
from capsjax import figures
from capsjax import models
from capsjax import training
from capsjax.training import loop
from capsjax.training import state as state_lib
from capsjax.training import vector_capsules
from experiments import affnist
from experiments.configs import capsnet_affnist
from experiments.configs import common
from tests import conftest
from tests.conftest import REPO
from tests.conftest import needs_mnist
from tests.helpers import write_release_mat


def _digits(seed, n):
  """uint8 [n, 28, 28, 1] blocks with a random 10x10 blob of ink each."""
  rng = np.random.default_rng(seed)
  images = np.zeros((n, 28, 28, 1), np.uint8)
  for i in range(n):
    r, c = rng.integers(0, 18, 2)
    images[i, r:r + 10, c:c + 10, 0] = rng.integers(1, 256, (10, 10))
  return images, (np.arange(n) % 10).astype(np.int32)


def test_on_canvas_places_each_digit_whole_and_fixed_by_seed():
  images, labels = _digits(0, 50)
  split = data_lib.on_canvas(data_lib.Split(images, labels), 40, seed=3)
  assert split.images.shape == (50, 40, 40, 1)
  assert split.images.dtype == np.uint8
  np.testing.assert_array_equal(split.labels, labels)
  corners = set()
  for source, placed in zip(images, split.images, strict=True):
    # The 28x28 digit appears unchanged at one position, zeros elsewhere.
    rows, cols = np.nonzero(placed[..., 0])
    src_rows, src_cols = np.nonzero(source[..., 0])
    dr, dc = rows.min() - src_rows.min(), cols.min() - src_cols.min()
    assert 0 <= dr <= 12 and 0 <= dc <= 12
    np.testing.assert_array_equal(placed[dr:dr + 28, dc:dc + 28], source)
    assert placed.sum() == source.sum()
    corners.add((dr, dc))
  assert len(corners) > 20  # random places, not one
  again = data_lib.on_canvas(data_lib.Split(images, labels), 40, seed=3)
  np.testing.assert_array_equal(again.images, split.images)
  other = data_lib.on_canvas(data_lib.Split(images, labels), 40, seed=4)
  assert not np.array_equal(other.images, split.images)
  empty = data_lib.on_canvas(data_lib.Split(images[:0], labels[:0]), 40, 0)
  assert empty.images.shape == (0, 40, 40, 1)


def _baseline_config(**overrides):
  config = capsnet_affnist.training_config('baseline_cnn')
  config.model_options.conv_channels = (4, 4, 2)
  config.model_options.fc_widths = (8, 8)
  config.model_options.padding = 'SAME'
  config.model_options.dropout_rate = 0.0
  config.batch_size = 8
  config.eval_batch_size = 16
  config.update(overrides)
  return config


def test_train_step_places_digits_on_the_canvas_with_the_key():
  config = _baseline_config()
  images, labels = _digits(1, 8)
  optimizer = state_lib.make_optimizer(config)
  steps = vector_capsules.make_steps(config, optimizer)
  graphdef, state = state_lib.init_train_state(
      state_lib.create_model(config), optimizer)
  key = jax.random.key(5)

  @nnx.jit
  def log_probabilities(model, key):
    # The canvas and the forward pass in one compiled program, not one per
    # op and shape.
    placed = data_lib.place_on_canvas(jax.random.fold_in(key, 1),
                                      data_lib.to_float(images), 40)
    logits = model(placed, labels, train=True)['class_scores']
    return jax.nn.log_softmax(logits)

  model = nnx.merge(graphdef, state.params, state.model_state)
  log_p = np.asarray(log_probabilities(model, key))
  want = np.mean(-log_p[np.arange(8), labels])
  _, metrics = jax.jit(functools.partial(steps.train_step, graphdef))(
      state, images, labels, key)
  np.testing.assert_allclose(metrics['loss'], want, rtol=1e-5)


def _dataset(n_train=64, n_eval=32):
  images, labels = _digits(2, n_train + 2 * n_eval)
  train = data_lib.Split(images[:n_train], labels[:n_train])
  val = data_lib.on_canvas(
      data_lib.Split(images[n_train:n_train + n_eval],
                     labels[n_train:n_train + n_eval]), 40, 0)
  test = data_lib.on_canvas(
      data_lib.Split(images[-n_eval:], labels[-n_eval:]), 40, 1)
  return data_lib.Dataset(train, val, test, 10, 'blobs')


def test_target_accuracy_stops_training_and_resume_keeps_it(tmp_path, capsys):
  dataset = _dataset()
  config = _baseline_config(num_train_steps=30, eval_every_steps=5,
                            checkpoint_every_steps=5, log_every_steps=5)
  steps = vector_capsules.make_steps(config, state_lib.make_optimizer(config))
  config.evals = {'again': dict(type='classification', split='test')}
  reach = affnist.reach_accuracy(1e-6)
  summary = loop.fit(config, str(tmp_path), steps, dataset, stop_when=reach)
  # Any accuracy > 0 reaches the target at the first evaluation.
  assert summary['validation']['accuracy'] >= 1e-6
  assert summary['steps'] == 5 and summary['stopped_early']
  assert not summary['stopped_by_time_limit']
  assert summary['evals']['again'] == summary['test']
  assert 'reached the target 1e-06 at step 5; stopping.' in (
      capsys.readouterr().out)
  # A rerun of a run that reached its target trains no further.
  config.evals = {}
  again = loop.fit(config, str(tmp_path), steps, dataset, stop_when=reach)
  assert again['steps'] == 5 and again['stopped_early']
  assert 'evals' not in again

  # An unreachable target: all steps, not reached; without a rule the
  # summary says nothing of one.
  unreached = loop.fit(config, str(tmp_path / 'all'), steps, dataset,
                       stop_when=affnist.reach_accuracy(1.0))
  assert unreached['steps'] == 30 and not unreached['stopped_early']
  plain = loop.fit(config, str(tmp_path / 'all'), steps, dataset)
  assert 'stopped_early' not in plain


def test_bad_training_keys_are_clear_errors():
  with pytest.raises(ValueError, match=r'target accuracy must be in'):
    affnist.reach_accuracy(1.5)
  with pytest.raises(ValueError, match=r'config.canvas_size must be'):
    loop.check_config(_baseline_config(canvas_size=-40))


def test_configs():
  count = lambda c: models.count_params(nnx.eval_shape(
      lambda: state_lib.create_model(c)))
  paper = capsnet_affnist.get_config()
  assert paper.to_dict() == capsnet_affnist.get_config('paper').to_dict()
  assert count(paper.capsnet) == 13_475_808
  assert count(paper.baseline) == 14_361_282  # "a similar number"
  for config in (paper, capsnet_affnist.get_config('cpu,smoke')):
    for run in (config.capsnet, config.baseline):
      assert run.canvas_size == 40 and run.max_shift == 0
      assert run.model_options.input_shape == (40, 40, 1)
      # Every key of a training config, so --config.capsnet.KEY works.
      assert set(common.base_config().to_dict()) <= set(run.to_dict())
  cpu = capsnet_affnist.get_config('cpu')
  assert count(cpu.capsnet) == 1_868_320 and count(cpu.baseline) == 1_680_154
  with pytest.raises(ValueError, match="unknown variant 'nonsense'"):
    capsnet_affnist.get_config('nonsense')


def test_affnist_figure(tmp_path):
  images = np.zeros((3, 40, 40, 1), np.uint8)
  fig = figures.affnist_figure(
      images, [1, 2, 3], {'capsnet': [1, 2, 4], 'baseline_cnn': [0, 2, 3]},
      tmp_path / 'a.png')
  texts = [t for ax in fig.axes for t in ax.texts]
  wrong = sorted(t.get_text() for t in texts if t.get_color() == 'tab:red')
  assert wrong == ['baseline_cnn: 0', 'capsnet: 4']
  assert (tmp_path / 'a.png').stat().st_size > 0


def _launch(workdir, *args):
  return subprocess.run(
      [sys.executable, '-m', 'experiments.affnist', f'--workdir={workdir}',
       '--config=experiments/configs/capsnet_affnist.py:smoke', *args],
      cwd=REPO, capture_output=True, text=True, env=conftest.training_env(),
      timeout=900)


@needs_mnist
def test_help_and_bad_config_are_clear(tmp_path):
  out = subprocess.run([sys.executable, '-m', 'experiments.affnist', '--help'],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode in (0, 1), out.stderr
  assert '--workdir' in out.stdout and '--config' in out.stdout
  proc = _launch(tmp_path / 'w',
                 '--config.affnist_dir=' + str(tmp_path / 'nowhere'))
  assert proc.returncode == 2, proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith('error: ') and 'nowhere' in last, proc.stderr
  assert 'Traceback' not in proc.stderr
  assert not (tmp_path / 'w' / 'capsnet' / 'summary.json').exists()
  # A canvas affNIST's images do not fit: a ValueError (one line on the
  # command line, as above) before any training.
  config = capsnet_affnist.get_config('smoke')
  config.capsnet.canvas_size = 28
  with pytest.raises(ValueError, match='canvas_size 28'):
    affnist.run_config(config, config.capsnet)


def write_affnist_file(directory, mnist_dir):
  """An affNIST test file in the release format for the :smoke config: the
  transformed digits of its affine_mnist test (the first
  ``affine_test_size`` MNIST test digits), the first half relabelled
  (k -> k+1), so that its accuracy and affine MNIST's differ: a pipeline
  that read the file's images and labels out of step, or evaluated affine
  MNIST twice, would not give the direct counts of ``check_smoke_workdir``.
  Returns (images, file labels, the digits' true labels)."""
  config = capsnet_affnist.get_config('smoke')
  size = config.affine_test_size
  test = data_lib.load_dataset('mnist', data_dir=mnist_dir,
                               validation_size=0).test
  images = data_lib.affine_mnist(test.images[:size], config.affine_seed)
  labels = test.labels[:size]
  file_labels = labels.copy()
  file_labels[:size // 2] = (file_labels[:size // 2] + 1) % 10
  os.makedirs(directory, exist_ok=True)
  write_release_mat(os.path.join(directory, 'test.mat'), images[..., 0],
                    file_labels)
  return images, file_labels, labels


def check_smoke_workdir(workdir, images, file_labels, labels):
  """The :smoke config's run in ``workdir`` with the affNIST file of
  ``write_affnist_file`` (the reproduction suite's smoke run:
  tests/test_reproduce.py): each accuracy a direct count with the selected
  model on what it was given, and the CNN's stop at the CapsNet's
  validation accuracy."""
  config = capsnet_affnist.get_config('smoke')
  record = json.load(open(workdir / 'affnist_summary.json'))
  assert record['affine_mnist'] == {'size': config.affine_test_size,
                                    'seed': config.affine_seed}
  capsnet, cnn = record['models']['capsnet'], record['models']['baseline_cnn']
  for name, model in record['models'].items():
    summary = json.load(open(workdir / name / 'summary.json'))
    selected = training.load_trained_model(str(workdir / name), 'best')
    predictions = np.argmax(
        figures.model_outputs(selected, images)['class_scores'], -1)
    assert model['affnist_accuracy'] == pytest.approx(
        np.mean(predictions == file_labels), abs=1e-9)
    assert model['affine_mnist_accuracy'] == pytest.approx(
        np.mean(predictions == labels), abs=1e-9)
    assert model['expanded_mnist_test_accuracy'] == summary['test']['accuracy']
    assert model['paper_affnist_accuracy'] == {'capsnet': 0.79,
                                               'baseline_cnn': 0.66}[name]
  # The CNN's stop is the CapsNet's validation accuracy.
  assert cnn['target_accuracy'] == capsnet['expanded_mnist_validation_accuracy']
  assert cnn['reached_target'] == (
      cnn['expanded_mnist_validation_accuracy'] >= cnn['target_accuracy'])
  assert (cnn['steps'] < config.baseline.num_train_steps) == (
      cnn['reached_target'])
  assert os.path.getsize(workdir / 'affnist_examples.png') > 0
