"""The MultiMNIST and affNIST experiments of Sabour et al. 2017.

    summary = sabour_experiments.run_multimnist(config, workdir)
    summary = sabour_experiments.run_affnist(config, workdir)

``run_multimnist`` (section 6) trains one model on MultiMNIST with
``train_dynamic`` and writes ``multimnist_summary.json`` and, for a CapsNet,
``multimnist_reconstructions.png`` (the paper's Fig. 5: inputs, and the
digits decoded from the two longest capsules in red and green).

``run_affnist`` (section 5.2) trains a CapsNet and then a CNN on MNIST digits
placed at random on a 40x40 canvas, the CNN stopped at the CapsNet's
validation accuracy, tests both on affNIST-like transformed MNIST test
digits (and the real affNIST test set when given), and writes
``affnist_summary.json`` and ``affnist_examples.png``.

Shape legend: N examples, S the canvas side (36 MultiMNIST, 40 affNIST),
K classes.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from capsjax import data as data_lib
from capsjax import train_dynamic
from capsjax import train_lib
from capsjax.data.affnist import IMAGE_SIZE as AFFNIST_SIZE

# Test errors the paper reports (mean of 3 runs; section 6 and 5.2).
PAPER_MULTIMNIST_ERROR = {'capsnet': 0.052, 'baseline_cnn': 0.081}
PAPER_AFFNIST_ACCURACY = {'capsnet': 0.79, 'baseline_cnn': 0.66}
PAPER_EXPANDED_MNIST_ACCURACY = {'capsnet': 0.9923, 'baseline_cnn': 0.9922}


def _error(record: dict[str, Any] | None) -> float | None:
  return None if not record else record.get('error')


# ----------------------------------------------------------------------------
# MultiMNIST.


@nnx.jit
def _two_longest_reconstructions(model: nnx.Module, images: jax.Array
                                 ) -> tuple[jax.Array, jax.Array]:
  """[N, K] lengths and [N, 2, S*S] digits decoded from the two longest
  capsules (longest first), as at test time in the paper's Fig. 5."""
  out = model(images, train=False)
  _, top2 = jax.lax.top_k(out['lengths'], 2)
  return out['lengths'], model.reconstruct_digits(out['capsules'], top2)


def two_colour(reconstructions: ArrayLike) -> np.ndarray:
  """[N, 2, S, S] -> RGB [N, S, S, 3]: the first digit red, the second green
  (where they overlap: yellow)."""
  r = np.asarray(reconstructions, np.float32)
  return np.clip(np.stack([r[:, 0], r[:, 1], np.zeros_like(r[:, 0])], -1),
                 0.0, 1.0)


def multimnist_figure(images: ArrayLike, reconstructions: ArrayLike,
                      labels: ArrayLike, predictions: ArrayLike,
                      path: str | os.PathLike | None = None):
  """Inputs above their two reconstructions in two colours (paper Fig. 5).

  Args:
    images: [N, S, S, 1] float in [0, 1].
    reconstructions: [N, 2, S*S] (or [N, 2, S, S]): the digits of
      ``predictions[:, 0]`` (red) and ``predictions[:, 1]`` (green).
    labels, predictions: int [N, 2]; titles "L:(a,b)" and "R:(a,b)", the
      latter highlighted when the pair is not the true pair.
    path: PNG to write (None: do not write).
  Returns:
    The matplotlib figure.
  """
  from matplotlib.figure import Figure
  images = np.asarray(images, np.float32)
  if images.ndim != 4 or images.shape[-1] != 1:
    raise ValueError(f'images must be [N, S, S, 1], got {images.shape}.')
  n, size = images.shape[0], images.shape[1]
  reconstructions = np.asarray(reconstructions, np.float32)
  if reconstructions.size != n * 2 * size * size:
    raise ValueError(f'reconstructions {reconstructions.shape} are not two '
                     f'{size}x{size} digits for each of {n} images.')
  colour = two_colour(reconstructions.reshape(n, 2, size, size))
  labels, predictions = np.asarray(labels), np.asarray(predictions)
  fig = Figure(figsize=(max(2.5, 1.3 * n), 3.2), dpi=100)
  axes = fig.subplots(2, n, squeeze=False)
  for i in range(n):
    axes[0, i].imshow(images[i, ..., 0], cmap='gray', vmin=0.0, vmax=1.0)
    axes[1, i].imshow(colour[i])
    wrong = set(predictions[i].tolist()) != set(labels[i].tolist())
    axes[0, i].set_title('L:({},{})'.format(*labels[i]), fontsize=8)
    axes[1, i].set_title('R:({},{})'.format(*predictions[i]), fontsize=8,
                         color='tab:red' if wrong else 'black')
    for ax in axes[:, i]:
      ax.set_xticks([])
      ax.set_yticks([])
  axes[0, 0].set_ylabel('input', fontsize=9)
  axes[1, 0].set_ylabel('red, green', fontsize=9)
  fig.subplots_adjust(left=0.06, right=0.99, bottom=0.02, top=0.88,
                      wspace=0.08, hspace=0.3)
  if path is not None:
    fig.savefig(path, facecolor='white', bbox_inches='tight', pad_inches=0.1)
  return fig


