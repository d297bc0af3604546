"""Keep the host memory that XLA:CPU frees, so a step does not fault it in again.

XLA:CPU allocates each execution's temporary buffers afresh (406 MB for the
train step of Su's capsule model at batch 128) from its worker threads.
glibc's malloc serves blocks that large with ``mmap`` and gives them back
with ``munmap`` when the step ends, so every step touches never-used pages:
about 100,000 page faults a step there, 25-30% of its time on the 2-core
development CPU (BENCHMARKS.md, the CPU profile). Told to keep one arena, to
serve large blocks from the heap, and never to trim it, glibc hands the
same pages back to the next step: 0 page faults after the first steps.

The settings are process-wide and only take effect for threads that have
not yet allocated, so ``retain_freed_memory`` must run before JAX starts its
CPU backend; the experiments' launcher calls it first. It does nothing on
anything but Linux with glibc, when an accelerator plugin is installed (the
host then holds no step temporaries), or with CAPSJAX_RETAIN_HOST_MEMORY=0.
The cost: the process's resident memory stays at its peak.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import sys

from capsjax.kernels.conv import dispatch

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1

_applied: str | None = None


def _accelerator_plugins() -> list[str]:
  names = [entry.name for entry in
           importlib.metadata.entry_points(group='jax_plugins')]
  try:
    importlib.metadata.version('libtpu')
    names.append('libtpu')
  except importlib.metadata.PackageNotFoundError:
    pass
  return names


def retain_freed_memory() -> str:
  """Make glibc keep freed blocks for reuse; returns what was done, in words.

  Idempotent. Returns a reason instead of applying when it cannot or should
  not (see the module docstring).
  """
  global _applied
  if _applied is not None:
    return _applied
  if os.environ.get('CAPSJAX_RETAIN_HOST_MEMORY', '1') == '0':
    return 'off (CAPSJAX_RETAIN_HOST_MEMORY=0)'
  if not sys.platform.startswith('linux'):
    return f'not applied: {sys.platform} is not Linux'
  platforms = os.environ.get('JAX_PLATFORMS', '')
  cpu_first = platforms.split(',')[0] == 'cpu'
  if platforms and not cpu_first:
    return f'not applied: JAX_PLATFORMS={platforms}'
  plugins = [] if cpu_first else _accelerator_plugins()
  if plugins:
    return f'not applied: accelerator plugins installed ({", ".join(plugins)})'
  if dispatch.backend_started():
    return 'not applied: the JAX backend had already started'
  try:
    libc = ctypes.CDLL('libc.so.6')
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    libc.gnu_get_libc_version()
  except (OSError, AttributeError):
    return 'not applied: the C library is not glibc'
  settings = ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, _INT_MAX),
              (_M_TRIM_THRESHOLD, _INT_MAX))
  if not all(libc.mallopt(ctypes.c_int(p), ctypes.c_int(v)) == 1
             for p, v in settings):
    return 'not applied: glibc refused a mallopt setting'
  _applied = 'applied (one malloc arena, large blocks kept for reuse)'
  return _applied
