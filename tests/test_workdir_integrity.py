"""Fault injection: one writer per workdir, and damaged checkpoints.

The workdir lock: a second process on a held workdir (a training run, a
figure command, the reproduction suite, a model load) is refused in one line
naming the holder; the lock of a SIGKILLed holder frees itself; the processes
of one multi-process job share the workdir.

Checkpoint integrity: one flipped bit, a truncated file and a missing file,
in every file of the latest checkpoint and in the files that hold the arrays
of an older one and of the best one. Each ends in the documented behaviour:
the damage is reported in one line and the newest good checkpoint used (the
run then ends bit for bit like an undamaged one), or a clear error when none
is good; a damaged best checkpoint is never tested; damage to a file that
restoring does not read changes nothing restored.
"""

import gc
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from capsjax import training
from capsjax.training import checkpoints
from capsjax.training import loop
from capsjax.training import state as state_lib
from capsjax.training import vector_capsules
from experiments import reproduce
from tests import conftest
from tests.conftest import REPO
from tests.helpers import tiny_config
from tests.helpers import tiny_flags
from tests.helpers import write_tiny_mnist

KINDS = ('flip', 'truncate', 'delete')

# A restore that fails leaves orbax's read coroutines unawaited; the
# library silences their warning for the rest of the process, pytest's
# per-test warning filters bring it back.
pytestmark = pytest.mark.filterwarnings(
    "ignore:coroutine '.*' was never awaited:RuntimeWarning")


@pytest.fixture(scope='module', autouse=True)
def _quiet_abandoned_reads():
  """While this module's tests run, the coroutines a failed restore abandons
  are collected as quietly as the library's hook does in a run (rather than
  noisily whenever the interpreter collects); at its end, all of them."""
  hook = sys.unraisablehook
  sys.unraisablehook = checkpoints._drop_closed_loop_errors(hook)
  try:
    yield
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', RuntimeWarning)
      gc.collect()
  finally:
    sys.unraisablehook = hook


@pytest.fixture(autouse=True)
def _collect_abandoned_reads():
  """After each test, the young generations, where its abandoned reads are:
  a full collection takes about a second with the compiled programs the
  process holds; the module's end collects what grew older."""
  yield
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', RuntimeWarning)
    gc.collect(1)


