"""Atomic, verified orbax checkpoints of a TrainState; the workdir lock;
trained models read back.

Orbax writes each step into a temporary directory and renames it when
complete, so a kill mid-save leaves the previous step restorable. Each step
also holds a digest (SHA-256) of every array saved, published by the same
rename; a restore recomputes it, so a damaged or incomplete checkpoint is
refused rather than trained on or tested.

A workdir has one writer: ``hold_workdir`` takes an OS lock (``flock``) on
``WORKDIR/capsjax.lock`` that the kernel frees when its holder exits, however
it dies.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from capsjax import models
from capsjax.training.defaults import fill_defaults
from capsjax.training.state import TrainState
from capsjax.training.state import create_model
from capsjax.training.state import init_train_state
from capsjax.training.state import make_optimizer

# ----------------------------------------------------------------------------
# The workdir lock: one writer per workdir.

LOCK_FILE = 'capsjax.lock'


class WorkdirBusy(OSError):
  """Another process holds the workdir; the message names it."""


def lock_path(workdir: str, process_index: int = 0) -> str:
  """The lock file of one process of a job in ``workdir``.

  Each process of a multi-process job holds its own (process 0
  ``capsjax.lock``, process i ``capsjax.process_i.lock``): the processes of
  one job share the workdir, and any process of a second job is refused.
  """
  name = (LOCK_FILE if process_index == 0 else
          f'capsjax.process_{process_index}.lock')
  return os.path.join(workdir, name)


class _Hold:
  """An open lock file of this process: how many holds, their kind, and
  what its first hold created (the lock file, the workdir's missing
  folders, innermost first)."""

  def __init__(self, fd: int | None, shared: bool, created_file: bool = False,
               made_dirs: tuple[str, ...] = ()):
    self.fd, self.shared, self.count = fd, shared, 0
    self.created_file, self.made_dirs = created_file, made_dirs


# The locks this process holds, by path: a hold inside another (the launcher
# around ``fit``, ``fit`` around a model's load) reuses the open file, since
# flock would refuse a second open file of the same process.
_HELD: dict[str, _Hold] = {}
_HELD_GUARD = threading.Lock()


def _holder_record(purpose: str) -> str:
  return json.dumps({
      'host': socket.gethostname(), 'pid': os.getpid(), 'purpose': purpose,
      'since': time.strftime('%Y-%m-%d %H:%M:%S %Z')}) + '\n'


def _read_holder(fd: int) -> dict[str, Any] | None:
  """The holder's record; None when unreadable (being rewritten: retried
  briefly)."""
  for _ in range(10):
    try:
      record = json.loads(os.pread(fd, 4096, 0).decode() or 'null')
    except (ValueError, UnicodeDecodeError):
      record = None
    if isinstance(record, dict):
      return record
    time.sleep(0.05)
  return None


def _describe_holder(record: dict[str, Any] | None) -> str:
  if record is None:
    return 'another process'
  return (f"{record.get('purpose', 'another process')} (pid "
          f"{record.get('pid', '?')} on {record.get('host', '?')}, since "
          f"{record.get('since', '?')})")


def _busy_message(workdir: str, fd: int, shared: bool) -> str:
  """Why ``workdir`` is refused: its writer, or (to a writer) readers."""
  if not shared:
    try:  # readers alone hold it shared; a writer excludes this too
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
      return (f'{workdir} is being read by another process (a model loaded '
              f'from its checkpoint); rerun in a moment.')
    except BlockingIOError:
      pass
  holder = _describe_holder(_read_holder(fd))
  return (f'{workdir} is in use by {holder}; wait for it to finish or stop '
          f'it, then rerun (the lock frees itself when that process exits). '
          f'Two processes on one workdir overwrite each other\'s '
          f'checkpoints; use another --workdir for a second run.')


def _missing_dirs(folder: str) -> tuple[str, ...]:
  """The folders of ``folder``'s path that do not exist, innermost first."""
  missing = []
  while folder != os.path.dirname(folder) and not os.path.isdir(folder):
    missing.append(folder)
    folder = os.path.dirname(folder)
  return tuple(missing)


