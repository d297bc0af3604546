"""Tests of the shared training utilities (no model family needed)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from capsjax import train_lib


class _Tiny(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(3, 2, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x, train=False):
    return self.dropout(self.linear(x), deterministic=not train)


def _state():
  model = _Tiny(nnx.Rngs(params=0, dropout=1))
  return train_lib.init_train_state(model, optax.adam(0.1))


def test_batch_order_is_a_function_of_seed_and_step():
  order = train_lib.BatchOrder(103, 10, seed=7)
  assert order.steps_per_epoch == 10
  first_epoch = np.concatenate([order.indices(s) for s in range(10)])
  assert len(np.unique(first_epoch)) == 100  # no repeats within an epoch
  again = train_lib.BatchOrder(103, 10, seed=7)
  np.testing.assert_array_equal(again.indices(13), order.indices(13))
  np.testing.assert_array_equal(again.indices(2), first_epoch[20:30])
  other_seed = train_lib.BatchOrder(103, 10, seed=8)
  assert not np.array_equal(other_seed.indices(0), order.indices(0))
  assert not np.array_equal(order.indices(10), order.indices(0))


def test_batch_order_rejects_batch_larger_than_split():
  with pytest.raises(ValueError, match='fewer than batch_size'):
    train_lib.BatchOrder(5, 10, seed=0)


def test_apply_gradients_skips_nonfinite_update_and_records_step():
  graphdef, state = _state()
  optimizer = optax.adam(0.1)
  grads = jax.tree.map(jnp.ones_like, state.params)
  good, norm = train_lib.apply_gradients(state, grads, state.model_state,
                                         optimizer, jnp.float32(1.0))
  assert int(good.step) == 1 and int(good.nonfinite_step) == -1
  assert float(norm) == pytest.approx(np.sqrt(3 * 2 + 2))
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.any(a != b),
                                       good.params, state.params))
  assert all(bool(m) for m in moved)
  bad_grads = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
  bad, _ = train_lib.apply_gradients(good, bad_grads, good.model_state,
                                     optimizer, jnp.float32(1.0))
  assert int(bad.step) == 2 and int(bad.nonfinite_step) == 1
  for new, old in zip(jax.tree.leaves(bad.params), jax.tree.leaves(good.params),
                      strict=True):
    np.testing.assert_array_equal(new, old)
  # A later finite step does not overwrite the first bad step's number.
  later, _ = train_lib.apply_gradients(bad, grads, bad.model_state, optimizer,
                                       jnp.float32(1.0))
  assert int(later.nonfinite_step) == 1
  inf_loss, _ = train_lib.apply_gradients(good, grads, good.model_state,
                                          optimizer, jnp.float32(jnp.inf))
  assert int(inf_loss.nonfinite_step) == 1


def test_checkpoint_round_trip_keeps_prng_keys(tmp_path):
  graphdef, state = _state()
  model = nnx.merge(graphdef, state.params, state.model_state)
  model(jnp.ones((4, 3)), train=True)  # advances the dropout RNG counter
  _, params, model_state = nnx.split(model, nnx.Param, ...)
  state = state._replace(params=params, model_state=model_state,
                         step=jnp.int32(5))
  checkpointer = train_lib.Checkpointer(str(tmp_path / 'ckpt'))
  checkpointer.save(state)
  assert checkpointer.latest_step() == 5
  _, template = _state()
  restored = checkpointer.restore(template)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state),
                  strict=True):
    if jnp.issubdtype(b.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(a, b)
  # Same dropout mask after restore as from the original state.
  x = jnp.ones((4, 3))
  out_a = nnx.merge(graphdef, restored.params, restored.model_state)(
      x, train=True)
  out_b = nnx.merge(graphdef, state.params, state.model_state)(x, train=True)
  np.testing.assert_array_equal(out_a, out_b)
  checkpointer.close()


def test_partial_checkpoint_is_ignored(tmp_path):
  """A step directory left half-written by a kill is never restored."""
  _, state = _state()
  directory = tmp_path / 'ckpt'
  checkpointer = train_lib.Checkpointer(str(directory))
  checkpointer.save(state._replace(step=jnp.int32(3)))
  checkpointer.close()
  # What a kill during orbax's save leaves: a temporary directory.
  partial = directory / '4.orbax-checkpoint-tmp-123'
  partial.mkdir()
  (partial / 'garbage').write_bytes(b'\x00' * 10)
  reopened = train_lib.Checkpointer(str(directory))
  assert reopened.latest_step() == 3
  restored = reopened.restore(state)
  assert int(restored.step) == 3
  reopened.close()


def test_unwritable_workdir_gives_clear_error(tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('not a directory')
  with pytest.raises(OSError, match='cannot write checkpoints'):
    train_lib.Checkpointer(str(blocker / 'ckpt'))


def test_learning_rate_schedule_matches_official_decay():
  config = ml_collections.ConfigDict(
      dict(learning_rate=1e-3, lr_decay_steps=2000, lr_decay_rate=0.96))
  schedule = train_lib.learning_rate_schedule(config)
  assert float(schedule(0)) == pytest.approx(1e-3)
  assert float(schedule(2000)) == pytest.approx(1e-3 * 0.96)
  assert float(schedule(3000)) == pytest.approx(1e-3 * 0.96 ** 1.5, rel=1e-5)


def test_batch_size_must_divide_devices():
  mesh = train_lib.make_mesh()
  train_lib.check_batch_size(mesh.size * 4, mesh)
  if mesh.size > 1:
    with pytest.raises(ValueError, match='not divisible'):
      train_lib.check_batch_size(mesh.size * 4 + 1, mesh)


def test_write_json_atomic(tmp_path):
  path = str(tmp_path / 's.json')
  train_lib.write_json_atomic(path, {'a': 1})
  assert json.load(open(path)) == {'a': 1}
  assert not os.path.exists(path + '.tmp')


_SHARDED_SCRIPT = r'''
import os, sys
os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=4'
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
from capsjax import train_lib

class Net(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(5, 8, rngs=rngs); self.b = nnx.Linear(8, 3, rngs=rngs)
  def __call__(self, x):
    return self.b(jax.nn.relu(self.a(x)))

def train(num_devices):
  mesh = train_lib.make_mesh(num_devices)
  opt = optax.adam(0.05)
  graphdef, state = train_lib.init_train_state(Net(nnx.Rngs(0)), opt)
  state = jax.device_put(state, train_lib.replicated(mesh))
  def step(graphdef, state, x, y):
    def loss_fn(p):
      logits = nnx.merge(graphdef, p, state.model_state)(x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    loss, g = jax.value_and_grad(loss_fn)(state.params)
    return train_lib.apply_gradients(state, g, state.model_state, opt, loss)[0]
  step = jax.jit(step, static_argnums=0, donate_argnums=1)
  rng = np.random.default_rng(0)
  for _ in range(20):
    x = jax.device_put(rng.normal(size=(16, 5)).astype(np.float32),
                       train_lib.batch_sharded(mesh))
    y = jax.device_put(rng.integers(0, 3, 16), train_lib.batch_sharded(mesh))
    state = step(graphdef, state, x, y)
  return np.concatenate([np.ravel(l) for l in jax.tree.leaves(state.params)])

assert jax.device_count() == 4
one, four = train(1), train(4)
err = np.max(np.abs(one - four))
print('max abs diff', err)
sys.exit(0 if err < 1e-5 else 1)
'''


def test_four_host_devices_match_one_device():
  """Data parallelism over 4 forced CPU devices gives the 1-device result."""
  result = subprocess.run([sys.executable, '-c', _SHARDED_SCRIPT],
                          capture_output=True, text=True, timeout=300,
                          env=os.environ | {'JAX_PLATFORMS': 'cpu'})
  assert result.returncode == 0, result.stdout + result.stderr
