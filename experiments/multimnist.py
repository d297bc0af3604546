"""Train CapsNet (or the baseline CNN) on MultiMNIST and report.

  python -m experiments.multimnist --workdir=/tmp/capsnet_multimnist \\
      --config=experiments/configs/capsnet_multimnist.py[:smoke|:baseline|:cpu]

Sabour et al. 2017, section 6: two overlapping MNIST digits on 36x36; an
example is correct when the two highest scores are the two true classes.
Rerunning with the same --workdir resumes from the last checkpoint. Writes
WORKDIR/summary.json (the training run), WORKDIR/multimnist_summary.json
(test error beside the paper's) and, for a CapsNet,
WORKDIR/multimnist_reconstructions.png (inputs; the digits decoded from the
two longest capsules in red and green; the ``multimnist_figure`` evaluator).
"""

import os
from typing import Any

import ml_collections

from experiments import launcher

# Test errors the paper reports (mean of 3 runs; section 6).
PAPER_MULTIMNIST_ERROR = {'capsnet': 0.052, 'baseline_cnn': 0.081}


def run_multimnist(config: ml_collections.ConfigDict, workdir: str
                   ) -> dict[str, Any]:
  """Train on MultiMNIST, write multimnist_summary.json."""
  from capsjax import training  # imports jax: after the flags
  if config.dataset != 'multimnist':
    raise ValueError(f"config.dataset must be 'multimnist', got "
                     f'{config.dataset!r}.')
  summary = training.train(config, workdir)
  error = lambda record: (record or {}).get('error')  # noqa: E731
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
      'validation_error': error(summary['validation']),
      'test_error': error(summary['test']),
      'paper_test_error': PAPER_MULTIMNIST_ERROR.get(config.model),
      'figure': summary.get('evals', {}).get('reconstructions', {}).get(
          'figure'),
      'device': summary['device'],
      'git_commit': summary['git_commit'],
  }
  training.write_json_atomic(
      os.path.join(workdir, 'multimnist_summary.json'), record)
  return record


if __name__ == '__main__':
  launcher.run(run_multimnist, 'capsnet_multimnist.py')