def damage(path, kind: str) -> None:
  """One flipped bit (the middle byte's lowest), the second half cut off,
  or the file removed."""
  data = path.read_bytes()
  if kind == 'flip':
    middle = len(data) // 2
    path.write_bytes(data[:middle] + bytes([data[middle] ^ 1]) +
                     data[middle + 1:])
  elif kind == 'truncate':
    path.write_bytes(data[:len(data) // 2])
  else:
    path.unlink()


def files_of(step_dir) -> list[str]:
  return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob('*')
                if p.is_file())


def array_files(step_dir) -> dict[str, str]:
  """The files restoring reads, by role: the largest array's data, the
  index that finds every array, and the digest."""
  data = max((step_dir / 'default' / 'ocdbt.process_0' / 'd').iterdir(),
             key=lambda p: p.stat().st_size)
  return {'arrays': str(data.relative_to(step_dir)),
          'index': 'default/manifest.ocdbt', 'digest': 'digest/metadata'}


def host_leaves(state) -> list[np.ndarray]:
  return [np.asarray(x) for x in checkpoints._saveable(jax.tree.leaves(state))]


def assert_same(a, b) -> None:
  for x, y in zip(host_leaves(a), host_leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------
# Checkpointer on its own: a small state saved at steps 1 and 2.


class _Net(nnx.Module):

  def __init__(self, rngs):
    # 64 x 64 float32 (16 KB): stored in a data file of its own, as a real
    # model's weights are (orbax inlines arrays under 1 KB in its index).
    self.linear = nnx.Linear(64, 64, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)


def _template():
  return state_lib.init_train_state(
      _Net(nnx.Rngs(params=0, dropout=1)), optax.adam(0.1))[1]


@pytest.fixture(scope='module')
def two_steps(tmp_path_factory):
  """A checkpoint directory with steps 1 and 2 (other weights); the states."""
  directory = tmp_path_factory.mktemp('two_steps') / 'ckpt'
  template = _template()
  states = {1: template._replace(step=jnp.int32(1))}
  states[2] = states[1]._replace(
      step=jnp.int32(2),
      params=jax.tree.map(lambda p: p + 1.0, states[1].params))
  checkpointer = checkpoints.Checkpointer(str(directory))
  for state in states.values():
    checkpointer.save(state)
  checkpointer.close()
  return directory, states


def _copy(directory, tmp_path, name):
  target = tmp_path / name
  shutil.copytree(directory, target)
  return target


def _newest_good(directory, **kwargs):
  lines = []
  checkpointer = checkpoints.Checkpointer(str(directory))
  try:
    return checkpointer.restore_newest_good(_template(), lines.append,
                                            **kwargs), lines
  finally:
    checkpointer.close()


@pytest.mark.parametrize('kind', KINDS)
def test_any_file_of_the_latest_checkpoint_damaged_is_caught_or_harmless(
    tmp_path, two_steps, kind):
  """Every file of the latest checkpoint damaged in turn: either the damage
  is reported in one line, the checkpoint moved aside and the older one
  restored, or (a file restoring does not read, such as orbax's
  commit_success.txt) the arrays read back exactly as saved. Never other
  arrays in silence."""
  directory, states = two_steps
  caught = []
  for i, name in enumerate(files_of(directory / '2')):
    work = _copy(directory, tmp_path, f'c{i}')
    damage(work / '2' / name, kind)
    restored, lines = _newest_good(work)
    if restored.step == 1:
      caught.append(name)
      assert len(lines) == 1, (name, lines)
      assert re.fullmatch(
          rf'The checkpoint of step 2 in {re.escape(str(work))} is damaged '
          rf'\(.+\); moved to {re.escape(str(work))}\.damaged/2; using step '
          rf'1, the newest good one\.', lines[0]), lines[0]
      assert not (work / '2').exists()
      assert (tmp_path / f'c{i}.damaged' / '2').is_dir()  # kept to inspect
    else:
      assert (restored.step, lines) == (2, []), (name, lines)
      assert restored.verified
    assert_same(restored.state, states[restored.step])
  # Whatever restoring reads is caught: the arrays, their index, the digest.
  assert set(array_files(directory / '2').values()) <= set(caught), caught


@pytest.mark.parametrize('kind', KINDS)
def test_damaged_older_checkpoint_is_never_used_nor_touched(tmp_path,
                                                            two_steps, kind):
  directory, states = two_steps
  for role, name in array_files(directory / '1').items():
    work = _copy(directory, tmp_path, f'{role}')
    damage(work / '1' / name, kind)
    restored, lines = _newest_good(work)
    assert (restored.step, lines) == (2, [])
    assert_same(restored.state, states[2])
    assert (work / '1').is_dir()


@pytest.mark.parametrize('kind', KINDS)
def test_no_good_checkpoint_is_a_clear_error_and_changes_nothing(
    tmp_path, two_steps, kind):
  directory, _ = two_steps
  work = _copy(directory, tmp_path, 'both')
  for step in (1, 2):
    damage(work / str(step) / array_files(work / str(step))['arrays'], kind)
  before = files_of(work)
  with pytest.raises(checkpoints.CheckpointDamaged, match=(
      rf'^no good checkpoint in {re.escape(str(work))} \(step 2: .+; step '
      rf'1: .+\)\. Nothing was changed: restore the directory from a copy, '
      rf'or move it away to start afresh\.$')):
    _newest_good(work)
  assert files_of(work) == before
  assert not (tmp_path / 'both.damaged').exists()


def test_a_damaged_step_set_aside_is_saved_afresh(tmp_path, two_steps):
  directory, states = two_steps
  work = _copy(directory, tmp_path, 'again')
  damage(work / '2' / array_files(work / '2')['arrays'], 'flip')
  restored, _ = _newest_good(work)
  assert restored.step == 1
  checkpointer = checkpoints.Checkpointer(str(work))
  checkpointer.save(states[2])  # what the resumed run does at step 2
  again = checkpointer.restore_checked(_template(), 2)
  checkpointer.close()
  assert again.verified
  assert_same(again.state, states[2])


def test_missing_digest_is_damage_beside_digests_and_old_format_alone(
    tmp_path, two_steps):
  """A step without its digest is damaged when its siblings have one (this
  capsjax writes one with every step); where none has one (an older
  capsjax's checkpoints) the latest is used with a one-line warning."""
  directory, states = two_steps
  work = _copy(directory, tmp_path, 'no_digest')
  shutil.rmtree(work / '2' / 'digest')
  restored, lines = _newest_good(work)
  assert restored.step == 1
  assert '(its digest is missing)' in lines[0]

  old = tmp_path / 'old'
  manager = ocp.CheckpointManager(str(old))  # as capsjax wrote it before
  for step in (1, 2):
    manager.save(step, args=ocp.args.StandardSave(
        checkpoints._saveable(jax.tree.leaves(states[step]))))
  manager.wait_until_finished()
  manager.close()
  restored, lines = _newest_good(old)
  assert (restored.step, restored.verified) == (2, False)
  assert lines == [f'Warning: the checkpoint of step 2 in {old} has no digest '
                   f'(saved by an older capsjax); it is used unverified.']
  assert_same(restored.state, states[2])


# ----------------------------------------------------------------------------
# Training runs: a tiny CapsNet trained 8 steps (checkpoints 6 and 8).


@pytest.fixture(scope='module')
def tiny_data(tmp_path_factory):
  return write_tiny_mnist(tmp_path_factory.mktemp('tiny_mnist'))


def _config(data_dir, **overrides):
  return tiny_config(data_dir, **({'num_train_steps': 8} | overrides))


@pytest.fixture(scope='module')
def trained(tmp_path_factory, tiny_data):
  """A finished tiny run: its workdir (to copy) and summary."""
  workdir = tmp_path_factory.mktemp('trained') / 'work'
  summary = vector_capsules.train_and_evaluate(_config(tiny_data), str(workdir))
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['6', '8']
  return workdir, summary


def _template_of(config):
  return state_lib.init_train_state(state_lib.create_model(config),
                                    state_lib.make_optimizer(config))[1]


def _params(workdir, which):
  model = training.load_trained_model(str(workdir), which)
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.mark.parametrize('kind', KINDS)
def test_damaged_latest_checkpoint_is_said_and_the_run_resumes_from_the_good_one(
    tmp_path, tiny_data, trained, kind, capsys):
  """Checkpoint 8 damaged, the run rerun: one line names it, it is set
  aside, training resumes from step 6, and the run ends bit for bit as the
  undamaged one (nothing good was lost)."""
  clean, clean_summary = trained
  work = _copy(clean, tmp_path, 'work')
  damage(work / 'checkpoints' / '8' /
         array_files(work / 'checkpoints' / '8')['arrays'], kind)
  os.remove(work / 'summary.json')
  capsys.readouterr()
  summary = vector_capsules.train_and_evaluate(_config(tiny_data), str(work))
  out = capsys.readouterr().out
  damaged = [line for line in out.splitlines() if ' is damaged ' in line]
  assert len(damaged) == 1, out
  assert re.fullmatch(
      rf'The checkpoint of step 8 in {re.escape(str(work))}/checkpoints is '
      rf'damaged \(.+\); moved to {re.escape(str(work))}/checkpoints\.damaged'
      rf'/8; using step 6, the newest good one\.', damaged[0]), damaged[0]
  assert f'Resuming from the checkpoint of step 6 in {work}.' in out
  for which in ('latest', 'best'):
    for a, b in zip(_params(clean, which), _params(work, which), strict=True):
      np.testing.assert_array_equal(a, b)
  for key in ('steps', 'selected_step', 'validation', 'test'):
    assert summary[key] == clean_summary[key], key


def test_a_failed_resume_keeps_the_stored_config(tmp_path, tiny_data, trained):
  """A rerun with an accepted change (more steps) on a workdir with no good
  checkpoint: the clear error, and config.json still says what the
  checkpoints were trained with."""
  clean, _ = trained
  work = _copy(clean, tmp_path, 'no_good')
  os.remove(work / 'summary.json')  # as if stopped before its end
  for step in ('6', '8'):
    damage(work / 'checkpoints' / step /
           array_files(work / 'checkpoints' / step)['arrays'], 'flip')
  stored = (work / 'config.json').read_text()
  with pytest.raises(checkpoints.CheckpointDamaged,
                     match='^no good checkpoint in '):
    vector_capsules.train_and_evaluate(_config(tiny_data, num_train_steps=10),
                                       str(work))
  assert (work / 'config.json').read_text() == stored


@pytest.mark.parametrize('kind', KINDS)
def test_damaged_best_checkpoint_is_never_tested(tmp_path, tiny_data, trained,
                                                 kind, monkeypatch, capsys):
  """The best checkpoint damaged during a run (after its check at start):
  the run stops before the test set, naming it. Damaged at a rerun's start:
  a warning, it is set aside and the best selected again (here, no
  validation being left: the final weights). Loading it is an error."""
  clean, _ = trained
  work = _copy(clean, tmp_path, 'work')
  best_step = json.load(open(work / 'best_validation.json'))['step']
  best_dir = work / 'best' / str(best_step)
  os.remove(work / 'summary.json')

  checked = loop._Run._drop_damaged_best

  def damage_after_the_check(run):
    dropped = checked(run)
    damage(best_dir / array_files(best_dir)['arrays'], kind)
    return dropped

  monkeypatch.setattr(loop._Run, '_drop_damaged_best', damage_after_the_check)
  with pytest.raises(checkpoints.CheckpointDamaged,
                     match='the model selected on validation is not tested. '
                           'Rerun the same command'):
    vector_capsules.train_and_evaluate(_config(tiny_data), str(work))
  assert not (work / 'summary.json').exists()  # nothing was tested
  monkeypatch.undo()
  with pytest.raises(checkpoints.CheckpointDamaged) as info:
    training.load_trained_model(str(work), 'best')
  assert str(info.value).startswith(
      f'the checkpoint of step {best_step} in {work}/best is damaged (')
  assert 'the model selected on validation is not used' in str(info.value)

  capsys.readouterr()
  summary = vector_capsules.train_and_evaluate(_config(tiny_data), str(work))
  out = capsys.readouterr().out
  assert (f'Warning: the best checkpoint (step {best_step}) in {work}/best is '
          f'damaged or missing (') in out, out
  assert (f'moved to {work}/best.damaged/{best_step}; the best is selected '
          f'again') in out
  assert summary['selected_step'] == summary['validation']['step'] == 8
  for a, b in zip(_params(clean, 'latest'), _params(work, 'best'),
                  strict=True):
    np.testing.assert_array_equal(a, b)


def test_damaged_latest_checkpoint_loads_the_newest_good_one(tmp_path,
                                                             trained, capsys):
  clean, _ = trained
  work = _copy(clean, tmp_path, 'work')
  damage(work / 'checkpoints' / '8' / 'default' / 'manifest.ocdbt', 'flip')
  capsys.readouterr()
  context = training.load_context(str(work), 'latest')
  err = capsys.readouterr().err
  assert re.search(rf'^The checkpoint of step 8 in {re.escape(str(work))}/'
                   rf'checkpoints is damaged \(.+\); using step 6, the newest '
                   rf'good one\.$', err, re.M), err
  assert (work / 'checkpoints' / '8').is_dir()  # a reader moves nothing
  loaded = [np.asarray(x) for x in
            jax.tree.leaves(nnx.state(context.model, nnx.Param))]
  checkpointer = checkpoints.Checkpointer(str(clean / 'checkpoints'))
  six = checkpointer.restore_checked(_template_of(_config('')), 6).state
  checkpointer.close()
  for a, b in zip(loaded, jax.tree.leaves(six.params), strict=True):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_divergence_after_resuming_an_unverified_checkpoint_blames_it(
    tmp_path, tiny_data, trained):
  """A checkpoint without a digest (an older capsjax's) holding NaN weights:
  the divergence message names it as the likely cause, not the learning
  rate."""
  clean, _ = trained
  work = _copy(clean, tmp_path, 'work')
  checkpointer = checkpoints.Checkpointer(str(work / 'checkpoints'))
  state = checkpointer.restore(_template_of(_config(tiny_data)))
  checkpointer.close()
  shutil.rmtree(work / 'checkpoints')
  bad = state._replace(params=jax.tree.map(lambda p: p * jnp.nan,
                                           state.params))
  manager = ocp.CheckpointManager(str(work / 'checkpoints'))
  manager.save(8, args=ocp.args.StandardSave(
      checkpoints._saveable(jax.tree.leaves(bad))))
  manager.wait_until_finished()
  manager.close()
  with pytest.raises(loop.TrainingDiverged) as info:
    vector_capsules.train_and_evaluate(_config(tiny_data, num_train_steps=10),
                               str(work))
  message = str(info.value)
  assert message.startswith('the loss or a gradient became non-finite at '
                            'step 8, before any checkpoint since this run '
                            'resumed from the one of step 8, which has no '
                            'digest'), message
  assert 'that checkpoint is the likely cause' in message
  assert f'Move {work}/checkpoints/8 away and rerun' in message
  assert 'Lower the learning rate' not in message


# ----------------------------------------------------------------------------
# The workdir lock.

_HOLDER = r'''
import sys, time
from capsjax.training import checkpoints
workdir, mode, index = sys.argv[1], sys.argv[2], int(sys.argv[3])
with checkpoints.hold_workdir(workdir, 'a test holder', process_index=index,
                              shared=mode == 'shared'):
  print('held', flush=True)
  time.sleep(600)
'''


def _env():
  return conftest.training_env() | {'JAX_PLATFORMS': 'cpu'}


@pytest.fixture
def holder():
  """Starts a process that holds a workdir (until the test ends)."""
  started = []

  def start(workdir, mode='exclusive', index=0):
    process = subprocess.Popen(
        [sys.executable, '-c', _HOLDER, str(workdir), mode, str(index)],
        cwd=REPO, stdout=subprocess.PIPE, text=True, env=_env())
    started.append(process)
    assert process.stdout.readline().strip() == 'held'
    return process

  yield start
  for process in started:
    process.kill()
    process.wait()


def _names_holder(message: str, pid: int, purpose: str) -> None:
  assert re.search(
      rf'is in use by {re.escape(purpose)} \(pid {pid} on '
      rf'{re.escape(socket.gethostname())}, since \d{{4}}-\d\d-\d\d '
      rf'\d\d:\d\d:\d\d', message), message


def _lock_pid(workdir) -> int | None:
  try:
    return json.loads((workdir / 'capsjax.lock').read_text())['pid']
  except (OSError, ValueError, KeyError):
    return None


def _wait_until(condition, process, timeout_s=240.0) -> None:
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert process.poll() is None, process.communicate()[0]
    assert time.monotonic() < deadline
    time.sleep(0.1)


def test_a_second_training_process_exits_2_naming_the_first(tmp_path,
                                                            tiny_data):
  """Two launches on one workdir: the second exits 2 at once with one line
  naming the first (host, pid, since when) and what to do; the first trains
  on untouched and saves its checkpoint."""
  workdir = tmp_path / 'work'
  config = os.path.join(REPO, 'experiments/configs/capsnet_mnist.py:smoke')
  command = [sys.executable, '-m', 'experiments.train',
             f'--workdir={workdir}', f'--config={config}',
             *tiny_flags(tiny_data, num_train_steps=100000,
                          log_every_steps=10, eval_every_steps=100000)]
  first = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=_env())
  try:
    _wait_until(lambda: _lock_pid(workdir) == first.pid, first)
    second = subprocess.run(command, cwd=REPO, capture_output=True,
                            text=True, timeout=240, env=_env())
    assert second.returncode == 2, second.stdout + second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert lines[0].startswith(f'error: WorkdirBusy: {workdir} is in use by '
                               f'experiments.train (pid '
                               f'{first.pid} on '), lines[0]
    _names_holder(lines[0], first.pid, 'experiments.train')
    assert ('wait for it to finish or stop it, then rerun (the lock frees '
            'itself when that process exits)') in lines[0]
    assert 'Resuming' not in second.stdout and 'Starting' not in second.stdout
    # Then the first trains on, undisturbed (and can take SIGTERM): it
    # publishes checkpoints. Any of them, not step 2's: with its programs
    # in the compilation cache the first can be past step 2, and that
    # checkpoint already rotated out, before the second has exited.
    _wait_until(lambda: checkpoints.Checkpointer.exists(
        str(workdir / 'checkpoints')), first)
  finally:
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=240)
  assert first.returncode == 128 + signal.SIGTERM, out
  step = int(re.search(r'stopped at step (\d+), checkpoint saved', out)[1])
  checkpointer = checkpoints.Checkpointer(str(workdir / 'checkpoints'))
  template = _template_of(tiny_config(tiny_data))
  assert checkpointer.restore_checked(template, step).verified
  checkpointer.close()


