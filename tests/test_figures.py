"""Tests of capsjax.figures and the figure CLIs (capsnet_figures, routing_pictures).

Small models keep the library tests fast; one tiny training run (4 steps on
the first 400 digits of the shared MNIST, most of it compilation) gives the
CLIs a real workdir: those two tests are marked slow (``-m "not slow"``
skips them).
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from capsjax import figures
from capsjax import models
from capsjax.training import vector_capsules
from tests import conftest
from tests.conftest import REPO
from tests.conftest import needs_mnist
from tests.conftest import unit_tier_keeps

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


@pytest.fixture(scope='module')
def capsnet():
  return models.create_model('capsnet', rngs=nnx.Rngs(0), conv1_channels=8,
                             primary_types=4, decoder_widths=(16, 32))


@pytest.fixture(scope='module')
def matrix_capsnet():
  # The shipped configs' coordinates: the routing picture must add the same
  # offsets as the model (a second forward pass once left them out).
  return models.create_model('matrix_capsnet', rngs=nnx.Rngs(0),
                             input_shape=(28, 28, 1), num_classes=10, A=8, B=4,
                             C=4, D=4, coordinate_form='authors')


@pytest.fixture(scope='module')
def images():
  """Four 28x28 'digits': a bright bar, a box, a cross and noise."""
  rng = np.random.default_rng(0)
  out = np.zeros((4, 28, 28, 1), np.float32)
  out[0, 6:22, 12:16] = 1.0
  out[1, 6:22, 6:22] = 1.0
  out[1, 9:19, 9:19] = 0.0
  out[2, 12:16, 4:24] = out[2, 4:24, 12:16] = 1.0
  out[3] = rng.uniform(size=(28, 28, 1))
  return out


def _check_png(path, min_size=(100, 100)):
  import matplotlib.image
  with open(path, 'rb') as f:
    assert f.read(8) == PNG_MAGIC, path
  pixels = matplotlib.image.imread(path)
  assert pixels.ndim == 3 and pixels.shape[0] >= min_size[0] and (
      pixels.shape[1] >= min_size[1]), pixels.shape
  # Not a blank canvas.
  assert np.ptp(pixels[..., :3]) > 0.1
  return pixels.shape


# One compiled decoder pass for every tile checked (eager, each operation
# compiles).
_reconstruct_digits = nnx.jit(
    lambda model, capsules, labels: model.reconstruct_digits(capsules, labels))


def test_perturbed_reconstructions(capsnet, images):
  out = figures.model_outputs(capsnet, images[:1])
  tiles = figures.perturbed_reconstructions(capsnet, images[0])
  steps = figures.PERTURBATION_STEPS
  assert steps.shape == (11,) and steps[5] == 0.0
  np.testing.assert_allclose(steps[[0, -1]], [-0.25, 0.25])
  assert tiles.shape == (16, 11, 28, 28, 1)
  assert np.all(np.isfinite(tiles)) and tiles.min() >= 0 and tiles.max() <= 1
  # Offset 0: every dimension's row shows the model's own reconstruction.
  own = out['reconstructions'][0].reshape(28, 28, 1)
  for d in range(16):
    np.testing.assert_allclose(tiles[d, 5], own, atol=1e-5)
  # Every other offset changes the picture, and differently per offset.
  for s in range(11):
    for t in range(s + 1, 11):
      assert np.abs(tiles[:, s] - tiles[:, t]).max() > 1e-6, (s, t)
  # Rows differ: each dimension moves the decoder its own way.
  assert np.abs(tiles[0, 0] - tiles[1, 0]).max() > 1e-6
  # Tile (d, s) is the winning capsule alone, its dimension d (and no other
  # entry) moved by steps[s], decoded by the model's own per-digit decoder.
  capsules = out['capsules'][0]
  winner = int(np.argmax(out['class_scores'][0]))
  for d, s in ((0, 0), (7, 3), (15, 10)):
    moved = capsules.copy()
    moved[winner, d] += steps[s]
    pixels = _reconstruct_digits(capsnet, moved[None], np.array([[winner]]))
    np.testing.assert_allclose(tiles[d, s], np.asarray(pixels).reshape(
        28, 28, 1), atol=1e-5)


def test_perturbed_reconstructions_other_steps_and_uint8(capsnet, images):
  uint8 = (images[0] * 255).astype(np.uint8)
  tiles = figures.perturbed_reconstructions(capsnet, uint8, [-1.0, 0.0, 1.0])
  assert tiles.shape == (16, 3, 28, 28, 1)
  reference = figures.perturbed_reconstructions(capsnet, images[0], [0.0])
  np.testing.assert_allclose(tiles[:, 1], reference[:, 0], atol=1e-5)


def test_perturbed_reconstructions_errors(capsnet, images):
  model = models.create_model('capsnet', rngs=nnx.Rngs(0), conv1_channels=8,
                              primary_types=4, reconstruction=False)
  with pytest.raises(ValueError, match='no decoder'):
    figures.perturbed_reconstructions(model, images[0])
  with pytest.raises(ValueError, match='image must be'):
    figures.perturbed_reconstructions(capsnet, images)


def test_reconstruction_grid_writes_png(capsnet, images, tmp_path):
  out = figures.model_outputs(capsnet, images)
  path = tmp_path / 'sub' / 'reconstructions.png'
  fig = figures.reconstruction_grid(
      images, out['reconstructions'], path, labels=[1, 0, 4, 7],
      predictions=np.argmax(out['class_scores'], -1))
  assert fig is not None and len(fig.axes) == 8
  height, width, _ = _check_png(path)
  assert width > height  # four columns, two rows
  # Without a path nothing is written; [N, H*W*C] and [N, H, W, C] both work.
  figures.reconstruction_grid(images, out['reconstructions'].reshape(4, 28, 28, 1))
  with pytest.raises(ValueError, match='do not match'):
    figures.reconstruction_grid(images, out['reconstructions'][:2])


def test_perturbation_grid_writes_png(capsnet, images, tmp_path):
  path = tmp_path / 'perturbation.png'
  figures.perturbation_grid(capsnet, images[2], path)
  height, width, _ = _check_png(path, min_size=(300, 200))
  assert height > width  # 16 rows of 11 columns


def test_capsnet_routing_and_coupling_figure(capsnet, images, tmp_path):
  info = figures.capsnet_routing(capsnet, images[0])
  out = figures.model_outputs(capsnet, images[:1])
  assert info['grid'] == (6, 6, 4)
  assert info['coupling'].shape == (144, 10)
  np.testing.assert_allclose(info['coupling'].sum(-1), 1.0, atol=1e-5)
  np.testing.assert_allclose(info['coupling'], out['coupling'][0], atol=1e-6)
  assert info['primary_lengths'].shape == (144,)
  assert np.all((info['primary_lengths'] >= 0) & (info['primary_lengths'] < 1))
  assert info['prediction'] == int(np.argmax(out['class_scores'][0]))
  path = tmp_path / 'coupling.png'
  fig = figures.coupling_figure(
      images[0], info['coupling'], info['grid'], path,
      lengths=info['primary_lengths'], prediction=info['prediction'],
      scores=info['scores'])
  _check_png(path)
  assert any('(pred)' in ax.get_title() for ax in fig.axes)
  with pytest.raises(ValueError, match='coupling must be'):
    figures.coupling_figure(images[0], info['coupling'], (5, 6, 4))


def test_em_class_routing_and_assignment_figure(matrix_capsnet, images,
                                                tmp_path):
  info = figures.em_class_routing(matrix_capsnet, images[1])
  assert info['grid'] == (3, 3, 4)
  assert info['assignments'].shape == (36, 10)
  assert info['input_activations'].shape == (36,)
  assert np.all(np.isfinite(info['assignments']))
  np.testing.assert_allclose(info['assignments'].sum(-1), 1.0, atol=1e-4)
  assert info['scores'].shape == (10,)
  # The picture's forward pass is the model's own.
  out = figures.model_outputs(matrix_capsnet, images[1:2])
  np.testing.assert_allclose(info['scores'], out['class_scores'][0], atol=1e-6)
  assert info['prediction'] == int(np.argmax(out['class_scores'][0]))
  path = tmp_path / 'assignments.png'
  figures.assignment_figure(
      images[1], info['assignments'], path, grid=info['grid'],
      activations=info['input_activations'], prediction=info['prediction'],
      scores=info['scores'])
  _check_png(path)
  # Already [h, w, types, K]: no grid needed.
  figures.assignment_figure(images[1], info['assignments'].reshape(3, 3, 4, 10))
  with pytest.raises(ValueError, match='grid'):
    figures.assignment_figure(images[1], info['assignments'])


def test_routing_figure_dispatches(capsnet, matrix_capsnet, images, tmp_path):
  figures.routing_figure(capsnet, images[2], tmp_path / 'a.png')
  figures.routing_figure(matrix_capsnet, images[2], tmp_path / 'b.png')
  _check_png(tmp_path / 'a.png')
  _check_png(tmp_path / 'b.png')
  baseline = models.create_model('baseline_cnn', rngs=nnx.Rngs(0),
                                 conv_channels=(4,), fc_widths=(8,))
  with pytest.raises(ValueError, match='no routing'):
    figures.routing_figure(baseline, images[0])


# ----------------------------------------------------------------------------
# The command-line tools on a real (4-step) workdir.


def _run(module, *args):
  return subprocess.run(
      [sys.executable, '-m', module, *args], cwd=REPO, capture_output=True,
      text=True, timeout=300, env=os.environ | {'CAPSJAX_NO_PROGRESS': '1'})


@pytest.fixture(scope='module')
def capsnet_workdir(tmp_path_factory):
  from experiments.configs import capsnet_mnist
  config = capsnet_mnist.get_config('smoke')
  config.num_train_steps = 4
  config.validation_size = 200
  config.eval_every_steps = 4
  config.checkpoint_every_steps = 4
  config.log_every_steps = 2
  config.batch_size = 16
  # Smaller than the smoke model still: the figures, not the accuracy, count.
  config.model_options.conv1_channels = 8
  config.model_options.primary_types = 4
  # The first 400 training and 100 test digits: the figures read their
  # images from the workdir's data_dir.
  config.data_dir = conftest.write_mnist_subset(
      tmp_path_factory.mktemp('mnist'), 400, 100)
  workdir = str(tmp_path_factory.mktemp('capsnet_workdir'))
  vector_capsules.train_and_evaluate(config, workdir)
  return workdir


@needs_mnist
@pytest.mark.slow
def test_capsnet_figures_cli(capsnet_workdir, tmp_path):
  output_dir = tmp_path / 'figs'
  result = _run('experiments.capsnet_figures', f'--workdir={capsnet_workdir}',
                f'--output_dir={output_dir}', '--num_images=5')
  assert result.returncode == 0, result.stdout + result.stderr
  for name in ('reconstructions.png', 'perturbation.png'):
    path = output_dir / name
    assert str(path) in result.stdout
    _check_png(path)


@needs_mnist
@pytest.mark.slow
def test_routing_pictures_cli(capsnet_workdir):
  result = _run('experiments.routing_pictures', f'--workdir={capsnet_workdir}',
                '--index=3', '--which=latest')
  assert result.returncode == 0, result.stdout + result.stderr
  path = os.path.join(capsnet_workdir, 'figures', 'routing.png')
  assert path in result.stdout
  _check_png(path)


# One path in the launcher for both commands (the other one's in the slow
# tier).
@pytest.mark.parametrize('module', unit_tier_keeps(
    ['experiments.capsnet_figures', 'experiments.routing_pictures'],
    'experiments.capsnet_figures'))
def test_cli_missing_workdir_is_a_clean_error(module, tmp_path):
  result = _run(module, f'--workdir={tmp_path / "nothing"}')
  output = result.stdout + result.stderr
  assert result.returncode == 2, output
  assert 'error' in output and 'not a capsjax workdir' in output
  assert 'Traceback' not in output


def test_cli_help_lists_every_flag():
  result = _run('experiments.capsnet_figures', '--help')
  assert 'Traceback' not in result.stderr, result.stderr
  for flag in ('workdir', 'output_dir', 'num_images', 'perturbation_index',
               'data_dir', 'which'):
    assert f'--{flag}' in result.stdout, flag


def test_pair_predictions_figure(tmp_path):
  rng = np.random.default_rng(0)
  images = rng.uniform(size=(5, 28, 56, 1)).astype(np.float32)
  labels = np.array([[1, 2], [3, 4], [5, 6], [7, 8], [9, 0]])
  scores = {'baseline': rng.uniform(size=(5, 10)),
            'capsnet': rng.uniform(size=(5, 10))}
  path = tmp_path / 'pairs.png'
  fig = figures.pair_predictions_figure(images, labels, scores, path,
                                        columns=3)
  height, width, _ = _check_png(path)
  assert width > height
  assert len(fig.axes) == 6  # 2 rows of 3, the last one empty
  # One line per model under each image, naming its two top classes.
  texts = [t.get_text() for t in fig.axes[0].texts]
  top = np.argsort(-scores['capsnet'][0])[:2]
  assert len(texts) == 2 and texts[1].startswith(f'capsnet: {top[0]} (')
  with pytest.raises(ValueError, match='labels'):
    figures.pair_predictions_figure(images, labels[:2], scores)
  with pytest.raises(ValueError, match='scores of'):
    figures.pair_predictions_figure(images, labels, {'x': np.zeros((4, 10))})


def test_attack_accuracy_figure(tmp_path):
  path = tmp_path / 'attacks.png'
  accuracies = {'fgsm': {'a': [0.9, 0.5, 0.1], 'b': [0.95, 0.8, 0.6]},
                'bim': {'a': [0.9, 0.2, 0.0], 'b': [0.95, 0.6, 0.3]}}
  fig = figures.attack_accuracy_figure([0.0, 0.1, 0.3], accuracies, path,
                                       title='t')
  _check_png(path)
  assert [ax.get_title() for ax in fig.axes] == ['FGSM', 'BIM']
  np.testing.assert_allclose(fig.axes[1].lines[0].get_ydata(), [90, 20, 0])
  with pytest.raises(ValueError, match='3 epsilons'):
    figures.attack_accuracy_figure([0.0, 0.1, 0.3], {'fgsm': {'a': [1.0]}})
  with pytest.raises(ValueError, match='no attack'):
    figures.attack_accuracy_figure([0.0], {})


@pytest.mark.parametrize('shape', [(56, 28), (28, 56)])
def test_pair_predictions_lines_stay_above_the_next_row(shape):
  """Each model's score line under a pair, in either layout, ends above the
  title of the pair below it (stacked pairs once overlapped it)."""
  rng = np.random.default_rng(0)
  images = rng.uniform(size=(4, *shape, 1)).astype(np.float32)
  labels = np.array([[1, 2], [3, 4], [5, 6], [7, 8]])
  scores = {'baseline': rng.uniform(size=(4, 10)),
            'capsnet': rng.uniform(size=(4, 10))}
  fig = figures.pair_predictions_figure(images, labels, scores, columns=2)
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  canvas = FigureCanvasAgg(fig)
  canvas.draw()
  renderer = canvas.get_renderer()
  top, below = fig.axes[0], fig.axes[2]  # the same column, rows 1 and 2
  lowest_line = min(t.get_window_extent(renderer).y0 for t in top.texts)
  title = below.title.get_window_extent(renderer)
  assert lowest_line > title.y1, (lowest_line, title)
  assert top.get_window_extent(renderer).y0 > max(
      t.get_window_extent(renderer).y1 for t in top.texts)
