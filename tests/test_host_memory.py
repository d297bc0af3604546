"""capsjax.training.host_memory: glibc keeps the memory XLA:CPU frees.

Counted, not timed: the page faults of a jitted call with a 64 MB
temporary, in a fresh process, with and without the setting.
"""

import json
import os
import subprocess
import sys

import pytest

from capsjax.training import host_memory
from tests.conftest import REPO

_PROBE = r'''
import json, resource, sys
from capsjax.training import host_memory
status = host_memory.retain_freed_memory()
import jax, jax.numpy as jnp
x = jnp.ones((4096, 4096), jnp.float32)
w = jnp.ones((4096, 16), jnp.float32)
# A 64 MB temporary (the transposed sine) between input and output.
step = jax.jit(lambda x, w: jnp.sum(jnp.sin(x).T @ w))
faults = []
for _ in range(40):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  jax.block_until_ready(step(x, w))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({'status': status, 'faults': faults}))
'''


def _probe(setting):
  env = dict(os.environ, CAPSJAX_RETAIN_HOST_MEMORY=setting,
             JAX_PLATFORMS='cpu')
  out = subprocess.run([sys.executable, '-c', _PROBE], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two processes of 40 calls each
@pytest.mark.skipif(not sys.platform.startswith('linux'),
                    reason='glibc malloc settings: Linux only')
def test_retained_memory_is_not_faulted_in_again_on_later_calls():
  pages_of_one_temporary = 64 * 2**20 // 4096
  off = _probe('0')
  assert off['status'].startswith('off'), off
  # glibc's default maps and unmaps such a block on every call.
  assert min(off['faults'][-16:]) > pages_of_one_temporary // 2, off
  on = _probe('1')
  assert on['status'].startswith('applied'), on
  # Retained, the temporary reuses pages already mapped once glibc holds
  # free blocks that fit XLA's aligned request: the heap grew by the block
  # on 4-7 of the first 15 calls and on 0-1 of calls 25-40 in five probes
  # here (and on 5 of calls 5-12 in one CI run, hence the 40 calls).
  assert sum(on['faults'][-16:]) < 0.25 * sum(off['faults'][-16:]), (on, off)


def test_too_late_once_the_backend_has_started(monkeypatch):
  """In a process whose backend runs, the setting is refused, saying why
  (a worker thread that already has its arena would keep mapping)."""
  import jax
  jax.devices()  # starts the backend in this process
  if host_memory._applied is not None:
    pytest.skip('applied earlier in this process')
  monkeypatch.setenv('CAPSJAX_RETAIN_HOST_MEMORY', '1')
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  assert host_memory.retain_freed_memory() == (
      'not applied: the JAX backend had already started')
  assert host_memory._applied is None
  monkeypatch.setenv('CAPSJAX_RETAIN_HOST_MEMORY', '0')
  assert host_memory.retain_freed_memory().startswith('off')