def test_the_lock_of_a_killed_process_frees_itself(tmp_path, holder):
  workdir = tmp_path / 'work'
  process = holder(workdir)
  with pytest.raises(checkpoints.WorkdirBusy):
    with checkpoints.hold_workdir(str(workdir)):
      pass
  process.send_signal(signal.SIGKILL)
  process.wait()
  stale = json.loads((workdir / 'capsjax.lock').read_text())
  assert stale['pid'] == process.pid  # the file stays; its lock went
  with checkpoints.hold_workdir(str(workdir), 'the next run'):
    record = json.loads((workdir / 'capsjax.lock').read_text())
    assert (record['pid'], record['purpose']) == (os.getpid(), 'the next run')


def test_processes_of_one_job_share_the_workdir_a_second_job_does_not(
    tmp_path, holder):
  """Process 1 of a running job holds its own lock file: process 0 (of the
  same job) is not refused, another job's process 1 is."""
  workdir = tmp_path / 'work'
  process = holder(workdir, index=1)
  with checkpoints.hold_workdir(str(workdir), process_index=0):
    pass
  with pytest.raises(checkpoints.WorkdirBusy) as info:
    with checkpoints.hold_workdir(str(workdir), process_index=1):
      pass
  _names_holder(str(info.value), process.pid, 'a test holder')
  assert os.path.exists(workdir / 'capsjax.process_1.lock')


