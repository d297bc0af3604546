"""Metrics (TensorBoard + JSON lines), the progress bar and the run records."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections

from capsjax.training.sharding import is_chief


class MetricWriter:
  """Scalars to TensorBoard (``workdir/tensorboard``) and ``metrics.jsonl``;
  nothing on the other processes of a multi-process run."""

  def __init__(self, workdir: str):
    self._enabled = is_chief()
    if not self._enabled:
      return
    from tensorboardX import SummaryWriter  # a heavy import: only when training
    self._tb = SummaryWriter(os.path.join(workdir, 'tensorboard'))
    self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a')
    self._workdir = workdir

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    if not self._enabled:
      return
    for name, value in scalars.items():
      self._tb.add_scalar(name, value, step)
    try:
      self._jsonl.write(json.dumps({'step': step, **scalars}) + '\n')
      self._jsonl.flush()
    except OSError as e:
      raise OSError(
          f'writing the metrics of step {step} to {self._workdir} failed '
          f'({e}). Free disk space or choose another --workdir, then rerun to '
          f'resume from the last checkpoint.') from e
    self._tb.flush()

  def __enter__(self) -> MetricWriter:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def close(self) -> None:
    if self._enabled:
      self._tb.close()
      self._jsonl.close()


class Progress:
  """A tqdm bar with loss, accuracy and images/s (quiet when not a terminal)."""

  def __init__(self, total: int, initial: int, batch_size: int):
    from tqdm import tqdm
    interactive = sys.stderr.isatty()
    self._bar = tqdm(total=total, initial=initial, unit='step',
                     dynamic_ncols=True, mininterval=0.5 if interactive else 30,
                     disable=(os.environ.get('CAPSJAX_NO_PROGRESS') == '1' or
                              not is_chief()))
    self._batch_size = batch_size
    self._last_time, self._last_step = time.perf_counter(), initial
    self._scalars: dict[str, str] = {}

  def update(self, step: int, scalars: Mapping[str, float]) -> float:
    """Move to ``step`` with the logged ``scalars``; the images/s since the
    last call."""
    now = time.perf_counter()
    images_per_s = ((step - self._last_step) * self._batch_size /
                    max(now - self._last_time, 1e-9))
    self._last_time, self._last_step = now, step
    self._scalars = {k: f'{v:.4g}' for k, v in scalars.items()}
    self._postfix(images_per_s)
    self._bar.update(step - self._bar.n)
    return images_per_s

  def advance(self, step: int) -> None:
    """Move the bar to ``step`` (finished steps) between logs: it redraws at
    most every half second on a terminal, with tqdm's steps/s and ETA and
    the images/s of its smoothed rate."""
    rate = self._bar.format_dict.get('rate')
    if rate:
      self._postfix(rate * self._batch_size)
    self._bar.update(step - self._bar.n)

  def write(self, message: str) -> None:
    """Print a line to stdout above the bar (not into its line)."""
    self._bar.write(message, file=sys.stdout)
    sys.stdout.flush()

  def _postfix(self, images_per_s: float) -> None:
    self._bar.set_postfix(self._scalars | {'img/s': f'{images_per_s:.0f}'},
                          refresh=False)

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def close(self) -> None:
    self._bar.close()


def _git(*args: str) -> str | None:
  try:
    return subprocess.run(
        ['git', *args], capture_output=True, text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10,
        check=False).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None


def git_commit() -> str | None:
  """HEAD of the checkout this code is in (None outside one). Starts no
  JAX backend."""
  return _git('rev-parse', 'HEAD') or None


def environment() -> dict[str, Any]:
  """Where and with what code this runs: device, versions, git commit (and
  whether the working tree had uncommitted changes)."""
  commit = git_commit()
  status = _git('status', '--porcelain', '--untracked-files=no')
  device = jax.devices()[0]
  return {
      'device': f'{device.platform}:{getattr(device, "device_kind", "")}',
      'num_devices': jax.device_count(),
      'jax_version': jax.__version__,
      'python': platform.python_version(),
      'machine': platform.machine(),
      'cpu_count': os.cpu_count(),
      'git_commit': commit,
      'git_uncommitted_changes': None if commit is None else bool(status),
  }


def flat_config(tree: Any, prefix: str = '') -> dict[str, Any]:
  """A config as JSON gives it ({'a': {'b': 1}}) -> {'a.b': 1}, lists as
  tuples (an empty dict stays a leaf)."""
  if isinstance(tree, dict) and tree:
    out = {}
    for key, value in tree.items():
      out.update(flat_config(value, f'{prefix}{key}.'))
    return out
  return {prefix[:-1]: tuple(tree) if isinstance(tree, list) else tree}


def save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """``workdir/config.json``, written atomically."""
  path = os.path.join(workdir, 'config.json')
  write_text_atomic(path, config.to_json_best_effort(indent=2, sort_keys=True))


def write_text_atomic(path: str, text: str) -> None:
  """``text`` into ``path`` through a temporary file beside it: a kill or
  a full disk mid-write leaves the old file whole. The temporary file is
  this process's and thread's own, so two writers of one file (two suites
  writing one ``--readme``) cannot replace each other's half-written one."""
  tmp = f'{path}.{os.getpid()}.{threading.get_ident()}.tmp'
  try:
    with open(tmp, 'w') as f:
      f.write(text)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def write_json_atomic(path: str, payload: Mapping[str, Any]) -> None:
  write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True,
                                     default=str))
