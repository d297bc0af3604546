"""White-box FGSM and BIM attacks on trained models (Hinton et al. 2018).

  python -m experiments.adversarial --workdir=/tmp/adversarial \\
      --models=/tmp/capsnet,/tmp/cnn,/tmp/em \\
      [--config=experiments/configs/adversarial.py[:smoke]]

Loads each --models workdir's model (the checkpoint selected on validation),
attacks the first config.num_examples test images at every epsilon (the
``adversarial`` evaluator), and writes WORKDIR/summary.json (clean accuracy and
accuracy per attack and epsilon, for every model) and
WORKDIR/accuracy_vs_epsilon.png. The :smoke config trains tiny models itself
and needs no --models. Keys (epsilons, attacks, bim_step_size, bim_steps,
loss, num_examples, ...): see the config file's docstring; override them
with --config.KEY=VALUE.

It holds WORKDIR as a training run does, and reads each --models workdir
under a shared hold: a model whose training still runs is refused, in one
line naming that run.
"""

import json
import os
from collections.abc import Sequence
from typing import Any

import ml_collections
from absl import flags

from experiments import launcher

_MODELS = flags.DEFINE_list(
    'models', [], 'Comma-separated workdirs of trained models to attack '
    '(capsnet, baseline_cnn, matrix_capsnet, ... on MNIST or Fashion-MNIST).')

# The config keys that are the adversarial evaluator's options.
ATTACK_OPTIONS = ('epsilons', 'attacks', 'loss', 'bim_step_size', 'bim_steps',
                  'num_examples', 'batch_size')


def attack_options(config: ml_collections.ConfigDict) -> dict[str, Any]:
  return {key: config[key] for key in ATTACK_OPTIONS}


def attack_workdir(config: ml_collections.ConfigDict, model_workdir: str
                   ) -> dict[str, Any]:
  """Attack the model trained in ``model_workdir``; one row of the summary."""
  from capsjax import training  # imports jax: after the flags
  from capsjax.evaluators import adversarial as adversarial_evaluator
  context = training.load_context(model_workdir,
                                  data_dir=config.data_dir or None)
  row = adversarial_evaluator.evaluate(context, **attack_options(config))  # checks too
  summary_path = os.path.join(model_workdir, 'summary.json')
  trained = json.load(open(summary_path)) if os.path.exists(
      summary_path) else {}
  return {
      'workdir': os.path.abspath(model_workdir),
      'model': context.config.model,
      'dataset': context.config.dataset,
      'num_params': trained.get('num_params'),
      'test_accuracy_full_test_set': (trained.get('test') or {}).get(
          'accuracy'),
      **row,
  }


def _names(rows: Sequence[dict[str, Any]]) -> list[str]:
  names = [row['model'] for row in rows]
  return [f'{n} ({os.path.basename(row["workdir"])})' if names.count(n) > 1
          else n for n, row in zip(names, rows, strict=True)]


def run(config: ml_collections.ConfigDict, workdir: str,
        model_workdirs: Sequence[str] = ()) -> dict[str, Any]:
  """Train ``config.train``, attack it and ``model_workdirs``; summarise."""
  from capsjax import figures  # imports jax: after the flags
  from capsjax import training
  from capsjax.evaluators import adversarial as adversarial_evaluator
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  for train_config in config.train.values():  # the attacks' data, unless set
    if config.data_dir and not train_config.data_dir:
      train_config.data_dir = config.data_dir
  for path in model_workdirs:  # fail before training anything
    adversarial_evaluator.check(training.read_workdir_config(path),
                                **attack_options(config))
  for train_config in config.train.values():
    adversarial_evaluator.check(train_config, **attack_options(config))
  trained = [os.path.join(workdir, 'train', name) for name in config.train]
  for path, train_config in zip(trained, config.train.values(), strict=True):
    training.train(train_config, path)
  workdirs = list(model_workdirs) + trained
  if not workdirs:
    raise ValueError('no models to attack: pass --models=WORKDIR[,WORKDIR...] '
                     'of trained runs, or a config that trains some (:smoke).')
  rows = []
  for path in workdirs:
    print(f'Attacking the model in {path} ...', flush=True)
    rows.append(attack_workdir(config, path))
  names = _names(rows)
  for name, row in zip(names, rows, strict=True):
    cells = '  '.join(f'{a} ' + ' '.join(f'{x:.3f}' for x in row[a])
                      for a in config.attacks)
    print(f'{name}: clean {row["clean_accuracy"]:.4f}; {cells} (epsilons '
          f'{tuple(config.epsilons)}; {row["attack_wall_s"]:.0f} s)',
          flush=True)
  figure_path = os.path.join(workdir, 'accuracy_vs_epsilon.png')
  figures.attack_accuracy_figure(
      config.epsilons,
      {a: {n: r[a] for n, r in zip(names, rows, strict=True)}
       for a in config.attacks},
      figure_path,
      title=f'{config.num_examples or "all"} test images; BIM '
            f'{config.bim_steps} steps of {config.bim_step_size}')
  summary = {
      'experiment': 'adversarial',
      'epsilons': list(config.epsilons),
      'attacks': list(config.attacks),
      'loss': config.loss,
      'bim_step_size': config.bim_step_size,
      'bim_steps': config.bim_steps,
      'num_examples': config.num_examples,
      'models': dict(zip(names, rows, strict=True)),
      'figure': figure_path,
      **training.environment(),
  }
  training.write_json_atomic(os.path.join(workdir, 'summary.json'), summary)
  return summary


if __name__ == '__main__':
  launcher.run(lambda config, workdir: run(config, workdir, _MODELS.value),
               'adversarial.py', workdir_help='Directory for summary.json, '
               'accuracy_vs_epsilon.png and the models the config trains.')
