"""Integration tests of the dynamic-routing training loop on the shared MNIST.

The smoke CapsNet (same code as the paper model, smaller widths) must reach
97% test accuracy in under 5 minutes of CPU training (``check_smoke_capsnet``,
on the reproduction suite's smoke run), and a run killed with SIGKILL must
resume and end with the parameters of an uninterrupted run.
"""

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from capsjax import data as data_lib
from capsjax import training
from capsjax.training import checkpoints
from capsjax.training import loop
from capsjax.training import state as state_lib
from capsjax.training import vector_capsules
from experiments import launcher
from experiments.configs import baseline_cnn_mnist
from experiments.configs import capsnet_mnist
from tests import conftest
from tests.conftest import REPO
from tests.helpers import TINY
from tests.helpers import tiny_config
from tests.helpers import tiny_flags
from tests.helpers import write_tiny_mnist


def _launch(workdir, config, *overrides, module='experiments.train'):
  return subprocess.Popen(
      [sys.executable, '-m', module, f'--workdir={workdir}',
       f'--config={config}', *overrides],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env=conftest.training_env())


# A loaded model's class scores on uint8 images, as one compiled program
# (eagerly, each operation of the forward pass compiles on its own).
_test_scores = nnx.jit(lambda model, images: model(
    images.astype(jnp.float32) / 255.0, train=False)['class_scores'])


def check_smoke_capsnet(workdir):
  """The CI claim of the CapsNet smoke config (97% in under 5 minutes of
  CPU training), on a workdir that ran it: the reproduction suite's smoke
  run (tests/test_reproduce.py) trains it."""
  summary = json.load(open(workdir / 'summary.json'))
  print(json.dumps(summary, indent=1))
  assert summary['test']['accuracy'] >= 0.97, summary
  assert summary['validation']['accuracy'] >= 0.97, summary
  assert summary['train_wall_s_this_run'] < 300, summary
  # All 700 steps took 62 s of training on a 2-core CPU beside another run
  # (results/capsnet_mnist_smoke); the config's 280 s guard stops a machine
  # over 4 times slower early, after its first evaluation (step 350).
  num_train_steps = capsnet_mnist.get_config('smoke').num_train_steps
  assert 350 <= summary['steps'] <= num_train_steps, summary
  # The artefacts a user looks at.
  assert os.listdir(workdir / 'tensorboard')
  lines = open(workdir / 'metrics.jsonl').read().splitlines()
  assert any('validation/accuracy' in line for line in lines)


# Every command in experiments/ but benchmark, whose flags' defaults come
# from benchmarks.harness (which imports capsjax).
_COMMANDS = sorted(
    name[:-3] for name in os.listdir(os.path.join(REPO, 'experiments'))
    if name.endswith('.py') and not name.endswith('_lib.py')
    and name[:-3] not in ('__init__', 'launcher', 'benchmark'))


def test_the_commands_below_are_found():
  # An empty list would leave the test below with nothing to run.
  assert {'train', 'own_images', 'reproduce'} <= set(_COMMANDS)


@pytest.mark.parametrize('module', _COMMANDS)
def test_help_and_a_bad_flag_answer_without_importing_jax(module, tmp_path):
  """--help, a mistyped flag and a misspelt config key are answered before
  JAX is imported (0.3 s rather than 3 s): here a jax that cannot be
  imported stands first on the path."""
  (tmp_path / 'jax').mkdir()
  (tmp_path / 'jax' / '__init__.py').write_text(
      "raise ImportError('jax imported before the flags were read')\n")
  env = dict(os.environ, PYTHONPATH=str(tmp_path))
  run = lambda *args: subprocess.run(  # noqa: E731
      [sys.executable, '-m', f'experiments.{module}', *args], cwd=REPO,
      capture_output=True, text=True, timeout=120, env=env)
  out = out_help = run('--help')
  # Asking for help is no failure (absl's own --help exits 1).
  assert out.returncode == 0, out.stderr
  assert '--workdir' in out.stdout, out.stdout
  if module in ('capsnet_mnist', 'matrix_capsnet'):
    assert '--config' in out.stdout and 'resume' in out.stdout
  out = run(f'--workdir={tmp_path / "w"}', '--bogus=1')
  assert out.returncode == 2, out.stderr
  assert out.stderr == ("error: Unknown command line flag 'bogus' (see "
                        '--help)\n'), out.stderr
  # A misspelt config key that ml_collections itself can name (affnist's
  # batch sizes are per model, where the closest keys need capsjax).
  if '--config' in out_help.stdout and module != 'affnist':
    out = run(f'--workdir={tmp_path / "w"}', '--config.batch_sizee=8')
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith('error: ') and out.stderr.count('\n') == 1
    assert 'Did you mean "batch_size"' in out.stderr, out.stderr


