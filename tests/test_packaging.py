"""What a pip install ships: the library, not the repository's experiments."""

import os
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_wheel_ships_capsjax_only(tmp_path):
  subprocess.run(
      [sys.executable, '-m', 'pip', 'wheel', '--no-deps',
       '-q', '-w', str(tmp_path), REPO],
      check=True, capture_output=True, timeout=300)
  (wheel,) = [f for f in os.listdir(tmp_path) if f.endswith('.whl')]
  names = zipfile.ZipFile(tmp_path / wheel).namelist()
  top = {name.split('/')[0] for name in names}
  assert 'capsjax' in top and 'experiments' not in top, sorted(top)
  # The C++ sources (oneDNN's convolutions, the EM kernel) travel with it.
  assert 'capsjax/kernels/conv/csrc/onednn_conv.cc' in names
  assert 'capsjax/kernels/csrc/em_routing.cc' in names
  # The Apache-2.0 text that pyproject.toml's license names.
  assert any(name.endswith('.dist-info/licenses/LICENSE') for name in names)


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