def write_multimnist_figure(workdir: str, config: ml_collections.ConfigDict
                            ) -> str:
  """The figure of the model selected in ``workdir`` on the first test pairs.

  The first ``num_figure_examples`` pairs of the test set (the pair sets are
  generated in chunks, so a smaller set with the same key starts alike).
  """
  mnist = data_lib.load_dataset('mnist', data_dir=config.data_dir or None,
                                validation_size=0)
  pairs = data_lib.multimnist_test_set(
      mnist.test.images, mnist.test.labels, config.num_figure_examples,
      config.eval_set_seed + 1, max_shift=config.max_shift)
  model = train_lib.load_trained_model(workdir)
  lengths, reconstructions = _two_longest_reconstructions(
      model, jnp.asarray(pairs['image']))
  predictions = np.asarray(jax.lax.top_k(lengths, 2)[1])
  path = os.path.join(workdir, 'multimnist_reconstructions.png')
  multimnist_figure(pairs['image'], reconstructions, pairs['labels'],
                    predictions, path)
  return path


def run_multimnist(config: ml_collections.ConfigDict, workdir: str
                   ) -> dict[str, Any]:
  """Train on MultiMNIST, draw the figure, write multimnist_summary.json."""
  if config.dataset != 'multimnist':
    raise ValueError(f"config.dataset must be 'multimnist', got "
                     f'{config.dataset!r}.')
  summary = train_dynamic.train_and_evaluate(config, workdir)
  figure = None
  if config.model == 'capsnet' and config.model_options.get(
      'reconstruction', True) and config.num_figure_examples:
    figure = write_multimnist_figure(workdir, config)
  record = {
      'experiment': 'MultiMNIST (Sabour et al. 2017, section 6)',
      'metric': 'an example is correct when the two highest scores are the '
                'two true classes',
      'model': config.model,
      'num_params': summary['num_params'],
      'steps': summary['steps'],
      'batch_size': summary['batch_size'],
      'train_wall_s_this_run': summary['train_wall_s_this_run'],
      'validation_pairs': config.validation_pairs,
      'test_pairs': config.test_pairs,
      'validation_error': _error(summary['validation']),
      'test_error': _error(summary['test']),
      'paper_test_error': PAPER_MULTIMNIST_ERROR.get(config.model),
      'figure': figure,
      'device': summary['device'],
      'git_commit': summary['git_commit'],
  }
  train_lib.write_json_atomic(os.path.join(workdir, 'multimnist_summary.json'),
                              record)
  return record


# ----------------------------------------------------------------------------
# affNIST.


def affnist_tests(config: ml_collections.ConfigDict
                  ) -> dict[str, data_lib.Split]:
  """'affine_mnist' (always) and 'affnist' (with ``config.affnist_dir``)."""
  tests = {}
  if config.affnist_dir:  # First: a wrong path fails before any work.
    tests['affnist'] = data_lib.load_affnist(config.affnist_dir, split='test')
  mnist = data_lib.load_dataset('mnist', data_dir=config.data_dir or None,
                                validation_size=0)
  size = min(config.affine_test_size, len(mnist.test.labels))
  tests['affine_mnist'] = data_lib.Split(
      data_lib.affine_mnist(mnist.test.images[:size], config.affine_seed),
      mnist.test.labels[:size])
  return tests


