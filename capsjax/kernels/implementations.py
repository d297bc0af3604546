"""Every implementation capsjax has, what each can take, and the choice.

capsjax chooses how an operation runs as ``jax.nn.dot_product_attention``
does: the keyword ``implementation``, the same at every level (the
functions of ``capsjax.kernels``, the layers, the models, the configs'
``model_options.implementation`` and so the command line). Its values:

- ``None``: the fastest implementation that can take the case, in the
  order ``DEFAULT_ORDER`` gives (measured: BENCHMARKS.md);
- ``'xla'``: XLA's own operations (``capsjax.routing``): every backend,
  every option, derivatives of any order;
- ``'native'``: capsjax's C++ kernels for the CPU, called through XLA's
  FFI and compiled on first use with the machine's C++ compiler: the fused
  EM window kernel (``em_cpu``) and oneDNN's convolutions
  (``conv.onednn``, the ``onednn`` extra);
- ``'pallas'``: Pallas kernels (Triton on GPUs, interpreted elsewhere;
  first-order gradients only): ``pallas_dynamic``, ``pallas_em``.

A named implementation that cannot take a case raises ``ValueError``
saying why. In a model, a named implementation applies to each of the
model's operations that has it (``'pallas'`` routes with Pallas and leaves
the convolutions to their default). The one environment switch,
``CAPSJAX_IMPLEMENTATION=xla``, makes every ``None`` choose XLA (for
debugging: the portable path everywhere); named implementations are kept.

Each choice, and for ``None`` why a faster implementation could not take
the case, is recorded inside ``recording()``; the training loop
records its model's choices once per run (its header and summary.json).
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping

NAMES = ('xla', 'native', 'pallas')
# The operations with more than one implementation, and theirs.
OPS: Mapping[str, tuple[str, ...]] = {
    'dynamic_routing': ('xla', 'pallas'),
    'conv_capsule_routing': ('xla', 'native', 'pallas'),
    'conv2d': ('xla', 'native'),
}
# What None tries, in order, where each can take the case. The Pallas
# kernels are not the default: on an H100 the dynamic-routing kernel ran at
# 0.66-0.99x and the EM window kernel at 0.95-1.31x of XLA's routing
# (results/benchmarks/gpu_h100), not faster throughout.
DEFAULT_ORDER: Mapping[str, tuple[str, ...]] = {
    'dynamic_routing': ('xla',),
    'conv_capsule_routing': ('native', 'xla'),
    'conv2d': ('native', 'xla'),
}
ENVIRONMENT_VARIABLE = 'CAPSJAX_IMPLEMENTATION'

# Why-not functions: () -> '' when the implementation can take the case,
# else the reason in words.
WhyNot = Callable[[], str]


def check(implementation, op: str | None = None,
          name: str = 'implementation') -> None:
  """ValueError unless ``implementation`` is None or a name (one of
  ``op``'s, when ``op`` is given)."""
  allowed = NAMES if op is None else OPS[op]
  if implementation is not None and implementation not in allowed:
    what = 'capsjax' if op is None else op
    raise ValueError(
        f'{name} must be None (the fastest available) or one of {what}\'s '
        f'implementations {allowed}, got {implementation!r}.')


def for_op(implementation, op: str) -> str | None:
  """A model's or layer's ``implementation`` as one operation takes it:
  the name where ``op`` has it, else None (its default)."""
  return implementation if implementation in OPS[op] else None


def forced_xla() -> bool:
  """Whether ``CAPSJAX_IMPLEMENTATION=xla`` makes every None choose XLA."""
  value = os.environ.get(ENVIRONMENT_VARIABLE, '')
  if value not in ('', 'xla'):
    raise ValueError(f'{ENVIRONMENT_VARIABLE} must be unset or "xla", got '
                     f'{value!r}.')
  return value == 'xla'


def choose(op: str, implementation, why_not: Mapping[str, WhyNot]) -> str:
  """The implementation ``op`` runs with.

  Args:
    op: a key of ``OPS``.
    implementation: None or one of ``OPS[op]``.
    why_not: for each of ``op``'s implementations but 'xla', a function
      that says why it cannot take this case ('' when it can).
  Returns:
    The named implementation, or for None the first of
    ``DEFAULT_ORDER[op]`` that can take the case (recorded with the
    reasons of those before it).
  Raises:
    ValueError: a named implementation cannot take the case.
  """
  check(implementation, op)
  if implementation is not None:
    reason = why_not[implementation]() if implementation != 'xla' else ''
    if reason:
      raise ValueError(f"{op}: implementation={implementation!r} cannot take "
                       f'this case: {reason}. Use implementation=None or '
                       f"'xla'.")
    _record(op, implementation, 'named')
    return implementation
  passed = []
  if forced_xla():
    passed.append(f'{ENVIRONMENT_VARIABLE}=xla')
    chosen = 'xla'
  else:
    for name in DEFAULT_ORDER[op]:
      reason = why_not[name]() if name != 'xla' else ''
      if not reason:
        chosen = name
        break
      passed.append(f'not {name}: {reason}')
  _record(op, chosen, '; '.join(passed))
  return chosen


_recordings: list[collections.Counter] = []


def _record(op: str, chosen: str, reason: str) -> None:
  for counter in _recordings:
    counter[(op, chosen, reason)] += 1


@contextlib.contextmanager
def recording() -> Iterator[collections.Counter]:
  """Inside: every choice counted as (op, chosen, why) -> how many traced
  calls; why is 'named' for a named implementation, else why not the
  faster ones ('' when the first could)."""
  counter = collections.Counter()
  _recordings.append(counter)
  try:
    yield counter
  finally:
    _recordings.remove(counter)


def describe(counter: collections.Counter) -> dict[str, str]:
  """A recording in words, one entry per operation: {'conv2d': 'native
  (3 calls)', 'conv_capsule_routing': 'xla (2 calls; not native: ...)'}."""
  words: dict[str, list[str]] = {}
  for (op, chosen, reason), count in sorted(counter.items()):
    words.setdefault(op, []).append(
        f'{chosen} ({count} call{"s" if count > 1 else ""}'
        f'{"; " + reason if reason else ""})')
  return {op: ', '.join(choices) for op, choices in words.items()}