def test_readers_and_other_commands_respect_a_held_workdir(
    tmp_path, trained, holder):
  """While a run holds a workdir: loading its model (the attack command's
  --models, load_context), a figure command and the reproduction suite are
  refused naming it; a figure command writing elsewhere is not held up by
  another reader; a writer waits for readers."""
  clean, _ = trained
  work = _copy(clean, tmp_path, 'work')
  process = holder(work)
  with pytest.raises(checkpoints.WorkdirBusy) as info:
    training.load_context(str(work))
  _names_holder(str(info.value), process.pid, 'a test holder')
  with pytest.raises(checkpoints.WorkdirBusy) as info:
    reproduce.run_suite(str(work), 'smoke')
  _names_holder(str(info.value), process.pid, 'a test holder')
  figures = subprocess.run(
      [sys.executable, '-m', 'experiments.capsnet_figures',
       f'--workdir={work}'], cwd=REPO, capture_output=True, text=True,
      timeout=240, env=_env())
  assert figures.returncode == 2, figures.stderr
  assert len(figures.stderr.strip().splitlines()) == 1, figures.stderr
  assert figures.stderr.startswith(f'error: WorkdirBusy: {work} is in use '
                                   f'by a test holder (pid {process.pid}')
  assert not (work / 'figures').exists()
  process.kill()
  process.wait()

  reader = holder(work, mode='shared')
  training.load_context(str(work))  # readers share
  with pytest.raises(checkpoints.WorkdirBusy, match=(
      rf'^{re.escape(str(work))} is being read by another process \(a model '
      rf'loaded from its checkpoint\); rerun in a moment\.$')):
    with checkpoints.hold_workdir(str(work)):
      pass
  reader.kill()
  reader.wait()