def test_missing_data_is_a_clear_error(tmp_path):
  config = os.path.join(REPO, 'experiments/configs/capsnet_mnist.py:smoke')
  proc = _launch(tmp_path / 'w', config,
                 f'--config.data_dir={tmp_path / "nowhere"}')
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 2, out
  assert 'error:' in out and 'nowhere' in out
  assert 'Traceback' not in out


def test_bad_variant_is_a_clear_error():
  with pytest.raises(ValueError, match='unknown variant'):
    capsnet_mnist.get_config('nonsense')
  with pytest.raises(ValueError, match='unknown variant'):
    baseline_cnn_mnist.get_config('nonsense')


# ----------------------------------------------------------------------------
# Reliability on a tiny CapsNet and a tiny MNIST written in the IDX format:
# interruption at any point, a poisoned batch, bad config values, a full
# disk, determinism.


@pytest.fixture(scope='module')
def tiny_mnist(tmp_path_factory):
  return write_tiny_mnist(tmp_path_factory.mktemp('tiny_mnist'))


def _fresh_model(config):
  """The initial parameters of ``config``'s model, in checkpoint order."""
  model = state_lib.create_model(config, seed=config.seed)
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _params(workdir, which):
  model = checkpoints.load_trained_model(str(workdir), which=which)
  from flax import nnx
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _assert_same_params(workdir_a, workdir_b, which='latest'):
  for a, b in zip(_params(workdir_a, which), _params(workdir_b, which),
                  strict=True):
    np.testing.assert_array_equal(a, b)


# A training run that SIGKILLs itself at one chosen point (env
# CAPSJAX_TEST_KILL=KIND:STEP), then runs the experiment's command line:
#   train    after the update of step STEP, before it is logged or saved;
#   data     the arrays of checkpoint STEP written into orbax's temporary
#            directory, before the commit marker;
#   rename   checkpoint STEP complete in the temporary directory, before the
#            rename that publishes it;
#   renamed  just after that rename (before older checkpoints are deleted).
_KILL_DRIVER = r'''
import os, runpy, signal, sys
from orbax.checkpoint._src.path import async_path
from capsjax.training import metrics as metrics_lib

kind, target = os.environ['CAPSJAX_TEST_KILL'].split(':')
target = int(target)

def die():
  os.kill(os.getpid(), signal.SIGKILL)

def is_target(directory):  # checkpoints/TARGET[.orbax-checkpoint-tmp]
  return (directory.parent.name == 'checkpoints' and
          directory.name.split('.')[0] == str(target))

write, write_text, rename = (metrics_lib.MetricWriter.write,
                             async_path.write_text, async_path.rename)

def killing_write(self, step, scalars):
  if kind == 'train' and step == target:
    die()
  return write(self, step, scalars)

async def killing_write_text(path, text, **kwargs):
  if kind == 'data' and path.name == 'commit_success.txt' and is_target(
      path.parent):
    die()
  return await write_text(path, text, **kwargs)

async def killing_rename(src, dst):
  if kind == 'rename' and is_target(dst):
    die()
  result = await rename(src, dst)
  if kind == 'renamed' and is_target(dst):
    die()
  return result

metrics_lib.MetricWriter.write = killing_write
async_path.write_text = killing_write_text
async_path.rename = killing_rename
sys.argv[0] = 'capsnet_mnist'
runpy.run_module('experiments.train', run_name='__main__',
                 alter_sys=True)
'''


