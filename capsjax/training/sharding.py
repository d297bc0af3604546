"""Data parallelism and the deterministic data order.

One mesh axis 'data' over the local devices, or over the devices of every
process of a multi-process (--distributed) run. The batch of a step depends
only on (seed, step), so a resumed run sees exactly the batches an
uninterrupted run would.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> None:
  """Join a multi-process run: ``jax.distributed.initialize`` with these
  arguments (None: detected from SLURM, Open MPI, Kubernetes or a TPU pod).
  Call it first, before anything touches a device. Every process then runs
  the same program; the mesh of ``fit`` spans the devices of all of them."""
  # CPU processes reduce across each other with gloo; GPUs ignore the option.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes,
                             process_id=process_id)


def is_chief() -> bool:
  """Whether this process writes the run's files (process 0)."""
  return jax.process_index() == 0


def all_agree(flag: bool) -> bool:
  """Process 0's ``flag`` on every process (clocks differ; loops must not)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils
  return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def make_mesh(num_devices: int | None = None) -> Mesh:
  """One 'data' axis over the first ``num_devices`` local devices (all when
  None), or over every device of every process in a multi-process run."""
  devices = (jax.devices() if jax.process_count() > 1 else
             jax.local_devices()[:num_devices])
  return Mesh(np.asarray(devices), ('data',))


def on_mesh(array, sharding: NamedSharding) -> jax.Array:
  """A host array (the same on every process) placed with ``sharding``."""
  return jax.device_put(np.asarray(array), sharding)


@functools.partial(jax.jit, static_argnums=2)
def _take(array: jax.Array, indices: jax.Array, sharding: NamedSharding
          ) -> jax.Array:
  return jax.lax.with_sharding_constraint(array[indices], sharding)


def take_batch(array: jax.Array, indices: np.ndarray, mesh: Mesh
               ) -> jax.Array:
  """``array[indices]`` split over the mesh's data axis.

  Args:
    array: [N, ...] replicated on the mesh.
    indices: [B] host ints, the same on every process.
  Returns:
    [B, ...] sharded along B.
  """
  return _take(array, on_mesh(indices, replicated(mesh)), batch_sharded(mesh))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec('data'))


def check_batch_size(batch_size: int, mesh: Mesh) -> None:
  if batch_size % mesh.size:
    raise ValueError(
        f'batch_size {batch_size} is not divisible by the {mesh.size} devices '
        f'of the data-parallel mesh; use a multiple of {mesh.size}.')


def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


class BatchOrder:
  """Indices of the training batch of each step (drops the epoch remainder)."""

  def __init__(self, num_examples: int, batch_size: int, seed: int):
    if num_examples < batch_size:
      raise ValueError(
          f'the training split has {num_examples} examples, fewer than '
          f'batch_size {batch_size}.')
    self.batch_size = batch_size
    self.seed = seed
    self.num_examples = num_examples
    self.steps_per_epoch = num_examples // batch_size
    self._epoch, self._perm = -1, None

  def indices(self, step: int) -> np.ndarray:
    epoch, offset = divmod(step, self.steps_per_epoch)
    if epoch != self._epoch:
      self._epoch = epoch
      self._perm = epoch_permutation(self.seed, epoch, self.num_examples)
    start = offset * self.batch_size
    return self._perm[start:start + self.batch_size]
