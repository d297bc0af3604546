"""The built package on its own: ``python -m build`` makes an sdist and a
wheel (from the sdist), which installs with its ``onednn`` extra into a
fresh virtual environment outside the clone, and works there.

One environment for the module (``wheel_env``): building and installing is
most of the time. Slow tier.
"""

import email.parser
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import venv
import zipfile

import pytest

from tests.conftest import REPO
from tests.conftest import training_env

pytestmark = pytest.mark.slow

# What capsjax needs at run time beside its modules.
_DATA_FILES = ('capsjax/kernels/conv/csrc/onednn_conv.cc',
               'capsjax/kernels/csrc/em_routing.cc',
               'capsjax/pretrained_models/capsnet_mnist_smoke.npz',
               'capsjax/pretrained_models/capsnet_mnist_smoke.json',
               'capsjax/pretrained_models/efficient_capsnet_mnist.npz',
               'capsjax/pretrained_models/matrix_capsnet_mnist.npz')


@pytest.fixture(scope='module')
def dist(tmp_path_factory):
  """{'sdist': path, 'wheel': path} built by ``python -m build``."""
  out = tmp_path_factory.mktemp('dist')
  result = subprocess.run([sys.executable, '-m', 'build', '--outdir',
                           str(out), REPO], capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  names = os.listdir(out)
  (sdist,) = [n for n in names if n.endswith('.tar.gz')]
  (wheel,) = [n for n in names if n.endswith('.whl')]
  return {'sdist': str(out / sdist), 'wheel': str(out / wheel)}


@pytest.fixture(scope='module')
def wheel_env(dist, tmp_path_factory):
  """(python, a working folder outside the clone) of a fresh virtual
  environment holding the wheel with its ``onednn`` extra."""
  root = tmp_path_factory.mktemp('wheel_env')
  venv.create(root / 'venv', with_pip=True)
  python = str(root / 'venv' / 'bin' / 'python')
  subprocess.run([python, '-m', 'pip', 'install', '-q',
                  '--disable-pip-version-check', f'{dist["wheel"]}[onednn]'],
                 check=True, capture_output=True, timeout=900, env=_clean_env())
  work = root / 'work'
  work.mkdir()
  assert not str(work).startswith(REPO)
  return python, work


def _clean_env(**changes) -> dict[str, str]:
  """The tests' environment without what would show the environment
  another Python's packages or this clone."""
  env = {k: v for k, v in training_env().items()
         if k not in ('PYTHONPATH', 'CXX', 'VIRTUAL_ENV', 'PYTHONHOME')}
  return env | changes


def _run(python, work, script: str, **env_changes):
  """Runs ``script`` with the environment's python in ``work``: its output
  (stdout + stderr); fails on a non-zero status."""
  env = _clean_env(**env_changes)
  path = os.path.join(work, 'script.py')
  with open(path, 'w') as f:
    f.write(textwrap.dedent(script))
  result = subprocess.run([python, path], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-5000:]
  return output


def test_sdist_and_wheel_carry_what_capsjax_needs_at_run_time(dist):
  wheel = zipfile.ZipFile(dist['wheel']).namelist()
  # The library, not the repository's experiments; the Apache-2.0 text
  # that pyproject.toml's license names.
  top = {name.split('/')[0] for name in wheel}
  assert 'capsjax' in top and 'experiments' not in top, sorted(top)
  assert any(name.endswith('.dist-info/licenses/LICENSE') for name in wheel)
  with tarfile.open(dist['sdist']) as sdist:
    in_sdist = ['/'.join(name.split('/')[1:]) for name in sdist.getnames()]
  for name in _DATA_FILES:
    assert name in wheel, name
    assert name in in_sdist, name
  (metadata,) = [n for n in wheel if n.endswith('.dist-info/METADATA')]
  fields = email.parser.Parser().parsestr(
      zipfile.ZipFile(dist['wheel']).read(metadata).decode())
  assert 'Capsule networks in JAX/Flax' in fields['Summary']
  assert fields['License-Expression'] == 'Apache-2.0'
  assert fields['Requires-Python'] == '>=3.11'
  classifiers = fields.get_all('Classifier')
  assert 'Programming Language :: Python :: 3.11' in classifiers
  # The Python versions named are the ones the suite runs on.
  assert (f'Programming Language :: Python :: {sys.version_info.major}.'
          f'{sys.version_info.minor}') in classifiers
  assert not fields.get_all('Project-URL')  # none made up
  assert 'onednn' in fields.get_all('Provides-Extra')


_ROUTE_CLASSIFY_AND_TRAIN = '''
import os, sys
import jax, jax.numpy as jnp, optax
from flax import nnx
import capsjax
from capsjax import layers, pretrained
from capsjax.kernels.conv import dispatch
from capsjax.training import state as state_lib

# The installed package, not a clone.
assert os.path.join('venv', 'lib') in capsjax.__file__, capsjax.__file__
print('capsjax from', os.path.dirname(capsjax.__file__))
dispatch.prefer_eigen_convolutions()

votes = jax.random.normal(jax.random.key(0), (2, 32, 10, 16))
outputs, coupling = capsjax.dynamic_routing(votes, num_iterations=3)
assert outputs.shape == (2, 10, 16) and coupling.shape == (2, 32, 10)
poses, activations, _ = capsjax.em_routing(
    votes, jnp.ones((2, 32)), beta_u=0.0, beta_a=0.0, num_iterations=3)
assert poses.shape == (2, 10, 16) and activations.shape == (2, 10)
print('routed')


class Tiny(nnx.Module):
  """A small CapsNet from capsjax.layers."""

  def __init__(self, rngs):
    self.conv = layers.Conv2D(1, 16, 5, rngs=rngs)
    self.primary = layers.PrimaryCapsules(16, num_types=4, dim=8,
                                          kernel_size=5, stride=2, rngs=rngs)
    self.digits = layers.DenseCapsules(10 * 10 * 4, 8, 10, 8, rngs=rngs)

  def __call__(self, x):
    capsules = self.primary(jax.nn.relu(self.conv(x)))
    outputs, _ = self.digits(capsules)
    return {'class_scores': capsjax.safe_norm(outputs)}


optimizer = optax.adam(1e-3)
graphdef, state = state_lib.init_train_state(Tiny(nnx.Rngs(0)), optimizer)
images = jax.random.uniform(jax.random.key(1), (8, 28, 28, 1))
labels = jnp.arange(8) % 10


def loss_fn(model):
  scores = model(images)['class_scores']
  return jnp.mean(capsjax.margin_loss(scores, jax.nn.one_hot(labels, 10))), {}


step = jax.jit(lambda state: state_lib.gradient_step(
    graphdef, state, optimizer, loss_fn))
losses = []
for _ in range(3):
  state, metrics = step(state)
  losses.append(float(metrics['loss']))
assert all(map(jnp.isfinite, losses)) and losses[-1] < losses[0], losses
from capsjax.kernels import conv
print('trained 3 steps; convolutions:', conv.backend())
'''


def test_the_wheel_routes_classifies_and_trains_outside_the_clone(
    wheel_env, tmp_path):
  python, work = wheel_env
  cache = tmp_path / 'native-cache'  # nothing built yet: built from the wheel
  output = _run(python, work, _ROUTE_CLASSIFY_AND_TRAIN,
                CAPSJAX_CACHE_DIR=str(cache))
  assert 'routed' in output and 'trained 3 steps' in output, output
  if shutil.which('g++') or shutil.which('c++'):
    # oneDNN's handlers compiled from the wheel's own C++ source.
    assert 'compiling onednn_conv.cc' in output, output
    assert 'convolutions: oneDNN' in output, output
    assert any(cache.rglob('*.so')), list(cache.rglob('*'))

  from PIL import Image
  images = tmp_path / 'digits'
  images.mkdir()
  digit = Image.new('L', (28, 28))
  digit.paste(255, (12, 4, 16, 24))
  for k in range(3):
    digit.save(images / f'{k}.png')
  result = subprocess.run(
      [python, '-m', 'capsjax.pretrained', 'efficient_capsnet_mnist',
       str(images)], cwd=work, capture_output=True, text=True, timeout=300,
      env=_clean_env())
  assert result.returncode == 0, result.stderr
  rows = [line.split('\t') for line in result.stdout.splitlines()]
  assert len(rows) == 3 and all(len(row) == 3 for row in rows), rows
  assert {row[1] for row in rows} <= {str(k) for k in range(10)}


_TRAIN_WITHOUT_A_COMPILER = '''
import os, struct
import numpy as np
import ml_collections
from capsjax import pretrained, training
from capsjax.kernels.conv import dispatch

dispatch.prefer_eigen_convolutions()
mnist = 'mnist'
os.makedirs(mnist, exist_ok=True)
rng = np.random.default_rng(0)
for split, n in (('train', 192), ('t10k', 64)):
  for kind, array in (
      ('images-idx3', rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)),
      ('labels-idx1', rng.integers(0, 10, (n,), dtype=np.uint8))):
    with open(f'{mnist}/{split}-{kind}-ubyte', 'wb') as f:
      f.write(struct.pack('>BBBB', 0, 0, 8, array.ndim))
      f.write(struct.pack(f'>{array.ndim}I', *array.shape))
      f.write(array.tobytes())
# The shipped smoke CapsNet's training config, for 2 steps on these files.
_, info = pretrained.load('capsnet_mnist_smoke')
config = ml_collections.ConfigDict(info['config'])
config.data_dir, config.validation_size = mnist, 64
config.batch_size, config.eval_batch_size = 32, 64
config.num_train_steps, config.max_train_seconds = 2, 0.0
config.evals = {}
summary = training.train(config, 'workdir')
print('trained', summary['steps'], 'steps; convolutions:',
      summary['conv_backend'].split()[0])
'''


def test_without_a_compiler_the_wheel_trains_through_xla_and_says_so_once(
    wheel_env, tmp_path):
  python, work = wheel_env
  # A PATH without g++ or c++: the environment's own bin folder only.
  output = _run(python, work, _TRAIN_WITHOUT_A_COMPILER,
                PATH=os.path.dirname(python),
                CAPSJAX_CACHE_DIR=str(tmp_path / 'native-cache'))
  assert 'trained 2 steps; convolutions: XLA' in output, output
  reason = 'no C++ compiler (g++, c++ or $CXX) on PATH'
  # Said once, by the run's header.
  assert output.count(reason) == 1, output
  assert 'Traceback' not in output, output