def _run_killed(workdir, flags, kind, step):
  config = os.path.join(REPO, 'experiments/configs/capsnet_mnist.py:smoke')
  env = conftest.training_env() | {'CAPSJAX_TEST_KILL': f'{kind}:{step}'}
  return subprocess.run(
      [sys.executable, '-c', _KILL_DRIVER, f'--workdir={workdir}',
       f'--config={config}', *flags],
      cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def kill_plan(seed, total_steps, every):
  """Three (kind, step) interruptions at increasing steps: one during
  training between two checkpoints (the most common kill), one between a
  checkpoint's write and its rename, and one of the other two points."""
  if every < 2:
    raise ValueError('a kill between checkpoints needs checkpoint_every >= 2')
  rng = np.random.default_rng(seed)
  kinds = ['train', 'rename', str(rng.choice(['data', 'renamed']))]
  rng.shuffle(kinds)
  saves = np.arange(every, total_steps + 1, every)
  steps = np.sort(rng.choice(saves, 3, replace=False))
  # A training kill one step before a save: after the last checkpoint, with
  # a step of unsaved work (saves are >= 2 apart, so the order holds).
  return [(kind, int(step) - (kind == 'train'))
          for kind, step in zip(kinds, steps, strict=True)]


# CAPSJAX_TEST_KILL_SEEDS=1,2,3 tries other interruption plans.
KILL_SEEDS = [int(s) for s in
              os.environ.get('CAPSJAX_TEST_KILL_SEEDS', '0').split(',')]


@pytest.mark.slow
@pytest.mark.parametrize('seed', KILL_SEEDS)
def test_sigkill_anywhere_incl_mid_checkpoint_resumes_bit_identically(
    tmp_path, tiny_mnist, seed):
  """Killed at three seeded points (one between a checkpoint's write and its
  rename), rerun each time: the end equals one uninterrupted run, bit for
  bit (final and selected parameters, validation and test results)."""
  flags = tiny_flags(tiny_mnist)
  config = os.path.join(REPO, 'experiments/configs/capsnet_mnist.py:smoke')
  straight = _launch(tmp_path / 'straight', config, *flags)
  out, _ = straight.communicate(timeout=600)
  assert straight.returncode == 0, out

  workdir = tmp_path / 'interrupted'
  checkpoints = workdir / 'checkpoints'
  every = TINY['checkpoint_every_steps']
  plan = kill_plan(seed, TINY['num_train_steps'], every)
  resume_from = None
  for kind, step in plan:
    result = _run_killed(workdir, flags, kind, step)
    assert result.returncode == -signal.SIGKILL, (
        kind, step, result.stdout + result.stderr)
    if resume_from is not None:
      assert (f'Resuming from the checkpoint of step {resume_from} '
              in result.stdout), result.stdout
    done = sorted(int(d) for d in os.listdir(checkpoints) if d.isdigit())
    pending = [d for d in os.listdir(checkpoints) if 'tmp' in d]
    # The checkpoint of `step` is published only by a kill after the rename.
    latest = step if kind == 'renamed' else (step - 1) // every * every
    assert (done[-1] if done else 0) == latest, (kind, step, done)
    if kind in ('data', 'rename'):
      # What the kill left half-written; the rerun must ignore it.
      assert pending == [f'{step}.orbax-checkpoint-tmp'], pending
      committed = (checkpoints / pending[0] / 'commit_success.txt').exists()
      assert committed == (kind == 'rename')
    else:
      assert not pending, pending
    resume_from = latest or None
    assert not (workdir / 'summary.json').exists()
  resumed = _launch(workdir, config, *flags)
  out, _ = resumed.communicate(timeout=600)
  assert resumed.returncode == 0, out
  if resume_from is not None:
    assert f'Resuming from the checkpoint of step {resume_from} ' in out, out

  for which in ('latest', 'best'):
    _assert_same_params(tmp_path / 'straight', workdir, which)
  summaries = [json.load(open(w / 'summary.json'))
               for w in (tmp_path / 'straight', workdir)]
  for key in ('steps', 'selected_step', 'validation', 'test'):
    assert summaries[0][key] == summaries[1][key], key
  # And the reported test accuracy is a direct count with the selected model.
  test = data_lib.load_dataset('mnist', data_dir=tiny_mnist,
                               validation_size=TINY['validation_size']).test
  model = training.load_trained_model(str(workdir), 'best')
  lengths = np.asarray(_test_scores(model, test.images))
  assert summaries[1]['test']['accuracy'] == pytest.approx(
      np.mean(np.argmax(lengths, -1) == test.labels), abs=1e-12)


def test_kill_plan_is_seeded_and_covers_a_kill_before_rename():
  for seed in range(20):
    plan = kill_plan(seed, 12, 2)
    assert plan == kill_plan(seed, 12, 2)
    kinds = [k for k, _ in plan]
    assert kinds.count('rename') == 1 and kinds.count('train') == 1
    steps = [step for _, step in plan]
    assert steps == sorted(set(steps))
    # The training kill falls between two checkpoints.
    assert all(step % 2 == 1 for kind, step in plan if kind == 'train')
    steps = [s for _, s in plan]
    assert steps == sorted(set(steps)) and 1 <= steps[0] and steps[-1] <= 12
    assert all(s % 2 == 0 for k, s in plan if k != 'train')


def test_without_selection_the_last_weights_are_tested(tmp_path, tiny_mnist):
  """``select_on_validation=False`` (Su's protocol): validation is watched,
  the last state is tested and reported, and no 'best' copy is kept."""
  workdir = str(tmp_path / 'work')
  config = tiny_config(tiny_mnist, select_on_validation=False, adam_epsilon=1e-7)
  summary = vector_capsules.train_and_evaluate(config, workdir)
  assert summary['selected_step'] == summary['steps'] == TINY['num_train_steps']
  records = [json.loads(line) for line in open(f'{workdir}/metrics.jsonl')]
  last_validation = [r for r in records if 'validation/accuracy' in r][-1]
  assert summary['validation']['step'] == last_validation['step'] == 12
  assert summary['validation']['accuracy'] == last_validation[
      'validation/accuracy']
  with pytest.raises(FileNotFoundError, match='no checkpoint'):
    checkpoints.load_trained_model(workdir, 'best')
  test = data_lib.load_dataset('mnist', data_dir=tiny_mnist,
                               validation_size=TINY['validation_size']).test
  model = checkpoints.load_trained_model(workdir)  # 'selected': the latest
  lengths = np.asarray(_test_scores(model, test.images))
  assert summary['test']['accuracy'] == pytest.approx(
      np.mean(np.argmax(lengths, -1) == test.labels), abs=1e-12)
  with pytest.raises(ValueError, match="which must be 'selected'"):
    checkpoints.load_trained_model(workdir, 'final')


def test_a_run_under_nohup_keeps_ignoring_the_hangup():
  previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
  try:
    assert checkpoints.stop_signals() == (signal.SIGINT, signal.SIGTERM)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    assert checkpoints.stop_signals() == (signal.SIGINT, signal.SIGTERM,
                                          signal.SIGHUP)
  finally:
    signal.signal(signal.SIGHUP, previous)


def test_each_stop_signal_becomes_a_stop_request_and_handlers_come_back():
  """In process, what the subprocess tests below check for Ctrl-C: each
  stop signal is a request between steps, a second one stops at once, and
  the handlers before are restored."""
  from capsjax.training import loop
  before = {signum: signal.getsignal(signum)
            for signum in checkpoints.stop_signals()}
  for signum in checkpoints.stop_signals():
    with loop._StopSignals() as stop:
      os.kill(os.getpid(), signum)
      assert stop.signum == signum
      with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signum)
  assert {signum: signal.getsignal(signum) for signum in before} == before


