"""Tests of the shared training utilities (no model family needed)."""

import errno
import io
import json
import logging
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from capsjax.training import checkpoints
from capsjax.training import loop
from capsjax.training import metrics as metrics_lib
from capsjax.training import sharding
from capsjax.training import state as state_lib


class _Tiny(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(3, 2, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x, train=False):
    return self.dropout(self.linear(x), deterministic=not train)


def _state():
  model = _Tiny(nnx.Rngs(params=0, dropout=1))
  return state_lib.init_train_state(model, optax.adam(0.1))


def test_batch_order_is_a_function_of_seed_and_step():
  order = sharding.BatchOrder(103, 10, seed=7)
  assert order.steps_per_epoch == 10
  first_epoch = np.concatenate([order.indices(s) for s in range(10)])
  assert len(np.unique(first_epoch)) == 100  # no repeats within an epoch
  again = sharding.BatchOrder(103, 10, seed=7)
  np.testing.assert_array_equal(again.indices(13), order.indices(13))
  np.testing.assert_array_equal(again.indices(2), first_epoch[20:30])
  other_seed = sharding.BatchOrder(103, 10, seed=8)
  assert not np.array_equal(other_seed.indices(0), order.indices(0))
  assert not np.array_equal(order.indices(10), order.indices(0))


def test_batch_order_rejects_batch_larger_than_split():
  with pytest.raises(ValueError, match='fewer than batch_size'):
    sharding.BatchOrder(5, 10, seed=0)


def test_apply_gradients_skips_nonfinite_update_and_records_step():
  graphdef, state = _state()
  optimizer = optax.adam(0.1)
  # Jitted, as the train steps run it: one compilation for the four updates,
  # not one per operation.
  apply_gradients = jax.jit(state_lib.apply_gradients, static_argnums=3)
  grads = jax.tree.map(jnp.ones_like, state.params)
  good, norm = apply_gradients(state, grads, state.model_state, optimizer,
                               jnp.float32(1.0))
  assert int(good.step) == 1 and int(good.nonfinite_step) == -1
  assert float(norm) == pytest.approx(np.sqrt(3 * 2 + 2))
  moved = jax.tree.leaves(jax.tree.map(
      lambda a, b: np.any(np.asarray(a) != np.asarray(b)), good.params,
      state.params))
  assert all(bool(m) for m in moved)
  bad_grads = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
  bad, _ = apply_gradients(good, bad_grads, good.model_state, optimizer,
                           jnp.float32(1.0))
  assert int(bad.step) == 2 and int(bad.nonfinite_step) == 1
  for new, old in zip(jax.tree.leaves(bad.params), jax.tree.leaves(good.params),
                      strict=True):
    np.testing.assert_array_equal(new, old)
  # A later finite step does not overwrite the first bad step's number.
  later, _ = apply_gradients(bad, grads, bad.model_state, optimizer,
                             jnp.float32(1.0))
  assert int(later.nonfinite_step) == 1
  inf_loss, _ = apply_gradients(good, grads, good.model_state, optimizer,
                                jnp.float32(jnp.inf))
  assert int(inf_loss.nonfinite_step) == 1


def test_checkpoint_round_trip_keeps_prng_keys(tmp_path):
  graphdef, state = _state()
  model = nnx.merge(graphdef, state.params, state.model_state)
  # Jitted: one compilation, not one per operation.
  train_call = nnx.jit(lambda m, x: m(x, train=True))
  train_call(model, jnp.ones((4, 3)))  # advances the dropout RNG counter
  _, params, model_state = nnx.split(model, nnx.Param, ...)
  state = state._replace(params=params, model_state=model_state,
                         step=jnp.int32(5))
  checkpointer = checkpoints.Checkpointer(str(tmp_path / 'ckpt'))
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
  out_a = train_call(nnx.merge(graphdef, restored.params,
                               restored.model_state), x)
  out_b = train_call(nnx.merge(graphdef, state.params, state.model_state), x)
  np.testing.assert_array_equal(out_a, out_b)
  checkpointer.close()


def test_partial_checkpoint_is_ignored(tmp_path):
  """A step directory left half-written by a kill is never restored."""
  _, state = _state()
  directory = tmp_path / 'ckpt'
  checkpointer = checkpoints.Checkpointer(str(directory))
  checkpointer.save(state._replace(step=jnp.int32(3)))
  checkpointer.close()
  # What a kill during orbax's save leaves: its temporary directory.
  partial = directory / '4.orbax-checkpoint-tmp'
  partial.mkdir()
  (partial / 'garbage').write_bytes(b'\x00' * 10)
  reopened = checkpoints.Checkpointer(str(directory))
  assert reopened.latest_step() == 3
  restored = reopened.restore(state)
  assert int(restored.step) == 3
  reopened.close()


def test_unwritable_workdir_gives_clear_error(tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('not a directory')
  with pytest.raises(OSError, match='cannot write checkpoints'):
    checkpoints.Checkpointer(str(blocker / 'ckpt'))


def test_learning_rate_schedule_matches_official_decay():
  config = ml_collections.ConfigDict(
      dict(learning_rate=1e-3, lr_decay_steps=2000, lr_decay_rate=0.96))
  schedule = state_lib.learning_rate_schedule(config)
  assert float(schedule(0)) == pytest.approx(1e-3)
  assert float(schedule(2000)) == pytest.approx(1e-3 * 0.96)
  assert float(schedule(3000)) == pytest.approx(1e-3 * 0.96 ** 1.5, rel=1e-5)


@pytest.mark.parametrize('epsilon', [1e-8, 1e-7, 1e-2])
def test_adam_step_against_numpy(epsilon):
  """First Adam step: lr * m_hat / (sqrt(v_hat) + eps) = lr * g / (|g| + eps)."""
  config = ml_collections.ConfigDict(dict(
      learning_rate=1e-3, lr_decay_steps=2000, lr_decay_rate=1.0,
      adam_epsilon=epsilon))
  optimizer = state_lib.make_optimizer(config)
  grads = np.array([1e-6, -3e-7, 0.5, 0.0], np.float32)
  params = np.zeros(4, np.float32)
  # Jitted: one compilation, not one per operation.
  updates, _ = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
  g = grads.astype(np.float64)
  np.testing.assert_allclose(updates, -1e-3 * g / (np.abs(g) + epsilon),
                             rtol=1e-5, atol=1e-12)


def np_tensorflow_adam(params, grads, rates, eps, b1=0.9, b2=0.999):
  """float64, from TensorFlow's ApplyAdam kernel (training_ops.cc): per
  step t = 1, 2, ...: m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2);
  var -= lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps)."""
  var = np.asarray(params, np.float64).copy()
  m, v = np.zeros_like(var), np.zeros_like(var)
  for t, (g, lr) in enumerate(zip(grads, rates, strict=True), start=1):
    m += (g - m) * (1 - b1)
    v += (g * g - v) * (1 - b2)
    var -= lr * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + eps)
  return var


def test_tensorflow_adam_form_is_tf_kernel():
  """adam_form='tensorflow' against the kernel's float64 reference over 6
  steps of a decaying rate; the paper's form differs where |g| is near
  eps; both forms' states have the same tree (checkpoints)."""
  rng = np.random.default_rng(0)
  grads = rng.standard_normal((6, 5)) * np.array([1e-6, 3e-7, 0.5, 1e-3, 2])
  config = ml_collections.ConfigDict(dict(
      learning_rate=1e-3, lr_decay_steps=2, lr_decay_rate=0.5,
      adam_epsilon=1e-7, adam_form='tensorflow'))
  rates = [1e-3 * 0.5 ** (t / 2) for t in range(6)]
  with jax.enable_x64(True):
    params = jnp.asarray(rng.standard_normal(5))
    results = {}
    for form in state_lib.ADAM_FORMS:
      config.adam_form = form
      optimizer = state_lib.make_optimizer(config)

      # Jitted: one compilation per form, not one per operation.
      @jax.jit
      def step(g, state, p):
        updates, state = optimizer.update(g, state, p)
        return optax.apply_updates(p, updates), state

      state, p = optimizer.init(params), params
      for g in grads:
        p, state = step(jnp.asarray(g), state, p)
      results[form] = (np.asarray(p), jax.tree.structure(state))
  ref = np_tensorflow_adam(params, grads, rates, 1e-7)
  # optax evaluates the schedule in float32: 1e-7 of the updates (~1e-3).
  np.testing.assert_allclose(results['tensorflow'][0], ref, rtol=0,
                             atol=1e-9)
  assert results['tensorflow'][1] == results['paper'][1]
  # Not vacuous: the two forms part on the gradients of order eps.
  assert abs(results['paper'][0][0] - ref[0]) > 1e-4
  # ... and agree where |g| >> eps (entries of order 0.5 and 2).
  np.testing.assert_allclose(results['paper'][0][[2, 4]], ref[[2, 4]],
                             rtol=1e-6)
  config.adam_form = 'keras'
  with pytest.raises(ValueError, match='adam_form'):
    state_lib.make_optimizer(config)


def test_progress_bar_shows_rate_and_eta_between_logs(monkeypatch):
  """Steps advance the bar before any log line: step/s, img/s and the ETA."""
  terminal = io.StringIO()
  terminal.isatty = lambda: True
  monkeypatch.setattr(sys, 'stderr', terminal)
  monkeypatch.delenv('CAPSJAX_NO_PROGRESS', raising=False)
  with metrics_lib.Progress(1000, 0, batch_size=32) as progress:
    progress._bar.mininterval = 0  # redraw at every step
    for step in range(1, 6):
      time.sleep(0.02)
      progress.advance(step)
    frames = terminal.getvalue().split('\r')
  drawn, before = frames[-1], frames[-2]
  assert '5/1000' in drawn, drawn
  rate = float(re.search(r'([\d.]+)step/s', drawn).group(1))
  assert 5 < rate < 100, drawn  # about 50 steps/s
  # img/s is set from the rate the bar had before the step it draws: the
  # previous frame's (tqdm's smoothed rate moves between steps under load).
  previous_rate = float(re.search(r'([\d.]+)step/s', before).group(1))
  images_per_s = float(re.search(r'img/s=(\d+)', drawn).group(1))
  assert images_per_s == pytest.approx(32 * previous_rate, rel=0.02), drawn
  assert re.search(r'<\d+:\d+', drawn), drawn  # the ETA


def test_a_message_goes_above_the_bar_not_into_its_line(monkeypatch):
  terminal, out = io.StringIO(), io.StringIO()
  terminal.isatty = lambda: True
  monkeypatch.setattr(sys, 'stderr', terminal)
  monkeypatch.setattr(sys, 'stdout', out)
  monkeypatch.delenv('CAPSJAX_NO_PROGRESS', raising=False)
  with metrics_lib.Progress(100, 0, batch_size=8) as progress:
    progress._bar.mininterval = 0
    progress.advance(3)
    progress.write('The remaining 97 steps take about 1 h.')
    progress.advance(4)
  # The message is its own line on stdout; the bar (stderr) never holds it.
  assert out.getvalue() == 'The remaining 97 steps take about 1 h.\n'
  assert 'remaining' not in terminal.getvalue()
  assert '4/100' in terminal.getvalue().split('\r')[-1]


def test_environment_names_the_commit_and_uncommitted_changes():
  from tests.conftest import REPO

  def git(*args):
    return subprocess.run(['git', *args], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()

  env = metrics_lib.environment()
  assert env['git_commit'] == git('rev-parse', 'HEAD')
  assert env['git_uncommitted_changes'] == bool(
      git('status', '--porcelain', '--untracked-files=no'))


def test_batch_size_must_divide_devices():
  mesh = sharding.make_mesh()
  sharding.check_batch_size(mesh.size * 4, mesh)
  if mesh.size > 1:
    with pytest.raises(ValueError, match='not divisible'):
      sharding.check_batch_size(mesh.size * 4 + 1, mesh)


def test_write_json_atomic(tmp_path):
  path = str(tmp_path / 's.json')
  metrics_lib.write_json_atomic(path, {'a': 1})
  assert json.load(open(path)) == {'a': 1}
  assert os.listdir(tmp_path) == ['s.json']  # no temporary file left


# ----------------------------------------------------------------------------
# A full disk while saving: one clear error, the previous checkpoint intact.

# How tensorstore, which writes the arrays, reports a full disk.
_TENSORSTORE_ENOSPC = (
    'RESOURCE_EXHAUSTED: Error writing "0/0" in OCDBT database at local file '
    '"ckpt/2.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp/ocdbt.process_0'
    '/": Failed writing: "...": Failed to write 58289 bytes to file 17: No '
    "space left on device [os_error_code='28']")


@pytest.fixture
def restore_save_noise_filters(monkeypatch):
  """A failed save leaves its log filters and unraisable hook installed (the
  process is about to exit); the test process gets its own back."""
  monkeypatch.setattr(sys, 'unraisablehook', sys.unraisablehook)
  loggers = [logging.getLogger(name) for name in ('absl', 'asyncio')]
  saved = [list(logger.filters) for logger in loggers]
  yield
  for logger, filters in zip(loggers, saved, strict=True):
    logger.filters[:] = filters


def _fill_disk(monkeypatch, where, error):
  from orbax.checkpoint._src.path import async_path
  from orbax.checkpoint._src.serialization import serialization

  async def fail(*args, **kwargs):
    raise error

  if where == 'metadata':  # orbax's own (Python) writes
    monkeypatch.setattr(async_path, 'write_text', fail)
  else:  # the arrays, through tensorstore
    monkeypatch.setattr(serialization, 'async_serialize_from_host', fail)


@pytest.mark.parametrize('where,error', [
    ('metadata', OSError(errno.ENOSPC, 'No space left on device')),
    ('arrays', ValueError(_TENSORSTORE_ENOSPC)),
    ('arrays', OSError(errno.EROFS, 'Read-only file system')),
])
def test_full_disk_while_saving_is_clear_and_keeps_previous_checkpoint(
    tmp_path, monkeypatch, restore_save_noise_filters, where, error):
  _, state = _state()
  directory = str(tmp_path / 'ckpt')
  checkpointer = checkpoints.Checkpointer(directory)
  checkpointer.save(state._replace(step=jnp.int32(1)))
  with monkeypatch.context() as patch:
    _fill_disk(patch, where, error)
    with pytest.raises(OSError) as info:
      checkpointer.save(state._replace(step=jnp.int32(2)))
  message = str(info.value)
  for part in ('saving the checkpoint of step 2', directory, str(error),
               'previous checkpoint is intact', 'Free disk space or choose '
               'another --workdir, then rerun to resume'):
    assert part in message, message
  assert info.value.__cause__ is error
  reopened = checkpoints.Checkpointer(directory)
  assert reopened.latest_step() == 1
  restored = reopened.restore(state)
  assert int(restored.step) == 1
  for a, b in zip(jax.tree.leaves(restored.params),
                  jax.tree.leaves(state.params), strict=True):
    np.testing.assert_array_equal(a, b)
  # Space freed: the same step saves over what the failed write left.
  reopened.save(state._replace(step=jnp.int32(2)))
  assert reopened.latest_step() == 2
  assert not [d for d in os.listdir(directory) if 'tmp' in d]
  reopened.close()


def test_other_errors_while_saving_are_not_called_a_full_disk(
    tmp_path, monkeypatch, restore_save_noise_filters):
  _, state = _state()
  checkpointer = checkpoints.Checkpointer(str(tmp_path / 'ckpt'))
  _fill_disk(monkeypatch, 'arrays', ValueError('a bug, not the disk'))
  with pytest.raises(ValueError, match='^a bug, not the disk$'):
    checkpointer.save(state._replace(step=jnp.int32(1)))


_TINY_DISK_SCRIPT = r'''
import sys
import jax.numpy as jnp, optax
from absl import logging
from flax import nnx
from capsjax.training import checkpoints
from capsjax.training import state as state_lib

logging.set_verbosity(logging.WARNING)  # as the experiments run
class Net(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(100, 300, rngs=rngs)  # about 120 KB a checkpoint
graphdef, state = state_lib.init_train_state(Net(nnx.Rngs(0)), optax.adam(0.1))
checkpointer = checkpoints.Checkpointer(sys.argv[1])
checkpointer.save(state._replace(step=jnp.int32(1)))
try:
  checkpointer.save(state._replace(step=jnp.int32(2)))
except OSError as e:
  print(f'error: {e}')
print('latest', checkpointer.latest_step())
print('restored', int(checkpointer.restore(state).step))
'''


def test_really_full_disk_on_a_tiny_tmpfs(tmp_path):
  """A 250 KB tmpfs that holds one checkpoint but not two: tensorstore's
  real error, one clear message, no stack traces. Needs a mount namespace
  (root, or unprivileged user namespaces); skipped where there is none."""
  disk = tmp_path / 'disk'
  disk.mkdir()
  mount = f'mount -t tmpfs -o size=250k tmpfs {disk}'
  probe = subprocess.run(['unshare', '-rm', 'sh', '-c', mount],
                         capture_output=True, text=True, check=False)
  if probe.returncode:
    pytest.skip(f'cannot mount a tmpfs here: {probe.stderr.strip()}')
  result = subprocess.run(
      ['unshare', '-rm', 'sh', '-c',
       f'{mount} && exec "{sys.executable}" -c "$0" {disk}/ckpt',
       _TINY_DISK_SCRIPT],
      capture_output=True, text=True, timeout=300, cwd=os.path.dirname(
          os.path.dirname(os.path.abspath(__file__))),
      env=os.environ | {'JAX_PLATFORMS': 'cpu'})
  assert result.returncode == 0, result.stdout + result.stderr
  lines = result.stdout.splitlines()
  assert lines[0].startswith('error: saving the checkpoint of step 2 to '
                             f'{disk}/ckpt failed'), result.stdout
  assert 'No space left on device' in lines[0]
  assert 'previous checkpoint is intact' in lines[0]
  assert lines[1:] == ['latest 1', 'restored 1'], result.stdout
  noise = [line for line in result.stderr.splitlines()
           if not line.startswith(('I0', 'W0'))]  # C++ log lines of jax
  assert not noise, result.stderr


@pytest.mark.parametrize('key,value,requirement', [
    ('batch_size', 0, 'a positive int'),
    ('num_train_steps', -5, 'a positive int'),
    ('log_every_steps', 0, 'a positive int'),
    ('checkpoint_every_steps', 2.5, 'a positive int'),
    ('eval_every_steps', True, 'a positive int'),
    ('lr_decay_steps', 0, 'a positive int'),
    ('learning_rate', 0.0, 'a finite number > 0'),
    ('learning_rate', float('nan'), 'a finite number > 0'),
    ('lr_decay_rate', -1.0, 'a finite number > 0'),
    ('adam_form', 'keras', "one of ('paper', 'tensorflow')"),
    ('seed', -1, 'an int >= 0'),
    ('max_shift', -2, 'an int >= 0'),
    ('max_train_seconds', -1, '> 0 (or 0: no limit)'),
    ('center_crop', 24, '0 (no crop) or an int equal to the height'),
    ('num_devices', 10**6, 'an int from 0 (all devices) to'),
])
def test_check_config_names_the_key_and_what_it_must_be(key, value,
                                                        requirement):
  from experiments.configs import common
  config = ml_collections.ConfigDict(common.base_config().to_dict(),
                                     type_safe=False)
  loop.check_config(config)  # the defaults pass
  config[key] = value
  with pytest.raises(ValueError) as info:
    loop.check_config(config)
  assert str(info.value).startswith(
      f'config.{key} must be {requirement}'), info.value
  assert f'got {value!r}' in str(info.value)


def test_mixed_precision_step_runs_bfloat16_on_float32_master_weights():
  """bfloat16 forward, float32 gradients and update close to float32's."""
  model = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (32, 16))
  y = jax.random.normal(jax.random.key(2), (32, 4))
  optimizer = optax.sgd(0.1)
  seen = []

  def loss_fn(m):
    seen.append(m.kernel[...].dtype)
    out = m(x.astype(m.kernel[...].dtype)).astype(jnp.float32)
    return jnp.mean(jnp.square(out - y)), {}

  results = {}
  # Jitted, as the train steps run it: one compilation per dtype, not one
  # per operation.
  gradient_step = jax.jit(state_lib.gradient_step, static_argnums=(0, 2, 3, 4))
  for name in ('float32', 'bfloat16'):
    dtype = state_lib.compute_dtype(ml_collections.ConfigDict(
        {'compute_dtype': name}))
    graphdef, state = state_lib.init_train_state(model, optimizer)
    new_state, metrics = gradient_step(graphdef, state, optimizer, loss_fn,
                                       dtype)
    results[name] = (state, new_state, metrics)
  assert seen == [jnp.float32, jnp.bfloat16]
  (start, f32, m32), (_, bf16, m16) = results['float32'], results['bfloat16']
  for leaf in jax.tree.leaves(bf16.params):
    assert leaf.dtype == jnp.float32  # master weights stay float32
  assert m16['loss'].dtype == jnp.float32
  np.testing.assert_allclose(m16['loss'], m32['loss'], rtol=2e-2)
  # In NumPy: no compilation per operation and shape.
  update32 = [np.asarray(a) - np.asarray(b) for a, b in zip(
      jax.tree.leaves(f32.params), jax.tree.leaves(start.params), strict=True)]
  update16 = [np.asarray(a) - np.asarray(b) for a, b in zip(
      jax.tree.leaves(bf16.params), jax.tree.leaves(start.params),
      strict=True)]
  for u32, u16 in zip(update32, update16, strict=True):
    cosine = np.sum(u32 * u16) / (np.linalg.norm(u32) * np.linalg.norm(u16))
    assert cosine > 0.99
    assert not np.array_equal(u32, u16)  # the forward really ran in bfloat16


def test_compute_dtype_rejects_unknown_names():
  with pytest.raises(ValueError, match='compute_dtype must be one of'):
    state_lib.compute_dtype(ml_collections.ConfigDict({'compute_dtype': 'fp8'}))


def test_train_clock_counts_only_running_windows(monkeypatch):
  now = [0.0]
  monkeypatch.setattr(loop.time, 'perf_counter', lambda: now[0])
  clock = loop._TrainClock()
  clock.start()
  now[0] = 10.0  # compilation: a window with no counted step
  assert clock.close_window() == (0, 10.0)
  assert (clock.steps, clock.seconds) == (0, 0.0)
  for _ in range(3):
    clock.start()
    now[0] += 2.0  # a step
    clock.count_step()
    clock.stop()
    now[0] += 100.0  # evaluation or a checkpoint: not training time
  assert clock.elapsed() == 6.0
  assert clock.close_window() == (3, 6.0)
  assert (clock.steps, clock.seconds) == (3, 6.0)
  clock.start()
  now[0] += 1.5
  assert clock.elapsed() == 7.5  # a running window counts up to now
