"""How much memory a step will take, known before it runs: the peak of the
arrays live at once in its traced program, and what the machine has.

The estimate traces the step (``jax.make_jaxpr`` on abstract arrays: no
compilation, nothing allocated, a second or two) and walks its equations in
program order, each value held from the equation that makes it to its last
use. XLA fuses element-wise chains and reuses buffers, and needs workspace
of its own for some convolutions: on this project's CPU the estimate of a
training step (its state and batch included) was 0.85-1.63x XLA's own
figure (``compiled.memory_analysis()``, arguments and temporaries) for the
full and smoke models of the three families
(results/own_images/memory_estimate.log); close to the limit, a run may
still not fit.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import jax
from jax.extend import core as jax_core


def _aval_bytes(aval) -> int:
  """Bytes of an abstract array (0 for tokens and other non-arrays)."""
  shape = getattr(aval, 'shape', None)
  if shape is None:
    return 0
  # PRNG keys are an extended dtype: count their two uint32 words.
  itemsize = getattr(aval.dtype, 'itemsize', None) or 8
  return math.prod(shape) * itemsize


def _size(var) -> int:
  return _aval_bytes(getattr(var, 'aval', None))


def _inner_jaxprs(eqn) -> Iterator[jax_core.Jaxpr]:
  """The jaxprs an equation calls (jit, scan and while bodies, branches)."""
  for param in eqn.params.values():
    for item in param if isinstance(param, tuple | list) else (param,):
      if isinstance(item, jax_core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax_core.Jaxpr):
        yield item


def peak_live_bytes(jaxpr: jax_core.Jaxpr) -> int:
  """The most bytes of intermediate values live at once in ``jaxpr``.

  Inputs are not counted (the caller holds them); outputs are, from where
  they are made. An equation that calls another jaxpr adds that jaxpr's
  own peak while it runs (a loop body once: its stacked outputs are the
  equation's outputs).
  """
  last_use = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for var in eqn.invars:
      if isinstance(var, jax_core.Var):
        last_use[var] = i
  outputs = {v for v in jaxpr.outvars if isinstance(v, jax_core.Var)}
  live, peak, held = 0, 0, {}
  for i, eqn in enumerate(jaxpr.eqns):
    inner = max((peak_live_bytes(j) for j in _inner_jaxprs(eqn)), default=0)
    peak = max(peak, live + inner)
    for var in eqn.outvars:
      held[var] = _size(var)
      live += held[var]
    peak = max(peak, live)
    done = {v for v in eqn.invars if isinstance(v, jax_core.Var)
            and last_use.get(v) == i}
    done |= {v for v in eqn.outvars if v not in last_use}
    for var in done - outputs:
      live -= held.pop(var, 0)
  return peak


def step_bytes(step, *args) -> int:
  """``peak_live_bytes`` of ``step(*args)``; args may be abstract
  (``jax.ShapeDtypeStruct``)."""
  return peak_live_bytes(jax.make_jaxpr(step)(*args).jaxpr)


def tree_bytes(tree) -> int:
  """Bytes of the arrays (or abstract arrays) of a pytree."""
  return sum(_aval_bytes(leaf) for leaf in jax.tree.leaves(tree))


def _read_int(path: str) -> int | None:
  try:
    with open(path) as f:
      text = f.read().strip()
  except OSError:
    return None
  return int(text) if text.isdigit() else None


def host_available_bytes() -> int | None:
  """Memory this process can still take: the kernel's MemAvailable, less
  where a container (cgroup) limit is lower; None when unknown."""
  found = []
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          found.append(int(line.split()[1]) * 1024)
  except (OSError, ValueError, IndexError):
    pass
  for limit_file, usage_file in (
      ('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory.current'),
      ('/sys/fs/cgroup/memory/memory.limit_in_bytes',
       '/sys/fs/cgroup/memory/memory.usage_in_bytes')):
    limit, usage = _read_int(limit_file), _read_int(usage_file)
    if limit is not None and usage is not None and limit < 2**60:
      found.append(limit - usage)
  if not found and hasattr(os, 'sysconf'):
    try:
      found.append(os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE'))
    except (ValueError, OSError):
      pass
  return min(found) if found else None


def device_available_bytes(device: jax.Device | None = None) -> int | None:
  """Free memory of an accelerator (its allocator's limit less what is in
  use), or of the host for a CPU device; None when unknown."""
  device = device or jax.devices()[0]
  if device.platform == 'cpu':
    return host_available_bytes()
  stats = device.memory_stats() or {}
  limit = stats.get('bytes_limit')
  return None if limit is None else limit - stats.get('bytes_in_use', 0)


def format_bytes(num: float) -> str:
  """1234567 -> '1.2 MB' (powers of 1000, as memory is usually quoted)."""
  for unit in ('B', 'kB', 'MB', 'GB'):
    if abs(num) < 1000:
      return f'{num:.0f} {unit}' if unit == 'B' else f'{num:.1f} {unit}'
    num /= 1000
  return f'{num:.1f} TB'