# Ctrl-C in the unit tier; the other signals take the same path (one
# handler for all three) and are the slow tier's.
@pytest.mark.parametrize('signum', [
    signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow),
    pytest.param(signal.SIGHUP, marks=[pytest.mark.slow, pytest.mark.skipif(
        signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
        reason='SIGHUP is ignored here (nohup), and so in the run')])])
def test_stop_signal_saves_the_current_step_and_says_so(tmp_path, tiny_mnist,
                                                        signum, capsys):
  """Ctrl-C, a scheduler's SIGTERM or a closed terminal's SIGHUP: a
  checkpoint of the current step, one line, exit 128 + signal; a rerun
  resumes there."""
  workdir = tmp_path / 'work'
  config = os.path.join(REPO, 'experiments/configs/capsnet_mnist.py:smoke')
  # Checkpoints every 1000 steps only: the saved step is the stop's.
  flags = tiny_flags(tiny_mnist, num_train_steps=100_000,
                      checkpoint_every_steps=1000, eval_every_steps=1000,
                      log_every_steps=1)
  proc = _launch(workdir, config, *flags)
  metrics = workdir / 'metrics.jsonl'
  deadline = time.monotonic() + 300
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
    assert proc.poll() is None and time.monotonic() < deadline, (
        proc.communicate()[0])
    time.sleep(0.2)
  proc.send_signal(signum)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signum, out
  lines = out.strip().splitlines()
  assert f'Starting fresh in {workdir}.' in lines, out
  assert 'Traceback' not in out, out
  match = re.fullmatch(rf'stopped at step (\d+), checkpoint saved in '
                       rf'{re.escape(str(workdir))}; rerun the same command '
                       rf'to resume', lines[-1])
  assert match, lines[-1]
  step = int(match.group(1))
  assert step >= 3
  assert checkpoints.Checkpointer(str(workdir / 'checkpoints')).latest_step(
  ) == step
  assert not (workdir / 'summary.json').exists()
  # The rerun in process (the command line's resume: the SIGKILL test).
  summary = vector_capsules.train_and_evaluate(tiny_config(
      tiny_mnist, num_train_steps=step + 2, checkpoint_every_steps=1000,
      eval_every_steps=1000), str(workdir))
  out = capsys.readouterr().out
  assert f'Resuming from the checkpoint of step {step} in {workdir}.' in out
  assert summary['steps'] == step + 2


