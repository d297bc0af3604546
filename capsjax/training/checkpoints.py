"""Atomic orbax checkpoints of a TrainState, and trained models read back.

Orbax writes each step into a temporary directory and renames it when
complete, so a kill mid-save leaves the previous step restorable.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx

from capsjax.training.state import TrainState
from capsjax.training.state import create_model
from capsjax.training.state import init_train_state
from capsjax.training.state import make_optimizer


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
  """Drops the tracebacks of a failed save's aborted writes: orbax's worker
  thread logs one, and asyncio one per write task it never awaited."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR:
      return True
    if f'{os.sep}orbax{os.sep}' in record.pathname:
      return False
    message = record.getMessage()
    return not ('exception was never retrieved' in message and
                'orbax' in message)


def _drop_closed_loop_errors(unraisablehook):
  """``unraisablehook`` less the 'Event loop is closed' tracebacks that the
  tensorstore callbacks of a failed save print, during or after it."""

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError) and
            'Event loop is closed' in str(unraisable.exc_value)):
      unraisablehook(unraisable)

  return hook


@contextlib.contextmanager
def _quiet_failed_save():
  """A failed save is reported once, by ``Checkpointer.save``'s own error
  (which chains orbax's), not also as a screenful of stack traces. Those
  arrive during the save and after it (when the aborted tasks are collected),
  so after a failure the filters stay; after a success they are removed."""
  loggers = [logging.getLogger('absl'), logging.getLogger('asyncio')]
  noise, previous_hook = _SaveNoiseFilter(), sys.unraisablehook
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
  """Orbax checkpoints of a TrainState under ``directory``."""

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
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True,
            enable_async_checkpointing=False))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

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
        self._manager.save(step, args=ocp.args.StandardSave(leaves))
        self._manager.wait_until_finished()
    except (OSError, ValueError) as e:
      if not _is_storage_error(e):
        raise
      raise OSError(
          f'saving the checkpoint of step {step} to {self.directory} failed '
          f'({e}); the previous checkpoint is intact. Free disk space or '
          f'choose another --workdir, then rerun to resume.') from e

  def restore(self, template: TrainState, step: int | None = None
              ) -> TrainState:
    step = self.latest_step() if step is None else step
    leaves, treedef = jax.tree.flatten(template)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                for x in _saveable(leaves)]
    restored = self._manager.restore(step,
                                     args=ocp.args.StandardRestore(abstract))
    return jax.tree.unflatten(treedef, _from_saveable(list(restored), leaves))

  def close(self) -> None:
    self._manager.close()


def read_workdir_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a training run saved in ``workdir/config.json``."""
  config_path = os.path.join(workdir, 'config.json')
  if not os.path.exists(config_path):
    raise FileNotFoundError(
        f'{config_path} not found: {workdir} is not a capsjax workdir.')
  with open(config_path) as f:
    return ml_collections.ConfigDict(json.load(f))


def load_trained_state(workdir: str, which: str = 'selected'
                       ) -> tuple[nnx.GraphDef, TrainState]:
  """The graphdef and train state saved in ``workdir`` (its config.json and
  checkpoint); ``which``: 'selected' (the tested model: 'best', or 'latest'
  when the config sets ``select_on_validation`` False), 'best' (of
  validation accuracy) or 'latest'."""
  if which not in ('selected', 'best', 'latest'):
    raise ValueError(f"which must be 'selected', 'best' or 'latest', got "
                     f'{which!r}.')
  config = read_workdir_config(workdir)
  if which == 'selected':
    which = 'best' if config.get('select_on_validation', True) else 'latest'

  try:
    model = create_model(config)
  except (AttributeError, KeyError) as e:
    key = str(e).strip('"\'')
    raise ValueError(f'{os.path.join(workdir, "config.json")} lacks the key '
                     f'{key!r}: not a complete capsjax config.') from e
  graphdef, state = init_train_state(model, make_optimizer(config))
  directory = os.path.join(workdir, 'best' if which == 'best' else
                           'checkpoints')
  checkpointer = Checkpointer(directory)
  if checkpointer.latest_step() is None:
    raise FileNotFoundError(f'no checkpoint in {directory}; train first.')
  state = checkpointer.restore(state)
  checkpointer.close()
  return graphdef, state


def load_trained_model(workdir: str, which: str = 'selected') -> nnx.Module:
  """The model trained in ``workdir`` (see ``load_trained_state``)."""
  graphdef, state = load_trained_state(workdir, which)
  return nnx.merge(graphdef, state.params, state.model_state)