def _open_lock_file(path: str) -> tuple[int, bool]:
  """The lock file opened for writing, and whether this call created it."""
  try:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
  except FileExistsError:
    return os.open(path, os.O_RDWR), False


def _still_named(path: str, fd: int) -> bool:
  """Whether ``path`` still names the open file ``fd`` (not removed, or
  replaced, since it was opened)."""
  try:
    named, opened = os.stat(path), os.fstat(fd)
  except OSError:
    return False
  return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


# Tries to lock a lock file that its holder removed meanwhile (``_release``).
_ACQUIRE_TRIES = 20


def _acquire(path: str, purpose: str, shared: bool) -> _Hold:
  """The open, locked file; its fd None on a filesystem without locks
  (said), or for a reader of a workdir that does not exist (never created
  by a reader) or that it cannot write."""
  workdir = os.path.dirname(path)
  for _ in range(_ACQUIRE_TRIES):
    made = () if shared else _missing_dirs(workdir)
    try:
      if not shared:
        os.makedirs(workdir, exist_ok=True)
      fd, created = _open_lock_file(path)
    except FileNotFoundError:
      if shared:  # nothing there to read, nor to exclude
        return _Hold(None, shared)
      continue  # removed by a run that never started: made again
    except OSError as e:
      if shared:  # a reader of a workdir it cannot write: nothing to exclude
        return _Hold(None, shared)
      raise OSError(f'cannot write to the workdir {workdir} '
                    f'({e.strerror or e}); choose a --workdir you can write '
                    f'to.') from e
    try:
      fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) |
                  fcntl.LOCK_NB)
    except BlockingIOError:
      message = _busy_message(workdir, fd, shared)
      os.close(fd)
      raise WorkdirBusy(message) from None
    except OSError as e:
      os.close(fd)
      if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
        raise
      print(f'Warning: {workdir} cannot be locked ({e.strerror}); make sure '
            f'no other process uses it.', file=sys.stderr)
      return _Hold(None, shared)
    if not _still_named(path, fd):
      # Its holder removed it before unlocking it: a lock on that file
      # would exclude nobody.
      os.close(fd)
      continue
    if not shared:
      _write_holder(fd, purpose)
    return _Hold(fd, shared, created, made if created else ())
  raise OSError(f'cannot lock {path}: it was removed {_ACQUIRE_TRIES} times '
                f'while being opened; rerun.')


def _only_lock_files(workdir: str) -> bool:
  """Whether ``workdir`` holds nothing but lock files (nothing written)."""
  try:
    names = os.listdir(workdir)
  except OSError:
    return False
  return all(re.fullmatch(r'capsjax(\.process_\d+)?\.lock', name)
             for name in names)


def _release(path: str, hold: _Hold) -> None:
  """Closes the lock file (which unlocks it). A lock file this hold created
  in a workdir where nothing else was written (a run that failed before it
  started) is removed first, while still locked, then the folders the hold
  made, when empty: a failed start leaves nothing behind."""
  if hold.fd is None:
    return
  remove = hold.created_file and _only_lock_files(os.path.dirname(path))
  if remove:
    with contextlib.suppress(OSError):
      os.unlink(path)
  os.close(hold.fd)
  for folder in hold.made_dirs if remove else ():
    try:
      os.rmdir(folder)  # only when empty
    except OSError:
      break


def _write_holder(fd: int, purpose: str) -> None:
  os.ftruncate(fd, 0)
  os.pwrite(fd, _holder_record(purpose).encode(), 0)


def stop_signals() -> tuple[int, ...]:
  """The signals that ask a run to save its checkpoint and stop: SIGINT,
  SIGTERM (a scheduler's warning) and SIGHUP (its terminal closed), unless
  SIGHUP is ignored (``nohup``), which then stays ignored."""
  hangup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (
      signal.SIGHUP,)
  return (signal.SIGINT, signal.SIGTERM) + hangup


