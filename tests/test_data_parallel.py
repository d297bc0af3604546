"""Data parallelism: 1, 2 and 8 forced CPU devices train the same model,
and so do two processes joined by ``--distributed``.

Both training loops run a few steps of a tiny CapsNet and a tiny matrix-capsule
model with ``num_devices`` = 1, 2, 8 on one process with 8 forced host
devices (2 splits the batch and reduces the gradients; 8 leaves two images
per device; 4 would cost a third compilation and test nothing more). The
batch is split over the devices and the gradients are reduced across them,
so only the summation order differs: the results must agree to float32
rounding, not bit for bit.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from capsjax.training import checkpoints
from tests import conftest
from tests.helpers import TINY
from tests.helpers import TINY_OPTIONS
from tests.helpers import write_tiny_mnist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The first is the reference the others must train like.
DEVICE_COUNTS = (1, 2, 8)

_DRIVER = r'''
import json, os, sys
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8')
import jax
import numpy as np
from flax import nnx
from capsjax.training import checkpoints, matrix_capsules, vector_capsules
from capsjax.training import state as state_lib
from experiments.configs import capsnet_mnist, matrix_capsnet_mnist

family, data_dir, workdir, options, settings, counts = sys.argv[1:]
assert jax.device_count() == 8, jax.devices()
if family == 'capsnet':
  base, train = capsnet_mnist.get_config('smoke'), vector_capsules
else:
  base, train = matrix_capsnet_mnist.get_config('smoke'), matrix_capsules
base.model_options.update(json.loads(options))
base.update(json.loads(settings))
base.data_dir = data_dir

params, losses, curves = {}, {}, {}
for n in json.loads(counts):
  config = base.copy_and_resolve_references()
  config.num_devices = n
  summary = train.train_and_evaluate(config, f'{workdir}/{n}')
  assert summary['num_devices'] == n, summary
  model = checkpoints.load_trained_model(f'{workdir}/{n}', which='latest')
  params[n] = [np.asarray(x) for x in
               jax.tree.leaves(nnx.state(model, nnx.Param))]
  losses[n] = summary['test']['loss']
  with open(f'{workdir}/{n}/metrics.jsonl') as f:
    records = [json.loads(line) for line in f]
  curves[n] = [[r['train/loss'], r['train/grad_norm']] for r in records
               if 'train/loss' in r]
scale = max(float(np.max(np.abs(p))) for p in params[1])
init = [np.asarray(x) for x in jax.tree.leaves(
    nnx.state(state_lib.create_model(base), nnx.Param))]
print(json.dumps({
    'max_param_diff': {n: max(float(np.max(np.abs(a - b))) for a, b in
                              zip(params[1], params[n], strict=True))
                       for n in params if n != 1},
    'max_param': scale,
    'trained_minus_init': max(float(np.max(np.abs(a - b))) for a, b in
                              zip(params[1], init, strict=True)),
    'test_loss': losses,
    'train_loss_and_grad_norm': curves}))
'''


def _assert_same_training(result, param_tolerance):
  """The training loss and the gradient norm of the first step agree to float32
  rounding (a gradient summed instead of averaged over the devices, or not
  reduced across them, changes the norm), later steps closely; so do the final
  test losses; the
  parameters agree within ``param_tolerance`` (relative to the largest
  weight), far less than training moved them."""
  curves = result['train_loss_and_grad_norm']
  assert len(curves['1']) == _STEPS['num_train_steps'], result
  for n in map(str, DEVICE_COUNTS[1:]):
    # The first step starts from the same weights: rounding only. Later
    # steps also inherit the weights' differences.
    np.testing.assert_allclose(curves[n][0], curves['1'][0], rtol=1e-5,
                               err_msg=f'{n} devices')
    np.testing.assert_allclose(curves[n], curves['1'], rtol=1e-3,
                               err_msg=f'{n} devices')
  losses = list(result['test_loss'].values())
  np.testing.assert_allclose(losses, losses[0], rtol=1e-5)
  tolerance = param_tolerance * max(1.0, result['max_param'])
  assert result['trained_minus_init'] > 10 * tolerance, result
  for n, diff in result['max_param_diff'].items():
    assert diff < tolerance, (n, result)


def _train_on_1_2_8_devices(tmp_path, family, options, settings):
  data_dir = str(tmp_path / 'data')
  write_tiny_mnist(data_dir, num_train=160, num_test=32)
  out = subprocess.run(
      [sys.executable, '-c', _DRIVER, family, data_dir, str(tmp_path / 'w'),
       json.dumps(options), json.dumps(settings), json.dumps(DEVICE_COUNTS)],
      cwd=REPO, capture_output=True, text=True, timeout=900,
      env=conftest.training_env())
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


# Batch 16 splits over 8 devices; 4 steps of Adam move every weight.
_STEPS = dict(TINY, batch_size=16, num_train_steps=4, eval_every_steps=4,
              checkpoint_every_steps=4, validation_size=32, eval_batch_size=32)


@pytest.mark.slow
def test_capsnet_trains_identically_on_1_2_8_devices(tmp_path):
  _assert_same_training(_train_on_1_2_8_devices(
      tmp_path, 'capsnet', TINY_OPTIONS, _STEPS), param_tolerance=1e-5)


@pytest.mark.slow
def test_matrix_capsnet_trains_identically_on_1_2_8_devices(tmp_path):
  _assert_same_training(_train_on_1_2_8_devices(
      # Two iterations (the smoke config routes once): the E-step too.
      tmp_path, 'matrix_capsnet', dict(A=8, B=4, C=4, D=4, num_iterations=2),
      _STEPS),
      # Adam scales each weight's step by its gradient's own size, so weights
      # whose gradients are at rounding level (saturated EM activations) move
      # further than the rest on rounding noise (up to +-lr, 1e-2, per step).
      param_tolerance=3e-4)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_like_one_process_with_two_devices(tmp_path):
  """`--distributed` (jax.distributed, gloo between CPU processes): two
  processes with one device each give the run of one process with two
  devices: the same losses, gradient norms and parameters; process 0 alone
  writes the run's files."""
  data_dir = str(tmp_path / 'data')
  write_tiny_mnist(data_dir, num_train=160, num_test=32)
  config = os.path.join(REPO, 'experiments/configs/capsnet_mnist.py:smoke')
  flags = [f'--config={config}',
           *[f'--config.model_options.{k}={v}' for k, v in
             TINY_OPTIONS.items()],
           *[f'--config.{k}={v}' for k, v in _STEPS.items()],
           f'--config.data_dir={data_dir}']
  command = [sys.executable, '-m', 'experiments.train']
  env = conftest.training_env() | {'JAX_PLATFORMS': 'cpu'}
  port = _free_port()
  processes = [
      subprocess.Popen(
          [*command, f'--workdir={tmp_path / "two_processes"}', *flags,
           '--distributed', f'--coordinator_address=localhost:{port}',
           '--num_processes=2', f'--process_id={i}'],
          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
          text=True, env=env) for i in (0, 1)]
  outputs = [p.communicate(timeout=300)[0] for p in processes]
  for p, out in zip(processes, outputs, strict=True):
    assert p.returncode == 0, out[-3000:]
  assert 'parameters' in outputs[0] and 'parameters' not in outputs[1]
  single = subprocess.run(
      [*command, f'--workdir={tmp_path / "one_process"}', *flags],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env=env | {'XLA_FLAGS': env.get('XLA_FLAGS', '') +
                 ' --xla_force_host_platform_device_count=2'})
  assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]

  def run_record(name):
    workdir = tmp_path / name
    with open(workdir / 'metrics.jsonl') as f:
      metrics = [json.loads(line) for line in f]
    with open(workdir / 'summary.json') as f:
      summary = json.load(f)
    return metrics, summary

  (metrics_2p, summary_2p), (metrics_1p, summary_1p) = (
      run_record('two_processes'), run_record('one_process'))
  assert summary_2p['num_devices'] == summary_1p['num_devices'] == 2
  assert summary_2p['test'] == summary_1p['test']
  assert len(metrics_2p) == len(metrics_1p)  # written once, not twice
  for a, b in zip(metrics_2p, metrics_1p, strict=True):
    for key in ('train/loss', 'train/grad_norm', 'validation/loss'):
      assert a.get(key) == b.get(key), (key, a, b)
  params = [[np.asarray(x) for x in jax.tree.leaves(nnx.state(
      checkpoints.load_trained_model(str(tmp_path / name), 'latest'),
      nnx.Param))] for name in ('two_processes', 'one_process')]
  for a, b in zip(*params, strict=True):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