def _run_config(config: ml_collections.ConfigDict,
                run: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  run = copy.deepcopy(run)
  if config.data_dir:
    run.data_dir = config.data_dir
  if run.get('canvas_size') != AFFNIST_SIZE:
    raise ValueError(f'the affNIST runs train on a {AFFNIST_SIZE}x'
                     f'{AFFNIST_SIZE} canvas; got canvas_size '
                     f'{run.get("canvas_size")}.')
  return run


@nnx.jit
def _scores(model: nnx.Module, images: jax.Array) -> jax.Array:
  return train_dynamic.class_scores(model(images, train=False))


def affnist_figure(images: ArrayLike, labels: ArrayLike,
                   predictions: dict[str, ArrayLike],
                   path: str | os.PathLike | None = None):
  """Transformed test digits, titled with each model's prediction.

  Args:
    images: [N, 40, 40, 1] uint8 or float in [0, 1].
    labels: int [N].
    predictions: model name -> int [N]; a wrong prediction in red.
  """
  from matplotlib.figure import Figure
  images = np.asarray(images)
  if np.issubdtype(images.dtype, np.integer):
    images = images.astype(np.float32) / 255.0
  n = images.shape[0]
  fig = Figure(figsize=(max(2.5, 1.3 * n), 1.9 + 0.3 * len(predictions)),
               dpi=100)
  axes = fig.subplots(1, n, squeeze=False)[0]
  for i, ax in enumerate(axes):
    ax.imshow(images[i, ..., 0], cmap='gray', vmin=0.0, vmax=1.0)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(f'label {int(labels[i])}', fontsize=8)
    lines = []
    for name, pred in predictions.items():
      pred = int(np.asarray(pred)[i])
      lines.append((f'{name}: {pred}', pred != int(labels[i])))
    for j, (text, wrong) in enumerate(lines):
      ax.text(0.5, -0.08 - 0.16 * j, text, transform=ax.transAxes,
              ha='center', va='top', fontsize=7,
              color='tab:red' if wrong else 'black')
  if path is not None:
    fig.savefig(path, facecolor='white', bbox_inches='tight', pad_inches=0.1)
  return fig


def run_affnist(config: ml_collections.ConfigDict, workdir: str
                ) -> dict[str, Any]:
  """Train both models, test on affNIST, write the summary and the figure."""
  workdir = os.path.abspath(workdir)
  names = ('capsnet', 'baseline_cnn')
  runs = {'capsnet': _run_config(config, config.capsnet),
          'baseline_cnn': _run_config(config, config.baseline)}
  tests = affnist_tests(config)
  summaries = {}
  for name in names:
    run = runs[name]
    if name == 'baseline_cnn' and config.match_capsnet:
      if not summaries['capsnet']['validation']:
        raise ValueError('match_capsnet needs a validation split: set '
                         'capsnet.validation_size > 0 (or match_capsnet='
                         'False).')
      run.target_accuracy = summaries['capsnet']['validation']['accuracy']
    print(f'--- {name} ({run.model}) on MNIST digits placed at random on '
          f'{run.canvas_size}x{run.canvas_size} ---', flush=True)
    summaries[name] = train_dynamic.train_and_evaluate(
        run, os.path.join(workdir, name), extra_tests=tests)

  count = min(config.num_figure_examples, len(tests['affine_mnist'].labels))
  examples = tests['affine_mnist'].images[:count]
  predictions = {}
  for name in names:
    model = train_lib.load_trained_model(os.path.join(workdir, name))
    scores = _scores(model, data_lib.to_float(examples))
    predictions[name] = np.asarray(jnp.argmax(scores, -1))
  figure = os.path.join(workdir, 'affnist_examples.png')
  if count:
    affnist_figure(examples, tests['affine_mnist'].labels[:count],
                   predictions, figure)

  models = {}
  for name in names:
    s = summaries[name]
    extra = s['extra_tests']
    models[name] = {
        'model': s['model'],
        'num_params': s['num_params'],
        'steps': s['steps'],
        'selected_step': s['selected_step'],
        'batch_size': s['batch_size'],
        'target_accuracy': s.get('target_accuracy'),
        'reached_target': s.get('reached_target'),
        'train_wall_s_this_run': s['train_wall_s_this_run'],
        'expanded_mnist_validation_accuracy': (s['validation'] or {}).get(
            'accuracy'),
        'expanded_mnist_test_accuracy': s['test'].get('accuracy'),
        'affine_mnist_accuracy': extra['affine_mnist'].get('accuracy'),
        'affnist_accuracy': extra.get('affnist', {}).get('accuracy'),
        'paper_expanded_mnist_test_accuracy':
            PAPER_EXPANDED_MNIST_ACCURACY[name],
        'paper_affnist_accuracy': PAPER_AFFNIST_ACCURACY[name],
    }
  record = {
      'experiment': 'affNIST generalisation (Sabour et al. 2017, section 5.2)',
      'training_data': 'MNIST training digits (minus validation) placed at '
                       'random on a 40x40 black canvas',
      'stopping': ('the CNN stops at the first validation evaluation at or '
                   "above the CapsNet's best validation accuracy"
                   if config.match_capsnet else 'both train all steps'),
      'affine_mnist': {'size': len(tests['affine_mnist'].labels),
                       'seed': config.affine_seed},
      'affnist_dir': config.affnist_dir or None,
      'models': models,
      'figure': figure if count else None,
      'device': summaries['capsnet']['device'],
      'git_commit': summaries['capsnet']['git_commit'],
  }
  train_lib.write_json_atomic(os.path.join(workdir, 'affnist_summary.json'),
                              record)
  return record
