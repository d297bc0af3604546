"""Train an ensemble of CapsNets that differ only in their seed; test it.

  python -m experiments.capsnet_ensemble --workdir=/tmp/capsnet_cifar10 \\
      --config=experiments/configs/capsnet_cifar10.py[:smoke] \\
      --config.data_dir=/path/to/cifar-10-batches-bin

Sabour et al. 2017, section 7: CIFAR-10's 10.6% is an ensemble of 7 models.
Model I (0 .. ``config.ensemble_size`` - 1) trains in WORKDIR/model_I with
seed ``config.seed + I``; a rerun with the same --workdir resumes the
unfinished one and only tests the finished ones. Then the ``ensemble``
evaluator averages the selected models' class scores on the validation and
test splits. Writes WORKDIR/ensemble_summary.json: the ensemble's and each
model's accuracy and error, and the paper's error.
"""

import os
from typing import Any

import ml_collections

from experiments import launcher

# Sabour et al. 2017, section 7.
PAPER_TEST_ERROR = {'cifar10': 0.106}


def member_workdirs(config: ml_collections.ConfigDict, workdir: str
                    ) -> list[str]:
  """WORKDIR/model_0 .. model_{ensemble_size - 1}."""
  size = config.ensemble_size
  if isinstance(size, bool) or not isinstance(size, int) or size < 1:
    raise ValueError(f'config.ensemble_size must be a positive int, got '
                     f'{size!r}.')
  return [os.path.join(workdir, f'model_{i}') for i in range(size)]


def member_config(config: ml_collections.ConfigDict, index: int
                  ) -> ml_collections.ConfigDict:
  """Model ``index``'s training config: the shared one, seed + index."""
  member = config.copy_and_resolve_references()
  member.seed = config.seed + index
  return member


def run_ensemble(config: ml_collections.ConfigDict, workdir: str
                 ) -> dict[str, Any]:
  """Train every model, test their ensemble, write the summary."""
  from capsjax import training  # imports jax: after the flags
  from capsjax.evaluators import ensemble
  workdir = os.path.abspath(workdir)
  members = member_workdirs(config, workdir)
  summaries = []
  for index, member in enumerate(members):
    print(f'--- model {index + 1} of {len(members)} (seed '
          f'{config.seed + index}) in {member} ---', flush=True)
    summaries.append(training.train(member_config(config, index), member))
  splits = ensemble.ensemble_workdirs(
      members, load_context=training.load_context,
      splits=('test', 'validation') if config.validation_size
      else ('test',), data_dir=config.data_dir or None)
  record = {
      'experiment': f'an ensemble of {len(members)} CapsNets, '
                    f'{config.dataset} (Sabour et al. 2017, section 7)',
      'dataset': config.dataset,
      'num_models': len(members),
      'paper_test_error': PAPER_TEST_ERROR.get(config.dataset),
      **splits,
      'models': [{'workdir': member, 'seed': config.seed + index,
                  'steps': summary['steps'], 'epochs': summary.get('epochs'),
                  'test': summary['test'],
                  'validation': summary.get('validation')}
                 for index, (member, summary) in enumerate(
                     zip(members, summaries, strict=True))],
      'train_images_per_s': summaries[0].get('train_images_per_s'),
      'device': summaries[0].get('device'),
      'git_commit': summaries[0].get('git_commit'),
  }
  training.write_json_atomic(os.path.join(workdir, 'ensemble_summary.json'),
                             record)
  print(f'ensemble of {len(members)}: test error '
        f'{100 * splits["test"]["error"]:.2f}% (models: '
        + ', '.join(f'{100 * (1 - a):.2f}%'
                    for a in splits['test']['member_accuracies']) + ')')
  return record


if __name__ == '__main__':
  launcher.run(run_ensemble, 'capsnet_cifar10.py')
