"""Alternated timing of several calls in one process, for the layer benchmarks.

Each call is run ``warmup`` times (2 by default) to warm up, then
``rounds`` times in turn, ``reps`` calls at a time; the result is each
call's median seconds per call. Timing the sides in turn, in one process,
exposes them to the same load, so their ratio means more than either time
on a shared machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from capsjax.training import host_memory


def retain_host_memory() -> str:
  """glibc keeps the memory XLA:CPU frees, as the experiments run (call it
  before JAX starts its backend); returns what was done, in words."""
  return host_memory.retain_freed_memory()


def time_calls_alternately(calls: dict[str, Callable[[], object]],
                           rounds: int, reps: int = 3, warmup: int = 2
                           ) -> dict[str, float]:
  """{name: callable that blocks until done} -> {name: median s per call}."""
  times: dict[str, list[float]] = {name: [] for name in calls}
  for fn in calls.values():
    for _ in range(warmup):
      fn()
  for _ in range(rounds):
    for name, fn in calls.items():
      start = time.perf_counter()
      for _ in range(reps):
        fn()
      times[name].append((time.perf_counter() - start) / reps)
  return {name: float(np.median(ts)) for name, ts in times.items()}