def test_checkpoints_also_by_wall_time(tmp_path, tiny_mnist):
  """checkpoint_every_seconds: saved between the step-count checkpoints."""
  workdir = tmp_path / 'work'
  config = tiny_config(tiny_mnist, checkpoint_every_steps=1000,
                        eval_every_steps=1000, num_train_steps=7,
                        checkpoint_every_seconds=1e-6)
  vector_capsules.train_and_evaluate(config, str(workdir))
  saved = checkpoints.Checkpointer(str(workdir / 'checkpoints'))
  # Every step is past the time limit; the last 2 are kept.
  assert sorted(saved._manager.all_steps()) == [6, 7]
  config.checkpoint_every_seconds = -1.0
  with pytest.raises(ValueError, match='checkpoint_every_seconds'):
    vector_capsules.train_and_evaluate(config, str(tmp_path / 'other'))


def test_a_long_run_says_how_long_and_what_is_shorter(monkeypatch):
  config = capsnet_mnist.get_config()
  estimate = loop._Estimate(config)
  clock = [100.0]
  monkeypatch.setattr(loop.time, 'perf_counter', lambda: clock[0])
  estimate.start(1)
  clock[0] += 50.0  # the warm-up steps (5 s each) are not measured
  assert estimate.line(11) is None
  clock[0] += 20.0
  assert estimate.line(31) is None  # measured for too short a time
  clock[0] += 20.0  # 40 s for 40 steps of batch 128: 128 img/s
  line = estimate.line(51)
  remaining_h = (config.num_train_steps - 51) * 1.0 / 3600
  assert line.startswith(f'The remaining {config.num_train_steps - 51} steps '
                         f'take about {remaining_h:.0f} h at 128 img/s on '), line
  assert 'a checkpoint every 10 min and at Ctrl-C' in line
  assert line.endswith('Shorter: --config=experiments/configs/capsnet_mnist.py'
                       ':smoke trains a reduced CapsNet to about 97.5% in '
                       '1-2 minutes of training on a 2-core CPU.'), line
  assert estimate.line(40) is None  # said once
  short = loop._Estimate(capsnet_mnist.get_config('smoke'))
  short.start(1)
  assert short.line(11) is None
  clock[0] += 40.0
  assert short.line(300) is None  # 400 more steps: not long


def test_rerun_with_another_config_is_checked_before_anything_is_written(
    tmp_path, tiny_mnist, capsys):
  workdir = tmp_path / 'work'
  vector_capsules.train_and_evaluate(
      tiny_config(tiny_mnist, num_train_steps=4), str(workdir))
  stored = (workdir / 'config.json').read_bytes()
  files = sorted(p.relative_to(workdir) for p in workdir.rglob('*'))
  other_model = tiny_config(tiny_mnist, num_train_steps=4)
  other_model.model_options.conv1_channels = 16
  with pytest.raises(ValueError, match=(
      r'holds a checkpoint of another model: model_options.conv1_channels 8 '
      r'-> 16 .*Nothing was written. Use another --workdir')):
    vector_capsules.train_and_evaluate(other_model, str(workdir))
  assert (workdir / 'config.json').read_bytes() == stored
  assert sorted(p.relative_to(workdir) for p in workdir.rglob('*')) == files
  capsys.readouterr()
  # More steps and another implementation of the same parameters: accepted
  # and said; another learning rate: a warning.
  longer = tiny_config(tiny_mnist, num_train_steps=6, learning_rate=5e-3)
  longer.model_options.implementation = 'xla'
  summary = vector_capsules.train_and_evaluate(longer, str(workdir))
  out = capsys.readouterr().out
  assert ('Changed from the stored config: model_options.implementation None '
          "-> 'xla'; num_train_steps 4 -> 6.") in out, out
  assert ('Warning: resuming with values that differ from the stored config '
          '(the run is then no longer one protocol): learning_rate 0.002 -> '
          '0.005.') in out, out
  assert 'Resuming from the checkpoint of step 4' in out
  assert summary['steps'] == 6


