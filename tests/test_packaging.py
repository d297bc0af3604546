"""What a pip install ships: the library, not the repository's experiments
(the built wheel itself: tests/test_wheel.py); output piped into a reader
that stops early."""

import os
import subprocess
import sys

from tests.conftest import REPO


def test_experiments_run_from_a_clone():
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.train', '--helpfull'],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert '--workdir' in out.stdout + out.stderr


def test_import_from_the_folder_holding_a_clone_named_capsjax(tmp_path):
  """The documented install finds the package from the clone's parent, where
  the clone folder itself would otherwise be imported as a namespace."""
  (tmp_path / 'capsjax').symlink_to(REPO, target_is_directory=True)
  out = subprocess.run(
      [sys.executable, '-c', 'import capsjax; print(capsjax.dynamic_routing)'],
      cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and 'function' in out.stdout, out.stderr


# ----------------------------------------------------------------------------
# Output piped into a reader that stops early (| head -1).

# Lines of about 250 bytes: 1,000 of them pass a pipe's 64 KiB buffer and
# the reader's first read, so that writing goes on after `head` has exited.
_PIPED_LINES = 1000


def _pipe_into_head(command: str, cwd: str, env=None) -> tuple[str, str, int]:
  """stdout, stderr and exit status of ``command | head -1``, the command's
  own status (pipefail)."""
  result = subprocess.run(
      ['bash', '-o', 'pipefail', '-c', f'{command} 2>"$ERR" | head -1'],
      cwd=cwd, capture_output=True, text=True, timeout=300,
      env=dict(env or os.environ, ERR=os.path.join(cwd, 'stderr.txt')))
  with open(os.path.join(cwd, 'stderr.txt')) as f:
    return result.stdout, f.read(), result.returncode


def _assert_quiet_stop(stdout: str, stderr: str, status: int) -> None:
  assert len(stdout.splitlines()) == 1, stdout[:500]
  assert 'Traceback' not in stderr and 'BrokenPipe' not in stderr, stderr
  assert 'Exception ignored' not in stderr, stderr
  # The status of a command ended by SIGPIPE.
  assert status == 141, (status, stderr)


def test_pretrained_command_stops_quietly_on_a_closed_pipe(tmp_path):
  from PIL import Image
  images = tmp_path / 'images'
  images.mkdir()
  digit = Image.new('L', (28, 28))
  digit.paste(255, (12, 4, 16, 24))  # a "1"
  for k in range(_PIPED_LINES):
    digit.save(images / f'{k:04d}_{"x" * 230}.png')
  stdout, stderr, status = _pipe_into_head(
      f'{sys.executable} -m capsjax.pretrained capsnet_mnist_smoke '
      f'{images}', str(tmp_path), env=dict(os.environ, PYTHONPATH=REPO))
  assert stdout.startswith(str(images / '0000_')), (stdout, stderr)
  _assert_quiet_stop(stdout, stderr, status)


_FAKE_PREDICT = f'''
import sys, types
from experiments import own_images
from capsjax import training
from capsjax.training import own_images as own_images_lib

own_images._check_trained = lambda workdir: None
training.load_context = lambda workdir: types.SimpleNamespace(config=None)
own_images_lib.score_name = lambda config: 'length'
training.predict = lambda context, paths, say: [
    types.SimpleNamespace(path=f'{{k:04d}}_' + 'x' * 230, class_name='cat',
                          score=0.5) for k in range({_PIPED_LINES})]
own_images._predict('workdir', ['images'])
'''


def test_experiments_predict_output_stops_quietly_on_a_closed_pipe(tmp_path):
  """``experiments.own_images --predict`` as it prints (the model and the
  images stand in: what is tested is the printing)."""
  script = tmp_path / 'predict.py'
  script.write_text(_FAKE_PREDICT)
  stdout, stderr, status = _pipe_into_head(
      f'{sys.executable} {script}', str(tmp_path),
      env=dict(os.environ, PYTHONPATH=REPO))
  assert stdout.startswith('# file\tclass\tlength'), (stdout, stderr)
  _assert_quiet_stop(stdout, stderr, status)
