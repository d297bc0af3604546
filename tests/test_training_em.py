"""Integration tests of the EM-routing training loop.

Most train on a smallNORB release the tests write in the NYU format (the
real data cannot be downloaded here), which also exercises the reader, the
48x48 stereo inputs and the random crops end to end; the slow one trains the
small EM model on ../shared/data/mnist.
"""

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from capsjax.training import checkpoints
from capsjax.training import em
from capsjax.training import loop
from experiments.configs import matrix_capsnet_mnist
from experiments.configs import matrix_capsnet_smallnorb
from tests import conftest
from tests.test_data_smallnorb import make_release
from tests.test_training_dynamic import needs_mnist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def norb_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp('norb')
  make_release(directory, n_train=40, n_test=16)
  return str(directory)


def _norb_config(norb_dir, **overrides):
  config = matrix_capsnet_smallnorb.get_config('smoke')
  config.data_dir = norb_dir
  config.update(overrides)
  return config


def test_smallnorb_pipeline_end_to_end_on_generated_release(tmp_path, norb_dir):
  """Reader -> 48x48 stereo -> crops -> matrix capsules -> summary."""
  config = _norb_config(norb_dir)
  summary = em.train_and_evaluate(config, str(tmp_path / 'work'))
  assert summary['dataset'] == 'smallnorb'
  assert summary['steps'] == config.num_train_steps
  assert 0.0 <= summary['test']['accuracy'] <= 1.0
  assert summary['num_params'] > 0
  for line in open(tmp_path / 'work' / 'metrics.jsonl'):
    record = json.loads(line)
    assert all(math.isfinite(v) for v in record.values()), record


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, norb_dir):
  """A poisoned step stops the run naming the step; checkpoint 10 survives."""
  workdir = str(tmp_path / 'work')
  good = em.train_and_evaluate(
      _norb_config(norb_dir, num_train_steps=10), workdir)
  assert good['steps'] == 10
  before = checkpoints.load_trained_model(workdir, which='latest')
  # Resume with a poison: a NaN weight decay makes every loss from step 10
  # on NaN (the same path as a poisoned batch or an overflowing gradient).
  poisoned = _norb_config(norb_dir, num_train_steps=20,
                          weight_decay=float('nan'))
  with pytest.raises(loop.TrainingDiverged, match='non-finite at step 10'):
    em.train_and_evaluate(poisoned, workdir)
  checkpointer = checkpoints.Checkpointer(os.path.join(workdir, 'checkpoints'))
  assert checkpointer.latest_step() == 10  # nothing written after the poison
  checkpointer.close()
  after = checkpoints.load_trained_model(workdir, which='latest')
  for a, b in zip(jax.tree.leaves(nnx.state(before, nnx.Param)),
                  jax.tree.leaves(nnx.state(after, nnx.Param)), strict=True):
    np.testing.assert_array_equal(a, b)
    assert np.all(np.isfinite(a))


def test_nonfinite_message_from_the_command_line(tmp_path, norb_dir):
  config = os.path.join(REPO,
                        'experiments/configs/matrix_capsnet_smallnorb.py:smoke')
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.matrix_capsnet',
       f'--workdir={tmp_path}', f'--config={config}',
       f'--config.data_dir={norb_dir}', '--config.weight_decay=nan'],
      cwd=REPO, capture_output=True, text=True, timeout=600,
      env=conftest.training_env())
  assert out.returncode == 2, out.stdout + out.stderr
  assert 'non-finite at step 0' in out.stderr
  assert 'Traceback' not in out.stderr


@needs_mnist
@pytest.mark.slow
def test_small_em_model_reaches_95_percent_on_mnist_in_5_minutes(tmp_path):
  """The EM issue's CI target, with every loss and gradient finite.

  The smoke model (one EM iteration on the central 24x24) reached 96.50%
  test accuracy (96.66% validation) in 690 steps and under a minute of
  training on a 2-core CPU; seed 1 96.28% (results/em_mnist_trials/session5).
  Training is capped at 280 s (the config's guard): 95% is asserted when
  every step ran, 93% when the guard stopped a much slower machine
  mid-schedule.
  """
  config = os.path.join(REPO, 'experiments/configs/matrix_capsnet_mnist.py:smoke')
  env = conftest.training_env()
  # Data parallelism over four host devices on the two cores: XLA's CPU
  # kernels of the routing are mostly single-threaded. Idle, the smoke
  # model's step ran 1.33x faster on 4 devices than on 1 (BENCHMARKS.md).
  env['XLA_FLAGS'] = (env['XLA_FLAGS'] +
                      ' --xla_force_host_platform_device_count=4').strip()
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.matrix_capsnet',
       f'--workdir={tmp_path}', f'--config={config}'],
      cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
  assert out.returncode == 0, out.stdout + out.stderr
  summary = json.load(open(tmp_path / 'summary.json'))
  print(json.dumps(summary, indent=1))
  num_train_steps = matrix_capsnet_mnist.get_config('smoke').num_train_steps
  assert 400 <= summary['steps'] <= num_train_steps
  assert summary['num_devices'] == 4
  assert summary['train_wall_s_this_run'] < 300, summary
  if summary['steps'] == num_train_steps:
    assert summary['test']['accuracy'] >= 0.95, summary
  else:
    # The guard stopped a much slower machine mid-schedule (higher learning
    # rate, lower margin); the two seeds had 93.68% and 94.54% validation
    # accuracy at step 345.
    assert summary['test']['accuracy'] >= 0.93, summary
  records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  logged = [r for r in records if 'train/loss' in r]
  assert len(logged) >= summary['steps'] // 50
  for record in logged:
    assert math.isfinite(record['train/loss']), record
    assert math.isfinite(record['train/grad_norm']), record
