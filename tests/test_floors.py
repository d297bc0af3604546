"""The dependency floors that pyproject.toml declares hold: installed
together into a fresh virtual environment, capsjax's routing, layer and
model tests and a few training steps (a checkpoint saved and resumed) pass
on them (tools/check_floors.py). The newest versions are what the rest of
the suite runs on."""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, os.path.join(REPO, 'tools'))
import check_floors  # noqa: E402


def test_every_runtime_dependency_declares_a_floor():
  floors = check_floors.declared_floors()
  assert {'jax', 'flax', 'optax', 'orbax-checkpoint', 'numpy'} <= set(floors)
  assert all(floors.values())


@pytest.mark.slow
def test_the_declared_floors_install_together_and_pass():
  result = subprocess.run(
      [sys.executable, os.path.join(REPO, 'tools', 'check_floors.py')],
      cwd=REPO, capture_output=True, text=True, timeout=1800)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-8000:]
  assert 'The floors passed' in output, output[-3000:]