def test_unwritable_workdir_names_it_and_the_fix(tmp_path, tiny_mnist):
  blocker = tmp_path / 'file'
  blocker.write_text('not a directory')
  workdir = blocker / 'work'
  with pytest.raises(OSError, match=(
      rf'cannot write to the workdir {re.escape(str(workdir))} \(.*\); '
      r'choose a --workdir you can write to')):
    vector_capsules.train_and_evaluate(tiny_config(tiny_mnist), str(workdir))


def _poisoned_at(make_steps, poison_step):
  """``make_steps`` whose train step reads NaN images at ``poison_step``."""

  def make(config, optimizer):
    steps = make_steps(config, optimizer)

    def train_step(graphdef, state, images, labels, key):
      # float32 0-255 pixels: the same inputs as the uint8 ones.
      images = jnp.where(state.step == poison_step, jnp.nan,
                         images.astype(jnp.float32))
      return steps.train_step(graphdef, state, images, labels, key)

    return steps._replace(train_step=train_step)

  return make


def test_poisoned_batch_stops_naming_the_step_and_keeps_last_good_checkpoint(
    tmp_path, tiny_mnist, monkeypatch):
  """NaN images at step 5: the run stops naming step 5 before anything
  later is saved, even though logging is rarer than checkpointing; a rerun
  without the poison resumes from step 5."""
  workdir = str(tmp_path / 'work')
  config = tiny_config(tiny_mnist, num_train_steps=8, log_every_steps=4,
                       checkpoint_every_steps=1)
  with monkeypatch.context() as patch, pytest.raises(
      loop.TrainingDiverged, match=r'non-finite at step 5\b') as info:
    patch.setattr(vector_capsules, 'make_steps',
                  _poisoned_at(vector_capsules.make_steps, 5))
    vector_capsules.train_and_evaluate(config, workdir)
  assert 'last good checkpoint (step 5)' in str(info.value)
  assert os.path.join(workdir, 'checkpoints') in str(info.value)
  checkpointer = checkpoints.Checkpointer(os.path.join(workdir, 'checkpoints'))
  assert checkpointer.latest_step() == 5
  checkpointer.close()
  assert all(np.all(np.isfinite(p)) for p in _params(workdir, 'latest'))

  clean = tiny_config(tiny_mnist, num_train_steps=8, log_every_steps=4,
                       checkpoint_every_steps=1)
  summary = vector_capsules.train_and_evaluate(clean, workdir)
  assert summary['steps'] == 8
  assert all(np.all(np.isfinite(p)) for p in _params(workdir, 'latest'))


def test_same_seed_and_config_give_identical_runs(tmp_path, tiny_mnist):
  """Two runs of one config on one device: the same parameters bit for bit
  and the same results; another seed gives other parameters."""
  summaries = {}
  for name, seed in (('a', 0), ('b', 0), ('other_seed', 1)):
    config = tiny_config(tiny_mnist, num_train_steps=4, seed=seed,
                          checkpoint_every_steps=4, eval_every_steps=4)
    summaries[name] = vector_capsules.train_and_evaluate(
        config, str(tmp_path / name))
  _assert_same_params(tmp_path / 'a', tmp_path / 'b')
  for key in ('validation', 'test', 'steps'):
    assert summaries['a'][key] == summaries['b'][key], key
  other = _params(tmp_path / 'other_seed', 'latest')
  assert any(not np.array_equal(x, y)
             for x, y in zip(_params(tmp_path / 'a', 'latest'), other,
                             strict=True))


