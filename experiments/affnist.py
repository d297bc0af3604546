"""Train CapsNet and a CNN on digits placed on 40x40, test both on affNIST.

  python -m experiments.affnist --workdir=/tmp/affnist \\
      --config=experiments/configs/capsnet_affnist.py[:smoke|:cpu] \\
      [--config.affnist_dir=/path/to/affNIST]

Sabour et al. 2017, section 5.2. The CapsNet trains in WORKDIR/capsnet, then
the CNN in WORKDIR/baseline_cnn stops at the CapsNet's validation accuracy;
both are tested on expanded MNIST, on affNIST-like transformed MNIST test
digits and, with --config.affnist_dir, on the real affNIST test set (the
``affine`` evaluator). Rerunning with the same --workdir resumes. Writes
WORKDIR/affnist_summary.json and WORKDIR/affnist_examples.png.
"""

import copy
import os
from typing import Any

import ml_collections
import numpy as np

from experiments import launcher

# Accuracies the paper reports (section 5.2).
PAPER_AFFNIST_ACCURACY = {'capsnet': 0.79, 'baseline_cnn': 0.66}
PAPER_EXPANDED_MNIST_ACCURACY = {'capsnet': 0.9923, 'baseline_cnn': 0.9922}
_NAMES = ('capsnet', 'baseline_cnn')


def affine_evals(config: ml_collections.ConfigDict) -> dict[str, dict]:
  """The test sets of both runs: 'affine_mnist' always, 'affnist' with
  ``config.affnist_dir``."""
  evals = {'affine_mnist': dict(type='affine', source='affine_mnist',
                                size=config.affine_test_size,
                                seed=config.affine_seed)}
  if config.affnist_dir:
    evals['affnist'] = dict(type='affine', source='affnist',
                            directory=config.affnist_dir)
  return evals


def run_config(config: ml_collections.ConfigDict,
               run: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """One model's training config: its own keys, the shared data directory
  and the affine test sets."""
  from capsjax.data.affnist import IMAGE_SIZE as AFFNIST_SIZE  # after flags
  run = copy.deepcopy(run)
  if config.data_dir:
    run.data_dir = config.data_dir
  if run.get('canvas_size') != AFFNIST_SIZE:
    raise ValueError(f'the affNIST runs train on a {AFFNIST_SIZE}x'
                     f'{AFFNIST_SIZE} canvas; got canvas_size '
                     f'{run.get("canvas_size")}.')
  with run.unlocked():
    run.evals = affine_evals(config)
  return run


def reach_accuracy(target: float):
  """``loop.fit``'s ``stop_when``: stop at the first best validation
  accuracy >= ``target``, in (0, 1]."""
  if not 0 < target <= 1:
    raise ValueError(f'the target accuracy must be in (0, 1], got {target!r}.')

  def stop_when(record: dict[str, Any]) -> str | None:
    if record['accuracy'] < target:
      return None
    return (f'Validation accuracy {record["accuracy"]:.4f} reached the target '
            f'{target}')

  return stop_when


def _model_record(name: str, summary: dict[str, Any],
                  target: float | None) -> dict[str, Any]:
  evals = summary['evals']
  return {
      'model': summary['model'],
      'num_params': summary['num_params'],
      'steps': summary['steps'],
      'selected_step': summary['selected_step'],
      'batch_size': summary['batch_size'],
      'target_accuracy': target,
      'reached_target': summary.get('stopped_early'),
      'train_wall_s_this_run': summary['train_wall_s_this_run'],
      'expanded_mnist_validation_accuracy': (summary['validation'] or {}).get(
          'accuracy'),
      'expanded_mnist_test_accuracy': summary['test'].get('accuracy'),
      'affine_mnist_accuracy': evals['affine_mnist'].get('accuracy'),
      'affnist_accuracy': evals.get('affnist', {}).get('accuracy'),
      'paper_expanded_mnist_test_accuracy': PAPER_EXPANDED_MNIST_ACCURACY[name],
      'paper_affnist_accuracy': PAPER_AFFNIST_ACCURACY[name],
  }


def run_affnist(config: ml_collections.ConfigDict, workdir: str
                ) -> dict[str, Any]:
  """Train both models, test on affNIST, write the summary and the figure."""
  from flax import nnx  # imports jax: after the flags

  from capsjax import data as data_lib
  from capsjax import figures
  from capsjax import training
  from capsjax.evaluators import affine
  scores_of = nnx.jit(lambda model, images: model(images, train=False)[
      'class_scores'])
  workdir = os.path.abspath(workdir)
  runs = {'capsnet': run_config(config, config.capsnet),
          'baseline_cnn': run_config(config, config.baseline)}
  summaries, targets = {}, {name: None for name in _NAMES}
  for name in _NAMES:
    run = runs[name]
    fit_options = {}
    if name == 'baseline_cnn' and config.match_capsnet:
      if not summaries['capsnet']['validation']:
        raise ValueError('match_capsnet needs a validation split: set '
                         'capsnet.validation_size > 0 (or match_capsnet='
                         'False).')
      # An accuracy of 0 is no target: the CNN trains all its steps.
      targets[name] = summaries['capsnet']['validation']['accuracy'] or None
      if targets[name]:
        fit_options['stop_when'] = reach_accuracy(targets[name])
    print(f'--- {name} ({run.model}) on MNIST digits placed at random on '
          f'{run.canvas_size}x{run.canvas_size} ---', flush=True)
    summaries[name] = training.train(run, os.path.join(workdir, name),
                                     **fit_options)

  examples = affine.test_split(runs['capsnet'], size=config.affine_test_size,
                               seed=config.affine_seed)
  count = min(config.num_figure_examples, len(examples.labels))
  figure = os.path.join(workdir, 'affnist_examples.png')
  if count:
    predictions = {}
    for name in _NAMES:
      model = training.load_trained_model(os.path.join(workdir, name))
      scores = scores_of(model, data_lib.to_float(examples.images[:count]))
      predictions[name] = np.asarray(scores).argmax(-1)
    figures.affnist_figure(examples.images[:count], examples.labels[:count],
                           predictions, figure)

  record = {
      'experiment': 'affNIST generalisation (Sabour et al. 2017, section 5.2)',
      'training_data': 'MNIST training digits (minus validation) placed at '
                       'random on a 40x40 black canvas',
      'stopping': ('the CNN stops at the first validation evaluation at or '
                   "above the CapsNet's best validation accuracy"
                   if config.match_capsnet else 'both train all steps'),
      'affine_mnist': {'size': len(examples.labels),
                       'seed': config.affine_seed},
      'affnist_dir': config.affnist_dir or None,
      'models': {name: _model_record(name, summaries[name], targets[name])
                 for name in _NAMES},
      'figure': figure if count else None,
      'device': summaries['capsnet']['device'],
      'git_commit': summaries['capsnet']['git_commit'],
  }
  training.write_json_atomic(
      os.path.join(workdir, 'affnist_summary.json'), record)
  return record


if __name__ == '__main__':
  launcher.run(run_affnist, 'capsnet_affnist.py')
