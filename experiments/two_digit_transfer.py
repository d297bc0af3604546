"""Su's two-digit transfer test: train on single digits, name two at once.

  python -m experiments.two_digit_transfer --workdir=/tmp/two_digit \\
      --config=experiments/configs/two_digit_transfer.py[:smoke]

Trains Su's pooling baseline and shared-weight capsule model on single MNIST
digits (each in WORKDIR/<model>, resumable), then shows both pairs of
different test digits side by side (28x56; the ``two_digit_pairs``
evaluator). Writes WORKDIR/summary.json (normal test accuracy; accuracy 1:
the two highest scores are the two digits; accuracy 2: the same and both
scores > 0.5; Su's numbers beside them) and WORKDIR/pairs.png. Config keys:
see the config file's docstring.
"""

import os
from typing import Any

import ml_collections

from capsjax import data as data_lib
from capsjax import figures
from capsjax import training
from capsjax.evaluators import two_digit_pairs
from experiments import launcher

# Su's numbers (seed 004): normal MNIST test accuracy, accuracy 1 and 2.
REPORTED = {
    'two_digit_baseline': {'test_accuracy': 'about 0.993', 'top2': 'about 0.40',
                           'top2_confident': 'about 0.10'},
    'two_digit_capsnet': {'test_accuracy': 'about 0.993', 'top2': 'above 0.90',
                          'top2_confident': 'above 0.90'},
}
_MODELS = tuple(REPORTED)


def model_config(config: ml_collections.ConfigDict, name: str
                 ) -> ml_collections.ConfigDict:
  """The training config of model ``name``: shared keys + its head options."""
  out = ml_collections.ConfigDict(config.to_dict())
  out.model = name
  out.model_options.update(config.head_options.get(name, {}))
  return out


def _check_config(config: ml_collections.ConfigDict) -> None:
  if not config.models or any(name not in _MODELS for name in config.models):
    raise ValueError(f'config.models must be a non-empty subset of '
                     f'{_MODELS}, got {tuple(config.models)}.')
  if 'pairs' not in config.evals:
    raise ValueError("config.evals.pairs (type='two_digit_pairs') is the "
                     'test of this experiment; it is missing.')


def _model_record(run: dict[str, Any]) -> dict[str, Any]:
  pairs = run['evals']['pairs']
  return {
      'num_params': run['num_params'],
      'test_accuracy': run['test']['accuracy'],
      'validation_accuracy': (run['validation'] or {}).get('accuracy'),
      'steps': run['steps'],
      'epochs': run['epochs'],
      'selected_step': run['selected_step'],
      'train_wall_s_this_run': run['train_wall_s_this_run'],
      'train_images_per_s': run['train_images_per_s'],
      'pair_top2_accuracy': pairs['top2'],
      'pair_top2_confident_accuracy': pairs['top2_confident'],
      'pair_eval_s': pairs['eval_s'],
  }


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str
                       ) -> dict[str, Any]:
  """Train each of ``config.models`` on single digits, test them on pairs.

  Each model trains in ``workdir/<model>`` (resumable; its summary.json has
  the pair accuracies under 'evals'). Writes ``workdir/summary.json`` and
  ``workdir/pairs.png`` (the first ``config.figure_pairs`` pairs with each
  model's two highest scores) and returns the summary.
  """
  _check_config(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  options = config.evals.pairs
  threshold = options.get('confidence_threshold', 0.5)
  results = {}
  for name in config.models:
    run = training.train(model_config(config, name),
                         os.path.join(workdir, name))
    results[name] = _model_record(run)
    print(f'{name}: test accuracy {results[name]["test_accuracy"]:.4f}; '
          f'pairs: top-2 {results[name]["pair_top2_accuracy"]:.4f}, top-2 '
          f'and both > {threshold} '
          f'{results[name]["pair_top2_confident_accuracy"]:.4f}', flush=True)

  seed = options.get('seed')
  seed = config.seed if seed is None else seed
  figure_path = None
  if config.figure_pairs:  # 0: no figure
    test = data_lib.load_dataset(
        config.dataset, data_dir=config.data_dir or None,
        validation_size=0).test
    shown = two_digit_pairs.test_pairs(test, seed, config.figure_pairs)
    scores = {
        name.removeprefix('two_digit_'): two_digit_pairs.predict_scores(
            training.load_trained_model(os.path.join(workdir, name)),
            shown['image'])
        for name in config.models}
    figure_path = os.path.join(workdir, 'pairs.png')
    figures.pair_predictions_figure(data_lib.to_float(shown['image']),
                                    shown['labels'], scores, figure_path,
                                    threshold=threshold)
  summary = {
      'experiment': 'two_digit_transfer',
      'models': results,
      'reported': {name: REPORTED[name] for name in config.models},
      'num_pairs': run['evals']['pairs']['num_pairs'],
      'pair_seed': seed,
      'confidence_threshold': threshold,
      'figure': figure_path,
      **training.environment(),
  }
  training.write_json_atomic(os.path.join(workdir, 'summary.json'), summary)
  return summary


if __name__ == '__main__':
  launcher.run(train_and_evaluate, 'two_digit_transfer.py')