def test_bfloat16_training_follows_float32_training(tmp_path, tiny_mnist):
  """compute_dtype=bfloat16 end to end: the same run as float32 within
  bfloat16's rounding, on float32 master parameters that do move."""
  runs = {}
  for dtype in ('float32', 'bfloat16'):
    config = tiny_config(tiny_mnist, num_train_steps=6, compute_dtype=dtype,
                          checkpoint_every_steps=6, eval_every_steps=6)
    summary = vector_capsules.train_and_evaluate(config, str(tmp_path / dtype))
    losses = [json.loads(line)['train/loss'] for line in
              open(tmp_path / dtype / 'metrics.jsonl') if 'train/loss' in line]
    runs[dtype] = summary, losses, _params(tmp_path / dtype, 'latest')
  (summary32, losses32, params32), (summary16, losses16, params16) = (
      runs['float32'], runs['bfloat16'])
  assert len(losses16) == len(losses32) == 6
  # bfloat16 keeps 8 bits of mantissa: 2^-8 relative per rounding.
  np.testing.assert_allclose(losses16, losses32, rtol=2e-2)
  assert summary16['test']['loss'] == pytest.approx(
      summary32['test']['loss'], rel=2e-2)
  model = _fresh_model(tiny_config(tiny_mnist))
  # The parameters moved as in float32, to within a fraction of the move
  # (Adam's normalised steps turn bfloat16's rounding of small gradients
  # into up to 22% of a tensor's move here, 3% overall).
  for p16, p32, p0 in zip(params16, params32, model, strict=True):
    assert p16.dtype == np.float32
    assert np.linalg.norm(p16 - p32) <= 0.4 * np.linalg.norm(p32 - p0)
  flat = {name: np.concatenate([p.ravel() for p in params]) for name, params in
          (('16', params16), ('32', params32), ('0', model))}
  assert np.linalg.norm(flat['16'] - flat['32']) <= 0.1 * np.linalg.norm(
      flat['32'] - flat['0'])


_BAD_VALUES = [
    ('model_options.num_iterations', 0, 'num_iterations must be a positive '
     'int'),
    ('model_options.conv1_channels', -8, 'conv1_channels must be a positive '
     'int, got -8'),
    ('log_every_steps', 0, 'config.log_every_steps must be a positive int, '
     'got 0'),
]


def test_bad_config_value_is_one_error_line_and_exit_2(tmp_path, tiny_mnist):
  """From the command line, one of the values below: the launcher turns the
  ValueError into one line (each value's message: the test below)."""
  key, value, message = _BAD_VALUES[1]
  config = os.path.join(REPO, 'experiments/configs/capsnet_mnist.py:smoke')
  proc = _launch(tmp_path / 'w', config, *tiny_flags(tiny_mnist),
                 f'--config.{key}={value}')
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 2, out
  errors = [line for line in out.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and message in errors[0], out
  assert 'Traceback' not in out


@pytest.mark.parametrize('key,value,message', _BAD_VALUES)
def test_bad_config_value_is_refused_before_training(tmp_path, tiny_mnist, key,
                                                     value, message):
  config = tiny_config(tiny_mnist)
  config.update_from_flattened_dict({key: value})
  workdir = tmp_path / 'w'
  with pytest.raises(ValueError, match=re.escape(message)):
    training.train(config, str(workdir))
  assert not (workdir / 'checkpoints').exists()


_FULL_DISK_DRIVER = r'''
import errno, os, runpy, sys
from orbax.checkpoint._src.path import async_path

# The disk fills up while checkpoint 4 is written (orbax's metadata writes).
write_text = async_path.write_text
async def full_disk(path, text, **kwargs):
  if '4.orbax-checkpoint-tmp' in str(path):
    raise OSError(errno.ENOSPC, 'No space left on device', str(path))
  return await write_text(path, text, **kwargs)
async_path.write_text = full_disk
sys.argv[0] = 'capsnet_mnist'
runpy.run_module('experiments.train', run_name='__main__',
                 alter_sys=True)
'''


def test_full_disk_while_saving_is_one_clear_error_and_keeps_checkpoint(
    tmp_path, tiny_mnist):
  workdir = tmp_path / 'w'
  config = os.path.join(REPO, 'experiments/configs/capsnet_mnist.py:smoke')
  out = subprocess.run(
      [sys.executable, '-c', _FULL_DISK_DRIVER, f'--workdir={workdir}',
       f'--config={config}', *tiny_flags(tiny_mnist, eval_every_steps=100)],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env=conftest.training_env())
  assert out.returncode == 2, out.stdout + out.stderr
  assert out.stderr.startswith('error: OSError: saving the checkpoint of '
                               'step 4'), out.stderr
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr
  for part in (str(workdir / 'checkpoints'), 'No space left on device',
               'previous checkpoint is intact', 'Free disk space'):
    assert part in out.stderr
  checkpointer = checkpoints.Checkpointer(str(workdir / 'checkpoints'))
  assert checkpointer.latest_step() == 2
  checkpointer.close()
  assert all(np.all(np.isfinite(p)) for p in _params(workdir, 'latest'))


def test_max_train_seconds_stops_with_a_checkpoint_and_a_summary(
    tmp_path, tiny_mnist):
  """A time limit shorter than a step: the run stops after its first step
  as if it were the last (validated, checkpointed, tested); a rerun of the
  same command resumes and stops one step later."""
  workdir = str(tmp_path / 'work')
  config = tiny_config(tiny_mnist, num_train_steps=12)
  del config['max_train_seconds']  # an int in the config; a float here
  config.max_train_seconds = 1e-9
  summary = vector_capsules.train_and_evaluate(config, workdir)
  assert summary['steps'] == 1, summary
  assert summary['selected_step'] == 1 and summary['test']
  checkpointer = checkpoints.Checkpointer(os.path.join(workdir, 'checkpoints'))
  assert checkpointer.latest_step() == 1
  checkpointer.close()
  again = vector_capsules.train_and_evaluate(config, workdir)
  assert again['steps'] == 2, again


def test_a_time_limited_run_says_so_and_a_finished_one_is_not_retrained(
    tiny_mnist, tmp_path, capsys):
  workdir = str(tmp_path / 'w')
  summary = vector_capsules.train_and_evaluate(
      tiny_config(tiny_mnist, max_train_seconds=1e-3), workdir)
  out = capsys.readouterr().out
  assert summary['stopped_by_time_limit'] and summary['steps'] < 12, summary
  assert 'Stopped early by max_train_seconds=0.001' in out, out
  assert f'Summary: {os.path.join(workdir, "summary.json")}' in out
  assert summary['conv_backend'] in out  # the header names the backend
  # The rerun trains on to the end, then a third run trains nothing.
  summary = vector_capsules.train_and_evaluate(tiny_config(tiny_mnist), workdir)
  assert summary['steps'] == 12 and not summary['stopped_by_time_limit']
  assert 'has finished training' not in capsys.readouterr().out
  vector_capsules.train_and_evaluate(tiny_config(tiny_mnist), workdir)
  out = capsys.readouterr().out
  assert f'{workdir} has finished training (step 12)' in out, out
  assert 'Test accuracy ' in out and 'Stopped early' not in out


@pytest.mark.parametrize('args, message', [
    (['--config.conv1_channels=48'],
     'Did you mean --config.model_options.conv1_channels?'),
    (['--config=experiments/configs/capsnet_mnst.py:smoke'],
     'no config file experiments/configs/capsnet_mnst.py. The configs: '),
])
def test_a_wrong_key_or_config_says_what_there_is(tmp_path, args, message):
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.train',
       f'--workdir={tmp_path / "w"}', *args], cwd=REPO, capture_output=True,
      text=True, timeout=120)
  assert out.returncode == 2 and message in out.stderr, out.stderr
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr
  assert not (tmp_path / 'w').exists()


