"""Install the declared minimum of every runtime dependency and test on it.

    python tools/check_floors.py                  # the floors of pyproject.toml
    python tools/check_floors.py --venv=/tmp/floors --pin=jax==0.7.2

pyproject.toml declares each runtime dependency as ``NAME>=FLOOR``. This
script makes a fresh virtual environment, installs every ``NAME==FLOOR``
together in one pip call (so that pip's resolver either finds them
compatible or says which two are not; what they require in turn comes at
its newest allowed version, as a user's fresh install gets it), installs
capsjax from this checkout without dependencies, checks that pip installed
exactly the floors (``pip check`` too), then runs in it:

- the routing, layer and model unit tests (``UNIT_TESTS``), and
- a few training steps of the smoke CapsNet experiment on a small synthetic
  MNIST, which save an orbax checkpoint, and then a rerun that resumes
  from it;
- then, with jax and jaxlib upgraded to their newest releases over the
  other floors (``NEWEST``), the training steps again: a user whose
  environment holds the floors of flax or orbax-checkpoint and who installs
  capsjax gets the newest jax beside them (pip keeps what satisfies a
  requirement), and the floor of each must work with it too.

``--pin NAME==VERSION`` replaces one floor (to bisect a floor before
raising it in pyproject.toml); ``--venv`` keeps the environment in a
folder of your choice (made afresh unless ``--reuse``). The exit status is
0 when everything passed. ``tests/test_floors.py`` runs it (slow tier).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT_TESTS = ('tests/test_routing.py', 'tests/test_votes.py',
              'tests/test_attention_routing.py', 'tests/test_losses.py',
              'tests/test_layers.py', 'tests/test_models.py')
# What the tests above import beyond the runtime dependencies, at any
# version (tools, not floors: they constrain none of capsjax's
# dependencies).
TEST_TOOLS = ('pytest>=8', 'hypothesis>=6.100')
# Upgraded to their newest releases over the other floors, for a second run
# of the training steps.
NEWEST = ('jax', 'jaxlib')
_FLOOR = re.compile(r'^\s*([A-Za-z0-9_.\-]+)\s*>=\s*([^,;\s]+)')


def _normalise(name: str) -> str:
  return re.sub(r'[-_.]+', '-', name).lower()


def declared_floors(pyproject: str = os.path.join(REPO, 'pyproject.toml')
                    ) -> dict[str, str]:
  """{name: floor} of the ``[project] dependencies``; ValueError for one
  without a ``>=`` floor (every runtime dependency must declare one)."""
  with open(pyproject, 'rb') as f:
    requirements = tomllib.load(f)['project']['dependencies']
  floors = {}
  for requirement in requirements:
    match = _FLOOR.match(requirement)
    if not match:
      raise ValueError(f'pyproject.toml: {requirement!r} declares no '
                       f'floor (NAME>=VERSION)')
    floors[match.group(1)] = match.group(2)
  return floors


def _env() -> dict[str, str]:
  """The environment of every command here: without what would show the
  new environment another Python's packages (PYTHONPATH: pip would count
  them as installed, and the tests import them), and without the caller's
  XLA_FLAGS, which may name flags that the floor's older XLA does not know
  and dies on (the test suite's own, set for the newest jaxlib); the tests
  and the experiments set their own for the jaxlib they run on."""
  env = {k: v for k, v in os.environ.items()
         if k not in ('PYTHONPATH', 'PYTHONHOME', 'VIRTUAL_ENV', 'XLA_FLAGS')}
  return env | {'CAPSJAX_NO_PROGRESS': '1'}


def _run(command: list[str], **kwargs) -> None:
  print('+', ' '.join(command), flush=True)
  subprocess.run(command, check=True, env=_env(), **kwargs)


def _idx(array, path: str) -> None:
  """Writes an IDX file (MNIST's format) of a uint8 array."""
  with open(path, 'wb') as f:
    f.write(struct.pack('>BBBB', 0, 0, 0x08, array.ndim))
    f.write(struct.pack(f'>{array.ndim}I', *array.shape))
    f.write(array.tobytes())


def synthetic_mnist(directory: str, num_train: int = 640,
                    num_test: int = 128) -> str:
  """MNIST's four IDX files of random 28x28 images: training runs, not
  accuracy, are what the floors are checked on."""
  import numpy as np
  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(0)
  for split, n in (('train', num_train), ('t10k', num_test)):
    _idx(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
         os.path.join(directory, f'{split}-images-idx3-ubyte'))
    _idx(rng.integers(0, 10, (n,), dtype=np.uint8),
         os.path.join(directory, f'{split}-labels-idx1-ubyte'))
  return directory


def make_venv(venv: str, pins: list[str]) -> str:
  """A virtual environment at ``venv`` with ``pins``, capsjax (no
  dependencies) and the test tools; its python."""
  _run([sys.executable, '-m', 'venv', venv])
  python = os.path.join(venv, 'bin', 'python')
  pip = [python, '-m', 'pip', 'install', '-q', '--disable-pip-version-check']
  # Binary wheels only: an old release with no wheel for this Python would
  # otherwise be built from source (minutes), not what a user gets.
  _run(pip + ['--only-binary=:all:', *pins, *TEST_TOOLS])
  _run(pip + ['--no-deps', REPO])
  return python


def installed_versions(python: str) -> dict[str, str]:
  out = subprocess.run([python, '-m', 'pip', 'list', '--format=freeze',
                        '--disable-pip-version-check'], env=_env(),
                       check=True, capture_output=True, text=True).stdout
  return {_normalise(line.split('==')[0]): line.split('==')[1]
          for line in out.splitlines() if '==' in line}


def check_installed(python: str, floors: dict[str, str]) -> list[str]:
  """Lines naming each floor that pip did not install as asked."""
  versions = installed_versions(python)
  wrong = []
  for name, floor in floors.items():
    got = versions.get(_normalise(name.split('[')[0]))
    if got is None or _release(got) != _release(floor):
      wrong.append(f'{name}: asked {floor}, installed {got}')
  return wrong


def _release(version: str) -> tuple[int, ...]:
  """'0.6' and '0.6.0' alike."""
  parts = [int(p) for p in re.findall(r'\d+', version.split('+')[0])]
  while parts and parts[-1] == 0:
    parts.pop()
  return tuple(parts)


def smoke_training(python: str, workdir: str, data_dir: str) -> None:
  """4 steps with a checkpoint at step 2 and 4, then a rerun to step 6 that
  resumes from step 4's checkpoint (orbax's save and restore)."""
  base = [python, '-m', 'experiments.train', f'--workdir={workdir}',
          '--config=experiments/configs/capsnet_mnist.py:smoke',
          f'--config.data_dir={data_dir}', '--config.validation_size=128',
          '--config.batch_size=32', '--config.eval_batch_size=128',
          '--config.checkpoint_every_steps=2', '--config.eval_every_steps=2',
          '--config.log_every_steps=2', '--config.max_train_seconds=0']
  _run(base + ['--config.num_train_steps=4'], cwd=REPO)
  out = subprocess.run(base + ['--config.num_train_steps=6'], cwd=REPO,
                       env=_env(), capture_output=True, text=True)
  sys.stdout.write(out.stdout + out.stderr)
  if out.returncode or 'Resuming from the checkpoint of step 4' not in (
      out.stdout + out.stderr):
    raise RuntimeError('the rerun did not resume from step 4\'s checkpoint')


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--venv', help='where to make the environment '
                      '(default: a temporary folder, removed afterwards)')
  parser.add_argument('--reuse', action='store_true',
                      help='use --venv as it is if it exists')
  parser.add_argument('--pin', action='append', default=[],
                      metavar='NAME==VERSION', help='instead of a floor')
  parser.add_argument('--keep_going', action='store_true',
                      help='run every unit test (default: stop at the first '
                      'failure)')
  parser.add_argument('--no_newest', action='store_true',
                      help='skip the second run, with the newest jax')
  parser.add_argument('--no_tests', action='store_true',
                      help='install and check the versions only')
  args = parser.parse_args()
  start = time.monotonic()
  floors = declared_floors()
  for pin in args.pin:
    name, version = pin.split('==')
    floors = {k: v for k, v in floors.items()
              if _normalise(k) != _normalise(name)} | {name: version}
  scratch = tempfile.mkdtemp(prefix='capsjax-floors-')
  venv = args.venv or os.path.join(scratch, 'venv')
  try:
    python = os.path.join(venv, 'bin', 'python')
    if not (args.reuse and os.path.exists(python)):
      shutil.rmtree(venv, ignore_errors=True)
      make_venv(venv, [f'{name}=={floor}' for name, floor in floors.items()])
    wrong = check_installed(python, floors)
    if wrong:
      print('Not the floors:\n  ' + '\n  '.join(wrong), flush=True)
      return 1
    _run([python, '-m', 'pip', 'check', '--disable-pip-version-check'])
    print(f'Installed the floors in {time.monotonic() - start:.0f} s: ' +
          ', '.join(f'{k}=={v}' for k, v in floors.items()), flush=True)
    if args.no_tests:
      return 0
    _run([python, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
          *([] if args.keep_going else ['-x']), '-m', 'not slow',
          *UNIT_TESTS], cwd=REPO)
    data_dir = synthetic_mnist(os.path.join(scratch, 'mnist'))
    smoke_training(python, os.path.join(scratch, 'workdir'), data_dir)
    if not args.no_newest:
      _run([python, '-m', 'pip', 'install', '-q', '--upgrade',
            '--disable-pip-version-check', '--only-binary=:all:', *NEWEST])
      versions = installed_versions(python)
      print('Newest over the floors: ' + ', '.join(
          f'{name}=={versions[name]}' for name in NEWEST), flush=True)
      smoke_training(python, os.path.join(scratch, 'workdir_newest'),
                     data_dir)
  except subprocess.CalledProcessError as error:
    print(f'Failed on the floors: {" ".join(error.cmd)} exited with '
          f'{error.returncode}.', flush=True)
    return 1
  except RuntimeError as error:
    print(f'Failed on the floors: {error}', flush=True)
    return 1
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  print(f'The floors passed in {time.monotonic() - start:.0f} s.', flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