@contextlib.contextmanager
def hold_workdir(workdir: str, purpose: str = 'training', *,
                 process_index: int = 0, shared: bool = False
                 ) -> Iterator[None]:
  """Holds ``workdir`` for this process while the block runs.

  Exclusive (``shared`` False) for a process that writes the workdir: its
  host, pid, start time and ``purpose`` go into the lock file for the
  message another process gets. Shared for one that only reads checkpoints:
  readers exclude writers, not each other. The kernel frees the lock when
  the process exits, however it dies, so a stale lock never needs removing;
  the file stays (its lock, not its existence, is what counts), except
  where the hold created it and nothing else was written in the workdir (a
  run that stopped before it started): then the file goes, and the
  workdir too when the hold created it. A reader never creates a workdir.
  Nested holds of one process are one hold; a shared one inside an
  exclusive one changes nothing.

  Raises:
    WorkdirBusy: another process holds it, named in the one-line message.
  """
  # One key per file, however the workdir is spelt (relative, symlinked).
  path = lock_path(os.path.realpath(workdir), process_index)
  with _HELD_GUARD:
    hold = _HELD.get(path)
    if hold is None:
      hold = _HELD[path] = _acquire(path, purpose, shared)
    elif hold.shared and not shared and hold.fd is not None:
      try:  # a writer inside a reader of the same process
        fcntl.flock(hold.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        raise WorkdirBusy(_busy_message(os.path.dirname(path), hold.fd,
                                        False)) from None
      _write_holder(hold.fd, purpose)
      hold.shared = False
    hold.count += 1
  try:
    yield
  finally:
    with _HELD_GUARD:
      hold.count -= 1
      if hold.count == 0:
        del _HELD[path]
        _release(path, hold)


# ----------------------------------------------------------------------------
# Array digests, saved with each checkpoint.

DIGEST_ITEM = 'digest'  # the orbax item beside 'default' (the arrays)


class CheckpointDamaged(OSError):
  """A checkpoint cannot be read, or its arrays differ from its digest."""

  def __init__(self, message: str, reason: str = ''):
    super().__init__(message)
    self.reason = reason or message


def _host_array(x) -> np.ndarray:
  """The value of one saved leaf on this host (a replicated array's local
  copy: in a multi-process run it is not fully addressable)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(x.addressable_data(0))
  return np.asarray(x)


def _array_digest(x) -> list[Any]:
  """[dtype, shape, SHA-256 of the C-order bytes] of one array."""
  array = np.asarray(_host_array(x), order='C')  # keeps 0-d arrays 0-d
  data = array.reshape(-1).view(np.uint8)  # any dtype, bfloat16 included
  return [array.dtype.name, list(array.shape),
          hashlib.sha256(data).hexdigest()]


def _digest_record(leaves: list[Any]) -> dict[str, Any]:
  """What is saved as the digest item: one entry per array, and a hash of
  the entries themselves, so that a damaged digest is told from a damaged
  array."""
  arrays = [_array_digest(x) for x in leaves]
  return {'algorithm': 'sha256', 'arrays': arrays,
          'check': _entries_hash(arrays)}


def _entries_hash(arrays: list[Any]) -> str:
  return hashlib.sha256(json.dumps(arrays).encode()).hexdigest()


def _describe(entry: list[Any]) -> str:
  return f"{entry[0]}[{','.join(str(n) for n in entry[1])}]"


def _digest_problem(record: Any, leaves: list[Any]) -> str:
  """'' when ``leaves`` match the digest ``record``; else why not."""
  if not (isinstance(record, dict) and isinstance(record.get('arrays'), list)
          and record.get('check') == _entries_hash(record['arrays'])):
    return 'its digest is damaged'
  if len(record['arrays']) != len(leaves):
    return (f"its digest lists {len(record['arrays'])} arrays, the model "
            f'{len(leaves)}')
  for i, (saved, x) in enumerate(zip(record['arrays'], leaves, strict=True)):
    if _array_digest(x) != saved:
      return f'array {i} ({_describe(saved)}) differs from its digest'
  return ''


def _first_line(error: BaseException, limit: int = 120) -> str:
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  text = lines[0] if lines else type(error).__name__
  return text if len(text) <= limit else text[:limit - 3] + '...'


def _root_cause(error: BaseException) -> str:
  """The first line of the innermost error of a chain (tensorstore's, under
  orbax's wrappers), less tensorstore's driver-by-driver preamble."""
  while error.__cause__ is not None or (
      error.__context__ is not None and not error.__suppress_context__):
    error = error.__cause__ or error.__context__
  text = re.sub(r'Error opening "\w+" driver: ', '', str(error))
  return _first_line(ValueError(text or type(error).__name__))


def _sync(tag: str) -> None:
  """All processes of a multi-process run reach this point."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(tag)


class Restored(NamedTuple):
  """A checkpoint read back: its state, step, and whether a digest checked
  it (False: saved by an older capsjax, without one)."""
  state: Any
  step: int
  verified: bool


def _saveable(tree):
  """Typed PRNG keys -> raw key data (what orbax can write)."""
  return jax.tree.map(
      lambda x: jax.random.key_data(x)
      if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree)


def _from_saveable(tree, template):
  return jax.tree.map(
      lambda x, t: jax.random.wrap_key_data(x, impl=jax.random.key_impl(t))
      if jnp.issubdtype(t.dtype, jax.dtypes.prng_key) else x, tree, template)


# Tensorstore, which writes the arrays, reports a full or read-only disk as a
# ValueError ("RESOURCE_EXHAUSTED: ... No space left on device
# [os_error_code='28']"), not an OSError.
_STORAGE_ERROR_MARKERS = ('os_error_code', 'RESOURCE_EXHAUSTED',
                          'PERMISSION_DENIED', 'No space left',
                          'Read-only file system', 'Permission denied')


def _is_storage_error(error: BaseException) -> bool:
  return isinstance(error, OSError) or any(
      marker in str(error) for marker in _STORAGE_ERROR_MARKERS)


class _SaveNoiseFilter(logging.Filter):
  """Drops the tracebacks of a failed save's or restore's aborted tasks:
  orbax's worker thread logs one, and asyncio one per task it never
  awaited; for a restore, also orbax's warnings about the files it could
  not read (the restore's one-line report names the checkpoint)."""

  def __init__(self, min_level: int = logging.ERROR):
    super().__init__()
    self.min_level = min_level

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < self.min_level:
      return True
    if f'{os.sep}orbax{os.sep}' in record.pathname:
      return False
    message = record.getMessage()
    return not ('exception was never retrieved' in message and
                'orbax' in message)


def _drop_closed_loop_errors(unraisablehook):
  """``unraisablehook`` less the 'Event loop is closed' tracebacks that the
  tensorstore callbacks of a failed save print, during or after it, and
  the errors of orbax's read coroutines that a failed restore abandons."""

  def hook(unraisable):
    code = getattr(unraisable.object, 'cr_code', None)
    if isinstance(unraisable.exc_value, RuntimeError) and (
        'Event loop is closed' in str(unraisable.exc_value)):
      return
    if code is not None and f'{os.sep}orbax{os.sep}' in code.co_filename:
      return
    unraisablehook(unraisable)

  return hook


@contextlib.contextmanager
def _quiet_failed_save(min_level: int = logging.ERROR):
  """A failed save (or restore) is reported once, by ``Checkpointer``'s own
  error (which chains orbax's), not also as a screenful of stack traces.
  Those arrive during the save and after it (when the aborted tasks are
  collected), so after a failure the filters stay; after a success they are
  removed."""
  loggers = [logging.getLogger('absl'), logging.getLogger('asyncio')]
  noise, previous_hook = _SaveNoiseFilter(min_level), sys.unraisablehook
  for logger in loggers:
    logger.addFilter(noise)
  sys.unraisablehook = _drop_closed_loop_errors(previous_hook)
  try:
    yield
  except BaseException:
    # The aborted write coroutines are collected later, as late as
    # interpreter shutdown, each warning that it was never awaited.
    warnings.filterwarnings('ignore', message=r"coroutine '.*' was never "
                            r'awaited', category=RuntimeWarning)
    raise  # leaving the filters in place
  for logger in loggers:
    logger.removeFilter(noise)
  sys.unraisablehook = previous_hook


class Checkpointer:
  """Orbax checkpoints of a TrainState under ``directory``, each step with
  the digest of its arrays (``directory/STEP/digest``)."""

  def __init__(self, directory: str, max_to_keep: int = 2):
    self.directory = os.path.abspath(directory)
    try:
      os.makedirs(self.directory, exist_ok=True)
      probe = os.path.join(self.directory,
                           f'.write_test.{jax.process_index()}')
      with open(probe, 'w') as f:
        f.write('ok')
      os.remove(probe)
    except OSError as e:
      raise OSError(
          f'cannot write checkpoints to {self.directory}: {e}. Choose a '
          f'writable --workdir with free space.') from e
    # Named items: 'default' holds the arrays where an older capsjax put
    # them (it reads these checkpoints, and they read its own).
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True,
            enable_async_checkpointing=False),
        item_names=('default', DIGEST_ITEM))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def steps(self) -> list[int]:
    """The committed steps on disk, newest first."""
    return sorted((int(name) for name in os.listdir(self.directory)
                   if name.isdigit() and
                   os.path.isdir(os.path.join(self.directory, name))),
                  reverse=True)

  @staticmethod
  def exists(directory: str) -> bool:
    """Whether ``directory`` holds a committed checkpoint (orbax names each
    finished step's directory by the step alone), without opening it."""
    return os.path.isdir(directory) and any(
        name.isdigit() for name in os.listdir(directory))

  def save(self, state: TrainState) -> None:
    step = int(state.step)
    if step in self._manager.all_steps():
      return
    leaves = _saveable(jax.tree.leaves(state))
    try:
      with _quiet_failed_save():
        # The digest is an item of the step, so orbax's rename publishes
        # it with the arrays: no checkpoint is ever without its digest.
        self._manager.save(step, args=ocp.args.Composite(**{
            'default': ocp.args.StandardSave(leaves),
            DIGEST_ITEM: ocp.args.JsonSave(_digest_record(leaves))}))
        self._manager.wait_until_finished()
    except (OSError, ValueError) as e:
      if not _is_storage_error(e):
        raise
      raise OSError(
          f'saving the checkpoint of step {step} to {self.directory} failed '
          f'({e}); the previous checkpoint is intact. Free disk space or '
          f'choose another --workdir, then rerun to resume.') from e

  def _has_digest(self, step: int) -> bool:
    return os.path.isdir(os.path.join(self.directory, str(step),
                                      DIGEST_ITEM))

  def restore_checked(self, template: TrainState, step: int) -> Restored:
    """The checkpoint of ``step``, checked against its digest.

    Raises:
      CheckpointDamaged: it cannot be read, or its arrays differ from the
        digest, or its digest is missing while other steps have one.
    """
    where = f'the checkpoint of step {step} in {self.directory}'

    def damaged(reason: str) -> CheckpointDamaged:
      return CheckpointDamaged(f'{where} is damaged ({reason})', reason)

    verified = self._has_digest(step)
    if not verified and any(self._has_digest(s) for s in self.steps()
                            if s != step):
      # Its siblings were saved by this capsjax, which always writes one.
      raise damaged('its digest is missing')
    leaves, treedef = jax.tree.flatten(template)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                for x in _saveable(leaves)]
    items = {'default': ocp.args.StandardRestore(abstract)}
    if verified:
      items[DIGEST_ITEM] = ocp.args.JsonRestore()
    try:
      with _quiet_failed_save(logging.WARNING):
        restored = self._manager.restore(step,
                                         args=ocp.args.Composite(**items))
        arrays = list(restored['default'])
    except (jax.errors.JaxRuntimeError, MemoryError):
      raise  # the device or host, not the files
    except Exception as e:  # noqa: BLE001
      # Tensorstore reports unreadable, truncated or missing files as
      # ValueError, orbax some as a bare Exception; a damaged JSON file
      # surfaces as any of ValueError, KeyError or TypeError.
      raise damaged(f'cannot be read: {_root_cause(e)}') from e
    if verified:
      record = restored[DIGEST_ITEM]
      self._check_shapes(record, abstract, where)
      if problem := _digest_problem(record, arrays):
        raise damaged(problem)
    state = jax.tree.unflatten(treedef, _from_saveable(arrays, leaves))
    return Restored(state, step, verified)

  @staticmethod
  def _check_shapes(record: Any, abstract: list[Any], where: str) -> None:
    """ValueError when an intact digest lists other arrays than the model's:
    another config, not damage."""
    if not (isinstance(record, dict) and isinstance(record.get('arrays'),
                                                     list) and
            record.get('check') == _entries_hash(record['arrays'])):
      return  # a damaged digest: _digest_problem says so
    expected = [[jnp.dtype(x.dtype).name, list(x.shape)] for x in abstract]
    saved = [entry[:2] for entry in record['arrays']]
    if saved != expected:
      raise ValueError(
          f'{where} holds other arrays than this model ({len(saved)} saved, '
          f'{len(expected)} expected; the first difference: '
          f'{_first_difference(saved, expected)}); use the config it was '
          f'trained with, or another --workdir.')

  def restore(self, template: TrainState, step: int | None = None
              ) -> TrainState:
    """The checkpoint of ``step`` (default: the latest), verified.

    Raises:
      CheckpointDamaged: it cannot be read or differs from its digest.
    """
    step = self.latest_step() if step is None else step
    return self.restore_checked(template, step).state

  def problem(self, template: TrainState) -> str:
    """'' when the latest checkpoint reads back as saved (or has no digest
    to check), else why not; 'no checkpoint' when there is none."""
    steps = self.steps()
    if not steps:
      return 'no checkpoint'
    try:
      self.restore_checked(template, steps[0])
    except CheckpointDamaged as e:
      return e.reason
    return ''

  def restore_newest_good(self, template: TrainState,
                          report: Callable[[str], None],
                          set_aside: bool = True) -> Restored | None:
    """The newest checkpoint that reads back as saved; None when there is
    none at all.

    Each damaged newer one is reported in one line and, with ``set_aside``
    (a process that holds the workdir), moved to ``DIRECTORY.damaged/`` so
    that training saves that step afresh. A checkpoint without a digest
    (an older capsjax's) is used with a one-line warning.

    Raises:
      CheckpointDamaged: there are checkpoints, and none is good; nothing
        is moved then.
    """
    damaged = []
    for step in self.steps():
      try:
        restored = self.restore_checked(template, step)
      except CheckpointDamaged as e:
        damaged.append((step, e.reason))
        continue
      moved = self.set_aside([s for s, _ in damaged]) if set_aside else {}
      for bad, reason in damaged:
        aside = f'; moved to {moved[bad]}' if bad in moved else ''
        report(f'The checkpoint of step {bad} in {self.directory} is damaged '
               f'({reason}){aside}; using step {step}, the newest good one.')
      if not restored.verified:
        report(f'Warning: the checkpoint of step {step} in {self.directory} '
               f'has no digest (saved by an older capsjax); it is used '
               f'unverified.')
      return restored
    if damaged:
      listed = '; '.join(f'step {s}: {r}' for s, r in damaged)
      raise CheckpointDamaged(
          f'no good checkpoint in {self.directory} ({listed}). Nothing was '
          f'changed: restore the directory from a copy, or move it away to '
          f'start afresh.')
    return None

  def set_aside(self, steps: list[int]) -> dict[int, str]:
    """Moves the directories of ``steps`` into ``DIRECTORY.damaged/`` (kept
    for inspection; orbax no longer sees them); where each went. In a
    multi-process run process 0 moves them, the others wait."""
    if not steps:
      return {}
    aside = self.directory + '.damaged'
    moved = {}
    _sync('capsjax_set_aside_start')
    for step in steps:
      target = os.path.join(aside, str(step))
      copy = 1
      while os.path.exists(target):
        target, copy = os.path.join(aside, f'{step}.{copy}'), copy + 1
      if jax.process_index() == 0:
        os.makedirs(aside, exist_ok=True)
        os.rename(os.path.join(self.directory, str(step)), target)
      moved[step] = target
    _sync('capsjax_set_aside_end')
    self._manager.reload()
    return moved

  def close(self) -> None:
    self._manager.close()