@pytest.mark.parametrize('config_file', sorted(
    f for f in os.listdir(launcher.CONFIG_DIR)
    if f.endswith('.py') and f not in ('common.py', '__init__.py')))
def test_config_help_gives_every_key_a_meaning(config_file):
  """--config_help explains every key of every shipped config; a shared key
  is explained where it is defined, not by a variant's comment on its
  value."""
  module = importlib.import_module(f'experiments.configs.{config_file[:-3]}')
  text = launcher.config_description(
      module.get_config('smoke'), os.path.join(launcher.CONFIG_DIR,
                                               config_file))
  keys = [line for line in text.splitlines()
          if line.startswith('  ') and not line.startswith('   ')
          and ' = ' in line]
  assert keys and all('  # ' in line for line in keys), [
      line for line in keys if '  # ' not in line]
  for line in keys:
    if line.split(' = ')[0].strip() == 'num_train_steps':
      assert line.endswith('# Training steps in all (a rerun with more '
                           'continues).'), line


def test_annealed_variant_reaches_1e_6_at_the_last_step():
  """capsnet_mnist.py:annealed: the official decay shape (x0.96 per period,
  continuous) with the period that takes 1e-3 to about 1e-6 at the last
  step, also for a num_train_steps set after the variant."""
  from capsjax.training import state as state_lib
  config = capsnet_mnist.get_config('annealed')
  assert (config.learning_rate, config.lr_decay_rate) == (1e-3, 0.96)
  for steps in (21_500, 5_000):
    config.num_train_steps = steps
    schedule = state_lib.learning_rate_schedule(config)
    last = float(schedule(steps))
    assert 0.8e-6 < last < 1.25e-6, (steps, last)
    # The official shape: continuous, 0.96 per period.
    period = config.lr_decay_steps
    assert abs(float(schedule(period)) / 1e-3 - 0.96) < 1e-6
    assert float(schedule(period // 2)) < 1e-3
