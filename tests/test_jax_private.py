"""The private JAX APIs of capsjax._jax_private still exist and mean what
capsjax takes them to mean (each in a fresh interpreter)."""

import os
import subprocess
import sys

from capsjax.kernels.conv import dispatch
from tests.conftest import REPO

_PROBE = '''
import importlib
from capsjax import _jax_private as p
import jax
bridge = importlib.import_module(p.XLA_BRIDGE)
assert callable(getattr(bridge, p.BACKENDS_ARE_INITIALIZED)), 'renamed'
print('before', p.backends_started())
jax.devices()
print('after', p.backends_started())
'''


def test_backends_started_follows_jax():
  result = subprocess.run([sys.executable, '-c', _PROBE], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          check=False)
  assert result.returncode == 0, (
      f'a private JAX API capsjax reads has changed: {result.stderr[-1500:]}')
  assert result.stdout.split() == ['before', 'False', 'after', 'True']


def test_import_capsjax_changes_no_process_state():
  """No XLA_FLAGS change, no backend: the CPU convolution setting is an
  explicit call (capsjax.prefer_eigen_convolutions)."""
  probe = '''
import os
before = dict(os.environ)
import capsjax
from capsjax import _jax_private
assert dict(os.environ) == before, 'import capsjax changed the environment'
assert not _jax_private.backends_started()
print(capsjax.prefer_eigen_convolutions())
'''
  env = {k: v for k, v in os.environ.items()
         if k != 'XLA_FLAGS'}
  result = subprocess.run([sys.executable, '-c', probe], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300,
                          check=False)
  assert result.returncode == 0, result.stderr[-1500:]
  knows = dispatch.jaxlib_knows_flag(dispatch.YNN_FUSION_FLAG)
  assert result.stdout.startswith('applied' if knows else 'not applied'), (
      result.stdout)