def _first_difference(saved: list[Any], expected: list[Any]) -> str:
  for i, (a, b) in enumerate(zip(saved, expected, strict=False)):
    if a != b:
      return f'array {i}: saved {_describe(a)}, expected {_describe(b)}'
  return 'the count'


def read_workdir_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a training run saved in ``workdir/config.json``, with the
  keys that runs of older versions did not write at their defaults."""
  config_path = os.path.join(workdir, 'config.json')
  if not os.path.exists(config_path):
    raise FileNotFoundError(
        f'{config_path} not found: {workdir} is not a capsjax workdir.')
  with open(config_path) as f:
    return fill_defaults(ml_collections.ConfigDict(json.load(f)))


def load_trained_state(workdir: str, which: str = 'selected'
                       ) -> tuple[nnx.GraphDef, TrainState]:
  """The graphdef and train state saved in ``workdir`` (its config.json and
  checkpoint); ``which``: 'selected' (the tested model: 'best', or 'latest'
  when the config sets ``select_on_validation`` False), 'best' (of
  validation accuracy) or 'latest'.

  The checkpoint is checked against its digest: a damaged latest one is
  said on stderr and the newest good one used; a damaged best one raises
  CheckpointDamaged (no other model stands in for the selected one). It is
  read under a shared hold of the workdir: WorkdirBusy while a run trains
  there."""
  if which not in ('selected', 'best', 'latest'):
    raise ValueError(f"which must be 'selected', 'best' or 'latest', got "
                     f'{which!r}.')
  config = read_workdir_config(workdir)
  if which == 'selected':
    which = 'best' if config.select_on_validation else 'latest'

  try:
    model = create_model(config)
  except (AttributeError, KeyError) as e:
    key = str(e).strip('"\'')
    raise ValueError(f'{os.path.join(workdir, "config.json")} lacks the key '
                     f'{key!r}: not a complete capsjax config.') from e
  except models.ModelNotFound as e:
    raise models.ModelNotFound(
        f'{workdir} holds a model from outside capsjax, {config.model!r}: '
        f'{e}') from e
  graphdef, state = init_train_state(model, make_optimizer(config))
  directory = os.path.join(workdir, 'best' if which == 'best' else
                           'checkpoints')
  # Shared: readers exclude a training run (its checkpoints change under
  # them), not each other.
  with hold_workdir(workdir, shared=True,
                    process_index=jax.process_index()):
    checkpointer = Checkpointer(directory)
    try:
      if not checkpointer.steps():
        raise FileNotFoundError(f'no checkpoint in {directory}; train '
                                f'first.')
      if which == 'latest':
        restored = checkpointer.restore_newest_good(state, _say_to_stderr,
                                                    set_aside=False)
      else:
        restored = _best(checkpointer, state, workdir)
    finally:
      checkpointer.close()
  return graphdef, restored.state


def _say_to_stderr(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def _best(checkpointer: Checkpointer, template: TrainState, workdir: str
          ) -> Restored:
  """The best checkpoint, verified; never another model in its place."""
  try:
    restored = checkpointer.restore_checked(template,
                                            checkpointer.steps()[0])
  except CheckpointDamaged as e:
    raise CheckpointDamaged(
        f'{e}: the model selected on validation is not used. Rerun the '
        f'training command on {workdir} to select one again, or use the '
        f"latest checkpoint (which='latest', --which=latest).",
        e.reason) from e
  if not restored.verified:
    _say_to_stderr(f'Warning: the checkpoint of step {restored.step} in '
                   f'{checkpointer.directory} has no digest (saved by an '
                   f'older capsjax); it is used unverified.')
  return restored


def load_trained_model(workdir: str, which: str = 'selected') -> nnx.Module:
  """The model trained in ``workdir`` (see ``load_trained_state``)."""
  graphdef, state = load_trained_state(workdir, which)
  return nnx.merge(graphdef, state.params, state.model_state)
