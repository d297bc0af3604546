"""Integration tests of the dynamic-routing training loop on the shared MNIST.

The smoke CapsNet (same code as the paper model, smaller widths) must reach
97% test accuracy in under 5 minutes of CPU training, and a run killed with
SIGKILL must resume and end with the parameters of an uninterrupted run.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from capsjax import train_lib
from experiments.configs import baseline_cnn_mnist
from experiments.configs import capsnet_mnist
from tests import conftest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST = os.path.join(REPO, '..', 'shared', 'data', 'mnist')
needs_mnist = pytest.mark.skipif(
    not os.path.exists(os.path.join(MNIST, 'train-images-idx3-ubyte.gz')),
    reason='../shared/data/mnist not present')


def _launch(workdir, config, *overrides, module='experiments.capsnet_mnist'):
  return subprocess.Popen(
      [sys.executable, '-m', module, f'--workdir={workdir}',
       f'--config={config}', *overrides],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env=conftest.training_env())


def _final_params(workdir):
  model = train_lib.load_trained_model(str(workdir), which='latest')
  from flax import nnx
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@needs_mnist
@pytest.mark.slow
def test_smoke_capsnet_reaches_97_percent_in_5_minutes(tmp_path):
  config = os.path.join(REPO, 'experiments/configs/capsnet_mnist.py:smoke')
  proc = _launch(tmp_path, config)
  out, _ = proc.communicate(timeout=900)
  assert proc.returncode == 0, out
  summary = json.load(open(tmp_path / 'summary.json'))
  print(json.dumps(summary, indent=1))
  assert summary['test']['accuracy'] >= 0.97, summary
  assert summary['train_wall_s_this_run'] < 300, summary
  assert summary['steps'] == capsnet_mnist.get_config('smoke').num_train_steps
  assert summary['validation']['accuracy'] >= 0.97
  # The artefacts a user looks at.
  assert os.listdir(tmp_path / 'tensorboard')
  lines = open(tmp_path / 'metrics.jsonl').read().splitlines()
  assert any('validation/accuracy' in line for line in lines)


@needs_mnist
@pytest.mark.slow
def test_sigkill_and_resume_matches_uninterrupted_run(tmp_path):
  """Kill -9 after the first checkpoint; the rerun ends where one run ends."""
  config = os.path.join(REPO, 'experiments/configs/baseline_cnn_mnist.py:smoke')
  overrides = ['--config.num_train_steps=60', '--config.checkpoint_every_steps=20',
               '--config.eval_every_steps=20', '--config.log_every_steps=10',
               '--config.validation_size=500']
  straight = _launch(tmp_path / 'straight', config, *overrides)
  out, _ = straight.communicate(timeout=600)
  assert straight.returncode == 0, out

  interrupted = tmp_path / 'interrupted'
  proc = _launch(interrupted, config, *overrides)
  deadline = time.time() + 600
  checkpoints = interrupted / 'checkpoints'
  while time.time() < deadline:
    steps = [d for d in (os.listdir(checkpoints) if checkpoints.exists() else [])
             if d.isdigit()]
    if steps:
      break
    assert proc.poll() is None, proc.stdout.read()
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not (interrupted / 'summary.json').exists()
  resumed = _launch(interrupted, config, *overrides)
  out, _ = resumed.communicate(timeout=600)
  assert resumed.returncode == 0, out
  assert 'Resuming from the checkpoint of step' in out
  for a, b in zip(_final_params(tmp_path / 'straight'),
                  _final_params(interrupted), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('module', ['experiments.capsnet_mnist',
                                    'experiments.matrix_capsnet'])
def test_help_lists_flags(module):
  out = subprocess.run([sys.executable, '-m', module, '--help'], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  # absl's --help exits with status 1 after printing.
  assert out.returncode in (0, 1), out.stderr
  assert '--workdir' in out.stdout and '--config' in out.stdout
  assert 'resume' in out.stdout


def test_missing_data_is_a_clear_error(tmp_path):
  config = os.path.join(REPO, 'experiments/configs/capsnet_mnist.py:smoke')
  proc = _launch(tmp_path / 'w', config,
                 f'--config.data_dir={tmp_path / "nowhere"}')
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 2, out
  assert 'error:' in out and 'nowhere' in out
  assert 'Traceback' not in out


def test_bad_variant_is_a_clear_error():
  with pytest.raises(ValueError, match='unknown variant'):
    capsnet_mnist.get_config('nonsense')
  with pytest.raises(ValueError, match='unknown variant'):
    baseline_cnn_mnist.get_config('nonsense')
