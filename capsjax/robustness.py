"""Robustness of trained models to white-box FGSM and BIM (Hinton et al. 2018).

    summary = robustness.run(config, workdir, ['/tmp/capsnet', '/tmp/em'])

Attacks each trained workdir's model (``train_lib.load_trained_model``) on the
first ``config.num_examples`` test images of the dataset it was trained on,
at every ``config.epsilons`` (pixels in [0, 1]), with the loss of
``adversarial.attack_loss`` (``config.loss``). Models listed in
``config.train`` (training configs by name) are trained first, into
``workdir/train/<name>``: the smoke variant uses that to need no workdir.
Writes ``workdir/summary.json`` (accuracy per model, attack and epsilon; clean
accuracies) and ``workdir/accuracy_vs_epsilon.png``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

import ml_collections

from capsjax import adversarial
from capsjax import data as data_lib
from capsjax import models
from capsjax import train_dynamic
from capsjax import train_em
from capsjax import train_lib

_DIGIT_DATASETS = ('mnist', 'fashion_mnist')


def check_config(config: ml_collections.ConfigDict) -> None:
  """ValueError naming the bad key, before anything is trained or loaded."""
  bad = [a for a in config.attacks if a not in adversarial.ATTACKS]
  if not config.attacks or bad:
    raise ValueError(f'config.attacks must be a non-empty subset of '
                     f'{adversarial.ATTACKS}, got {tuple(config.attacks)}.')
  if not config.epsilons or any(not 0 <= e <= 1 for e in config.epsilons):
    raise ValueError(f'config.epsilons must be values in [0, 1], got '
                     f'{tuple(config.epsilons)}.')
  if config.loss not in adversarial.ATTACK_LOSSES:
    raise ValueError(f'config.loss must be one of {adversarial.ATTACK_LOSSES}, '
                     f'got {config.loss!r}.')
  for key in ('num_examples', 'bim_steps'):
    if config[key] < 0:
      raise ValueError(f'config.{key} must be >= 0, got {config[key]}.')
  if config.batch_size < 1 or config.bim_step_size <= 0:
    raise ValueError(f'config.batch_size must be >= 1 and config.bim_step_size '
                     f'> 0, got {config.batch_size} and {config.bim_step_size}.')


def train_models(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
  """Train the models of ``config.train`` (if any); their workdirs."""
  trained = []
  for name, train_config in config.train.items():
    path = os.path.join(workdir, 'train', name)
    family = models.MODEL_FAMILY.get(train_config.model)
    trainer = train_em if family == 'em' else train_dynamic
    trainer.train_and_evaluate(train_config, path)
    trained.append(path)
  return trained


def _attack_loss_name(config: ml_collections.ConfigDict, kind: str,
                      margin: float) -> str:
  if kind == 'cross_entropy':
    return ('softmax cross-entropy on logits' if config.model == 'baseline_cnn'
            else 'softmax cross-entropy on the log-odds of the class scores')
  return {'capsnet': 'margin loss on capsule lengths (no reconstruction term)',
          'baseline_cnn': 'softmax cross-entropy on logits',
          'matrix_capsnet': f'spread loss at the final margin {margin:.2f}',
          }.get(config.model, "Su's binary margin loss on the scores")


def attack_workdir(config: ml_collections.ConfigDict, model_workdir: str,
                   test_splits: dict) -> dict[str, Any]:
  """Attack the model trained in ``model_workdir``; one row of the summary."""
  run_config = train_lib.read_workdir_config(model_workdir)
  if run_config.dataset not in _DIGIT_DATASETS:
    raise ValueError(
        f'{model_workdir} was trained on {run_config.dataset!r}; the attacks '
        f'perturb [0, 1] pixels, which only {_DIGIT_DATASETS} models see.')
  data_dir = config.data_dir or run_config.get('data_dir') or None
  key = (run_config.dataset, data_dir)
  if key not in test_splits:
    test_splits[key] = data_lib.load_dataset(
        run_config.dataset, data_dir=data_dir, validation_size=0).test
  test = test_splits[key]
  num = config.num_examples or len(test.labels)
  model = train_lib.load_trained_model(model_workdir)
  margin = (adversarial.final_spread_margin(run_config)
            if run_config.model == 'matrix_capsnet' else 0.9)
  kind = config.loss
  if (run_config.model == 'matrix_capsnet' and kind == 'family' and
      run_config.get('loss', 'spread') == 'cross_entropy'):
    kind = 'cross_entropy'  # that EM run trained on cross-entropy
  start = time.perf_counter()
  # What the model reads at evaluation (the run's centre crop, if any).
  images = train_lib.digit_inputs(test.images[:num], None, 0,
                                  run_config.get('center_crop', 0))
  row = adversarial.evaluate_attacks(
      model, images, test.labels[:num], config.epsilons,
      attacks=config.attacks, kind=kind, spread_margin=margin,
      step_size=config.bim_step_size, num_steps=config.bim_steps,
      batch_size=config.batch_size)
  summary_path = os.path.join(model_workdir, 'summary.json')
  trained = json.load(open(summary_path)) if os.path.exists(
      summary_path) else {}
  return {
      'workdir': os.path.abspath(model_workdir),
      'model': run_config.model,
      'dataset': run_config.dataset,
      'num_params': trained.get('num_params'),
      'test_accuracy_full_test_set': (trained.get('test') or {}).get(
          'accuracy'),
      'attack_loss': _attack_loss_name(run_config, kind, margin),
      'attack_wall_s': time.perf_counter() - start,
      **row,
  }


def _names(rows: Sequence[dict[str, Any]]) -> list[str]:
  names = [row['model'] for row in rows]
  return [f'{n} ({os.path.basename(row["workdir"])})' if names.count(n) > 1
          else n for n, row in zip(names, rows, strict=True)]


def run(config: ml_collections.ConfigDict, workdir: str,
        model_workdirs: Sequence[str] = ()) -> dict[str, Any]:
  """Train ``config.train``, attack it and ``model_workdirs``; summarise."""
  from capsjax import figures  # matplotlib: only when drawing
  check_config(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  for path in model_workdirs:
    train_lib.read_workdir_config(path)  # fail before training anything
  workdirs = list(model_workdirs) + train_models(config, workdir)
  if not workdirs:
    raise ValueError('no models to attack: pass --models=WORKDIR[,WORKDIR...] '
                     'of trained runs, or a config that trains some (:smoke).')
  test_splits: dict = {}
  rows = []
  for path in workdirs:
    print(f'Attacking the model in {path} ...', flush=True)
    rows.append(attack_workdir(config, path, test_splits))
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
      **train_lib.environment(),
  }
  train_lib.write_json_atomic(os.path.join(workdir, 'summary.json'), summary)
  return summary
