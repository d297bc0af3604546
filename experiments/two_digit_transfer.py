"""Su's two-digit transfer test: train on single digits, name two at once.

  python -m experiments.two_digit_transfer --workdir=/tmp/two_digit \\
      --config=experiments/configs/two_digit_transfer.py[:smoke]

Trains each run of ``config.models`` (Su's pooling baseline, his capsule
model with each of his two routings) on single MNIST digits, each in
WORKDIR/<run> and resumable, then shows them pairs of different test digits:
stacked (56x28, Su's protocol) and side by side (28x56, harder), the same
pairs. Writes WORKDIR/summary.json (per run: normal test accuracy; accuracy
1: the two highest scores are the two digits; accuracy 2: the same and both
scores > 0.5; the same under 'side_by_side'; Su's numbers beside them; how
many receptive fields of the trunk see no ink in each layout) and
WORKDIR/pairs.png, pairs_side_by_side.png. Config keys: see the config
file's docstring.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING
from typing import Any

import ml_collections

from experiments import launcher

if TYPE_CHECKING:
  from capsjax import data as data_lib

# Su's numbers (his capsule post and bojone/Capsule): normal MNIST test accuracy,
# accuracy 1 and 2 on stacked pairs.
REPORTED = {
    'two_digit_baseline': {'test_accuracy': 'about 0.993', 'top2': 'about 0.40',
                           'top2_confident': 'about 0.10'},
    'two_digit_capsnet': {'test_accuracy': 'about 0.993',
                          'top2': 'about 0.95',
                          'top2_confident': 'not reported'},
    'two_digit_capsnet_blog_routing': {
        'test_accuracy': 'about 0.993', 'top2': 'about 0.91',
        'top2_confident': 'above 0.90'},
}
_EVALS = {'pairs': 'stacked', 'side_by_side': 'side_by_side'}


def run_config(config: ml_collections.ConfigDict, name: str,
               num_train_digits: int) -> ml_collections.ConfigDict:
  """The training config of run ``name``: shared keys + ``runs.<name>``.

  Its steps are ``runs.<name>.num_train_steps`` or, when that is 0,
  ``num_epochs`` passes over ``num_train_digits`` at ``batch_size``.
  """
  run = config.runs[name]
  out = ml_collections.ConfigDict(config.to_dict())
  out.model = run.model
  out.model_options.update(run.model_options)
  out.num_train_steps = run.num_train_steps or math.ceil(
      run.num_epochs * num_train_digits / config.batch_size)
  return out


def _check_config(config: ml_collections.ConfigDict) -> None:
  if not config.models or any(name not in config.runs
                              for name in config.models):
    raise ValueError(f'config.models must be a non-empty tuple of names in '
                     f'config.runs {tuple(config.runs)}, got '
                     f'{tuple(config.models)}.')
  for name in config.models:
    run = config.runs[name]
    if not (run.get('num_train_steps') or 0) > 0 and not (
        run.get('num_epochs') or 0) > 0:
      raise ValueError(f'config.runs.{name} needs num_epochs > 0 or '
                       f'num_train_steps > 0.')
  missing = [key for key in _EVALS if key not in config.evals]
  if missing:
    raise ValueError(f"config.evals.{missing[0]} (type='two_digit_transfer') is "
                     f'a test of this experiment; it is missing.')


def _pair_record(result: dict[str, Any]) -> dict[str, Any]:
  return {'pair_top2_accuracy': result['top2'],
          'pair_top2_confident_accuracy': result['top2_confident'],
          'num_pairs': result['num_pairs'], 'pair_eval_s': result['eval_s']}


def _run_record(run: dict[str, Any]) -> dict[str, Any]:
  return {
      'model': run['model'],
      'num_params': run['num_params'],
      'test_accuracy': run['test']['accuracy'],
      'validation_accuracy': (run['validation'] or {}).get('accuracy'),
      'steps': run['steps'],
      'epochs': run['epochs'],
      'selected_step': run['selected_step'],
      'train_wall_s_this_run': run['train_wall_s_this_run'],
      'train_images_per_s': run['train_images_per_s'],
      **_pair_record(run['evals']['pairs']),
      'side_by_side': _pair_record(run['evals']['side_by_side']),
  }


def blank_field_counts(test: data_lib.Split, seed: int) -> dict[str, Any]:
  """Per layout: mean blank windows of Su's trunk per pair image and the
  fraction of pairs with at least one (``data.blank_fields``)."""
  from capsjax import data as data_lib  # imports jax: after the flags
  out = {}
  for layout in data_lib.PAIR_LAYOUTS:
    pairs = data_lib.digit_pairs(test.images, test.labels, seed, layout)
    blank = data_lib.blank_fields(pairs['image']).reshape(len(pairs['image']),
                                                          -1)
    out[layout] = {'mean_per_pair': float(blank.sum(1).mean()),
                   'fraction_of_pairs': float(blank.any(1).mean())}
  return out


def _figures(config, workdir: str, test: data_lib.Split, seed: int
             ) -> dict[str, str]:
  """The first ``figure_pairs`` pairs in each layout, each run's top two
  scores under them, blank windows dotted."""
  from capsjax import data as data_lib  # imports jax: after the flags
  from capsjax import figures
  from capsjax import training
  from capsjax.evaluators import two_digit_transfer
  trained = {name: training.load_trained_model(os.path.join(workdir, name))
             for name in config.models}
  paths = {}
  for key, layout in _EVALS.items():
    shown = two_digit_transfer.test_pairs(test, seed, config.figure_pairs, layout)
    scores = {name.removeprefix('two_digit_'):
              two_digit_transfer.predict_scores(model, shown['image'])
              for name, model in trained.items()}
    paths[layout] = os.path.join(
        workdir, 'pairs.png' if layout == 'stacked' else f'pairs_{layout}.png')
    figures.pair_predictions_figure(
        data_lib.to_float(shown['image']), shown['labels'], scores,
        paths[layout], threshold=config.evals[key].confidence_threshold,
        blank=data_lib.blank_fields(shown['image']))
  return paths


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str
                       ) -> dict[str, Any]:
  """Train each run of ``config.models`` on single digits, test on pairs.

  Each run trains in ``workdir/<run>`` (resumable; its summary.json has the
  pair accuracies under 'evals'). Writes ``workdir/summary.json`` and the
  pair figures; returns the summary.
  """
  from capsjax import data as data_lib  # imports jax: after the flags
  from capsjax import training
  _check_config(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  dataset = data_lib.load_dataset(config.dataset,
                                  data_dir=config.data_dir or None,
                                  validation_size=config.validation_size)
  results = {}
  for name in config.models:
    run = training.train(run_config(config, name, len(dataset.train.labels)),
                         os.path.join(workdir, name))
    results[name] = record = _run_record(run)
    side = record['side_by_side']
    print(f'{name}: test accuracy {record["test_accuracy"]:.4f}; stacked '
          f'pairs {record["pair_top2_accuracy"]:.4f} / '
          f'{record["pair_top2_confident_accuracy"]:.4f}; side by side '
          f'{side["pair_top2_accuracy"]:.4f} / '
          f'{side["pair_top2_confident_accuracy"]:.4f}', flush=True)

  seed = config.evals.pairs.get('seed')
  seed = config.seed if seed is None else seed
  summary = {
      'experiment': 'two_digit_transfer',
      'models': results,
      'reported': {name: REPORTED[name] for name in config.models
                   if name in REPORTED},
      'num_pairs': results[config.models[-1]]['num_pairs'],
      'pair_seed': seed,
      'confidence_threshold': config.evals.pairs.confidence_threshold,
      'train_digits': len(dataset.train.labels),
      'blank_fields': blank_field_counts(dataset.test, seed),
      'figures': (_figures(config, workdir, dataset.test, seed)
                  if config.figure_pairs else {}),
      **training.environment(),
  }
  training.write_json_atomic(os.path.join(workdir, 'summary.json'), summary)
  return summary


if __name__ == '__main__':
  launcher.run(train_and_evaluate, 'two_digit_transfer.py')
