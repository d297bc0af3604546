"""experiments.reproduce: the suites, stopping and resuming, the records.

The runner's behaviour is tested on a stand-in experiment without JAX
(tests/fake_experiment.py); the smoke suite itself runs end to end in the
slow test at the bottom, which also holds the checks of the per-experiment
smoke runs it covers (CapsNet and EM learning, two-digit, MultiMNIST,
affNIST).
"""

import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from experiments import reproduce
from experiments.configs import capsnet_mnist
from tests import conftest
from tests.conftest import REPO


def _fake(name, steps, *, step_s=0.02, save_s=0.0, fail=False, after=(),
          needs=None):
  def args(workdir, options):
    return [f'--workdir={workdir}', f'--steps={steps}', f'--step_s={step_s}',
            f'--save_s={save_s}'] + (['--fail'] if fail else [])
  rows = lambda workdir: [reproduce._run_row(  # noqa: E731
      reproduce._read(os.path.join(workdir, 'summary.json')), f'row {name}',
      '1.0%')]
  return reproduce.Experiment(name, 'tests.fake_experiment', args,
                              'summary.json', rows,
                              needs=needs or (lambda options: ''),
                              after=after)


@pytest.fixture
def fake_suite(monkeypatch):
  """Replace the 'paper' suite by the experiments the test sets."""
  suite = []
  monkeypatch.setattr(reproduce, 'suite_experiments',
                      lambda name: list(suite))
  return suite


def _state(workdir):
  return json.load(open(workdir / 'reproduction.json'))


def test_time_limit_stops_the_running_experiment_and_a_rerun_finishes(
    tmp_path, fake_suite, capfd):
  fake_suite += [_fake('a', 100, step_s=0.03), _fake('b', 3)]
  status = reproduce.run_suite(str(tmp_path), 'paper', max_seconds=1.0)
  assert status == reproduce.EXIT_TIME_LIMIT
  state = _state(tmp_path)
  a, b = state['experiments']['a'], state['experiments']['b']
  assert a['status'] == 'stopped at the time limit; rerun to continue'
  assert b['status'] == 'not started: time limit'
  assert a['calls'] == 1 and 0.9 < a['wall_s'] < 10
  stopped = int(open(tmp_path / 'a' / 'step.txt').read())
  assert 0 < stopped < 100
  assert f'stopped at step {stopped}' in open(
      tmp_path / 'a' / 'reproduce.log').read()
  assert 'rerun the same command to continue' in capfd.readouterr().out
  first_wall = a['wall_s']

  assert reproduce.run_suite(str(tmp_path), 'paper') == 0
  state = _state(tmp_path)
  a, b = state['experiments']['a'], state['experiments']['b']
  assert a['status'] == b['status'] == 'finished'
  assert a['calls'] == 2 and a['wall_s'] > first_wall  # both calls added
  log = open(tmp_path / 'a' / 'reproduce.log').read()
  assert f'starting at step {stopped}' in log  # resumed, not restarted
  assert a['rows'] == [{
      'row': 'row a', 'metric': 'test error', 'paper': '1.0%', 'test': 0.25,
      'validation': 0.2, 'steps': 100, 'epochs': 10.0, 'images_per_s': 100.0,
      'device': 'cpu:fake', 'commit': 'abcdef0123'}]
  table = open(tmp_path / 'REPRODUCTION.md').read()
  assert '| row a | test error | 1.0% | 25.00% | 20.00% | 100 | 10.00 |' in table
  assert '| cpu:fake | abcdef0 | finished |' in table

  # A third call finds everything finished and runs nothing.
  assert reproduce.run_suite(str(tmp_path), 'paper') == 0
  assert _state(tmp_path)['experiments']['a']['calls'] == 2


def test_the_log_is_written_as_the_experiment_runs(tmp_path, fake_suite):
  fake_suite += [_fake('a', 60, step_s=0.05)]
  log, summary = tmp_path / 'a' / 'reproduce.log', tmp_path / 'a' / 'summary.json'
  seen_while_running = []

  def watch():
    while not summary.exists():
      if log.exists() and 'starting at step 0' in log.read_text():
        seen_while_running.append(not summary.exists())
        return
      time.sleep(0.02)

  watcher = threading.Thread(target=watch)
  watcher.start()
  assert reproduce.run_suite(str(tmp_path), 'paper') == 0
  watcher.join()
  assert seen_while_running == [True]  # not only once it has ended


def test_a_failure_outranks_the_time_limit_in_the_exit_status(tmp_path,
                                                             fake_suite):
  fake_suite += [_fake('broken', 3, fail=True), _fake('long', 1000)]
  assert reproduce.run_suite(str(tmp_path), 'paper', max_seconds=1.0) == 2
  state = _state(tmp_path)['experiments']
  assert state['broken']['status'].startswith('failed (exit 1)')
  assert state['long']['status'] == (
      'stopped at the time limit; rerun to continue')


def test_a_closed_terminal_loses_no_output_and_blocks_no_experiment(
    tmp_path, fake_suite, monkeypatch):
  class Closed:  # what a hangup leaves of the terminal
    def write(self, data):
      raise OSError(5, 'Input/output error')

    def flush(self):
      raise OSError(5, 'Input/output error')

  monkeypatch.setattr(sys, 'stdout', Closed())
  fake_suite += [_fake('a', 40, step_s=0.01), _fake('b', 2)]
  assert reproduce.run_suite(str(tmp_path), 'paper') == 0
  for name, steps in (('a', 40), ('b', 2)):
    log = (tmp_path / name / 'reproduce.log').read_text()
    assert f'fake experiment: finished at step {steps}' in log, log


def test_a_failure_is_recorded_with_its_log_and_the_rest_still_runs(
    tmp_path, fake_suite):
  fake_suite += [_fake('broken', 3, fail=True), _fake('fine', 3)]
  assert reproduce.run_suite(str(tmp_path), 'paper') == 2
  state = _state(tmp_path)['experiments']
  log = tmp_path / 'broken' / 'reproduce.log'
  assert state['broken']['status'] == f'failed (exit 1); see {log}'
  assert 'failing as asked' in open(log).read()
  assert state['fine']['status'] == 'finished'
  assert state['broken']['rows'] == []
  assert '| broken |' in open(tmp_path / 'REPRODUCTION.md').read()


def test_dependencies_wait_and_missing_data_skips(tmp_path, fake_suite):
  fake_suite += [
      _fake('attack', 2, after=('model',)),
      _fake('norb', 2, needs=lambda options: '' if options.smallnorb_dir
            else 'skipped: no --smallnorb_dir'),
      _fake('model', 2)]
  assert reproduce.run_suite(str(tmp_path), 'paper', only=['attack', 'norb']
                             ) == 0
  state = _state(tmp_path)['experiments']
  assert state['attack']['status'] == 'waits for model'
  assert state['norb']['status'] == 'skipped: no --smallnorb_dir'
  assert 'model' not in state  # --only
  reproduce.run_suite(str(tmp_path), 'paper')
  state = _state(tmp_path)['experiments']
  assert state['attack']['status'] == 'waits for model'  # model ran after it
  assert state['model']['status'] == 'finished'
  reproduce.run_suite(str(tmp_path), 'paper')
  assert _state(tmp_path)['experiments']['attack']['status'] == 'finished'


_HANGUP_IGNORED = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


@pytest.mark.parametrize('signum', [
    signal.SIGINT,
    # A closed terminal; under nohup SIGHUP stays ignored, so not here.
    pytest.param(signal.SIGHUP, marks=pytest.mark.skipif(
        _HANGUP_IGNORED, reason='SIGHUP is ignored (nohup)'))])
def test_ctrl_c_is_passed_on_once_and_the_experiment_saves(tmp_path,
                                                           fake_suite, signum):
  fake_suite += [_fake('long', 1000, step_s=0.05), _fake('next', 2)]
  timer = threading.Timer(1.5, os.kill, (os.getpid(), signum))
  timer.start()
  try:
    status = reproduce.run_suite(str(tmp_path), 'paper')
  finally:
    timer.cancel()
  assert status == 128 + signum
  state = _state(tmp_path)['experiments']
  assert state['long']['status'] == 'interrupted; rerun to continue'
  assert state['next']['status'] == 'not started'
  assert 'stopped at step' in open(tmp_path / 'long' / 'reproduce.log').read()


def test_a_signal_between_experiments_starts_no_other(tmp_path, fake_suite):
  """SIGTERM while the suite checks an experiment (no child running): the
  next one is not started and the suite exits at once."""
  def needs(options):
    os.kill(os.getpid(), signal.SIGTERM)
    return 'skipped: no data'
  fake_suite += [_fake('skipped', 2, needs=needs), _fake('next', 1000)]
  began = time.monotonic()
  assert reproduce.run_suite(str(tmp_path), 'paper') == 128 + signal.SIGTERM
  assert time.monotonic() - began < 10
  assert _state(tmp_path)['experiments']['next']['status'] == 'not started'


def test_a_signal_while_the_experiment_starts_reaches_it(tmp_path, fake_suite,
                                                         monkeypatch):
  """SIGTERM after the experiment's process started but before the suite
  knew it as its child is still passed on: it saves and stops."""
  class SignalledAtStart(reproduce._Child):
    def __init__(self, argv, log_path):
      super().__init__(argv, log_path)
      deadline = time.monotonic() + 30
      while time.monotonic() < deadline and not (
          os.path.exists(log_path) and 'starting at step' in open(
              log_path).read()):
        time.sleep(0.05)  # until its signal handlers are in place
      os.kill(os.getpid(), signal.SIGTERM)
  monkeypatch.setattr(reproduce, '_Child', SignalledAtStart)
  fake_suite += [_fake('long', 1000, step_s=0.05)]
  began = time.monotonic()
  assert reproduce.run_suite(str(tmp_path), 'paper') == 128 + signal.SIGTERM
  assert time.monotonic() - began < 20
  assert _state(tmp_path)['experiments']['long']['status'] == (
      'interrupted; rerun to continue')
  assert 'stopped at step' in open(tmp_path / 'long' / 'reproduce.log').read()


def test_a_workdir_belongs_to_one_suite(tmp_path, fake_suite):
  fake_suite.append(_fake('a', 1))
  reproduce.run_suite(str(tmp_path), 'paper')
  with pytest.raises(ValueError, match="belongs to the 'paper' suite"):
    reproduce.run_suite(str(tmp_path), 'smoke')


def test_only_names_must_be_experiments_of_the_suite():
  with pytest.raises(ValueError, match="--only names \\['capsnet'\\].*"
                     "'capsnet_mnist'"):
    reproduce.select(reproduce.suite_experiments('paper'), ['capsnet'])


def _flags(argv):
  return dict(arg[2:].split('=', 1) for arg in argv if arg.startswith('--'))


@pytest.mark.parametrize('suite', ['paper', 'smoke', 'bench'])
def test_every_command_names_a_module_a_config_and_its_keys(suite):
  """Each experiment's module exists, its config file and variant load and
  every --config.KEY override names a key of that config."""
  options = reproduce.Options('/data', '/affnist', '/norb', 3)
  for experiment in reproduce.suite_experiments(suite):
    argv = reproduce.command(experiment, '/w', options)
    assert importlib.util.find_spec(experiment.module), experiment
    flags = _flags(argv)
    if suite == 'bench':
      assert flags['steps'] == '3' and flags['output'].startswith('/w/')
      continue
    assert flags['workdir'] == f'/w/{experiment.name}'
    path, _, variant = flags['config'].partition(':')
    spec = importlib.util.spec_from_file_location('config', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(variant)
    for key in (k for k in flags if k.startswith('config.')):
      node = config
      for part in key.split('.')[1:]:
        assert part in node, (experiment.name, key)
        node = node[part]
    assert ('smoke' in variant or variant == 'small') == (suite == 'smoke'), (
        experiment.name, variant)


def test_paper_suite_order_and_data_flags():
  options = reproduce.Options('/data', '/affnist', '/norb')
  experiments = reproduce.suite_experiments('paper')
  names = [e.name for e in experiments]
  # The order for scarce GPU time: CapsNet MNIST, matrix capsules
  # MNIST, the two-digit test, MultiMNIST, then the rest.
  assert names[:4] == ['capsnet_mnist', 'matrix_capsnet_mnist',
                       'two_digit_transfer', 'multimnist']
  # Section 7's other datasets last, each only with its directory.
  assert names[-3:] == ['capsnet_smallnorb', 'capsnet_svhn', 'capsnet_cifar10']
  assert len(names) == len(set(names)) == 30
  assert 'efficient_capsnet_mnist' in names
  commands = {e.name: _flags(reproduce.command(e, '/w', options))
              for e in experiments}
  # The first row is the official code's form; the text's form and a
  # second seed of each are the check on it, at the same protocol.
  for name, variant, seed in (('capsnet_mnist', '', None),
                              ('capsnet_mnist_text', ':text', None),
                              ('capsnet_mnist_seed1', '', '1'),
                              ('capsnet_mnist_text_seed1', ':text', '1'),
                              ('capsnet_mnist_annealed', ':annealed', '0'),
                              ('capsnet_mnist_annealed_seed1', ':annealed',
                               '1'),
                              ('capsnet_mnist_annealed_seed2', ':annealed',
                               '2'),
                              ('capsnet_mnist_norecon_seed2', ':norecon', '2'),
                              ('capsnet_mnist_iter1_seed1', ':iter1', '1'),
                              ('capsnet_mnist_iter1_norecon_seed2',
                               ':iter1,norecon', '2')):
    assert commands[name]['config'].endswith('capsnet_mnist.py' + variant)
    assert commands[name].get('config.seed') == seed
    assert commands[name]['config.data_dir'] == '/data'
  assert commands['efficient_capsnet_mnist_seed1']['config'].endswith(
      'efficient_capsnet_mnist.py')
  assert commands['efficient_capsnet_mnist_seed2']['config.seed'] == '2'
  assert not {'capsnet_mnist_text', 'capsnet_mnist_seed1',
              'efficient_capsnet_mnist_seed1'} & {
      e.name for e in reproduce.suite_experiments('smoke')}
  assert commands['affnist']['config.affnist_dir'] == '/affnist'
  assert commands['smallnorb']['config.data_dir'] == '/norb'
  assert commands['capsnet_fashion_mnist']['config.data_dir'] == '/data'
  assert commands['efficient_capsnet_mnist']['config'].endswith(
      'efficient_capsnet_mnist.py')
  assert commands['adversarial']['models'] == (
      '/w/capsnet_mnist,/w/baseline_cnn_mnist,/w/matrix_capsnet_mnist')
  assert 'config.affnist_dir' not in _flags(reproduce.command(
      experiments[names.index('affnist')], '/w', reproduce.Options()))
  smallnorb = experiments[names.index('smallnorb')]
  assert smallnorb.needs(reproduce.Options()).startswith('skipped')
  assert smallnorb.needs(options) == ''


def test_section_7_rows_need_their_directories():
  options = reproduce.Options(smallnorb_dir='/norb', cifar10_dir='/cifar',
                              svhn_dir='/svhn')
  for suite, variant in (('paper', ''), ('smoke', ':smoke')):
    by_name = {e.name: e for e in reproduce.suite_experiments(suite)}
    for name, module, directory, flag in (
        ('capsnet_smallnorb', 'train', '/norb', 'smallnorb_dir'),
        ('capsnet_svhn', 'train', '/svhn', 'svhn_dir'),
        ('capsnet_cifar10', 'capsnet_ensemble', '/cifar', 'cifar10_dir')):
      experiment = by_name[name]
      assert experiment.module == f'experiments.{module}'
      flags = _flags(reproduce.command(experiment, '/w', options))
      assert flags['config.data_dir'] == directory
      assert flags['config'].endswith(f'{name}.py{variant}')
      assert experiment.needs(options) == ''
      assert experiment.needs(reproduce.Options()) == f'skipped: no --{flag}'


def test_bench_rows_give_the_fraction_of_the_device_peak(tmp_path):
  from capsjax import flops
  row = {'model': 'capsnet_mnist', 'batch_size': 128, 'dtype': 'bfloat16',
         'train_images_per_s': 1280.0, 'eval_images_per_s': 5000.0,
         'train_step_s': 0.1, 'train_flops_xla': 2e12, 'compile_s': 12.0,
         'peak_memory_bytes': 3 * 2**30, 'steps': 20,
         'device': 'gpu:NVIDIA H100 80GB HBM3'}
  (tmp_path / 'bench.json').write_text(json.dumps({'rows': [
      row, dict(row, dtype='float32', device='cpu:cpu')]}))
  h100, cpu = reproduce._bench_rows(str(tmp_path))
  assert h100['fraction_of_peak'] == pytest.approx(
      2e12 / 0.1 / flops.DEVICE_PEAKS['H100'].bfloat16_flops)
  assert cpu['fraction_of_peak'] is None  # no datasheet peak for a CPU
  state = {'suite': 'bench', 'experiments': {'x': {
      'status': 'finished', 'wall_s': 30.0, 'rows': [h100]}}}
  assert ('| capsnet_mnist batch 128 bfloat16 | 1280.0 | 5000.0 | 12.0 | '
          '3.00 | 0.020 | gpu:NVIDIA H100 80GB HBM3 | finished |'
          ) in reproduce.markdown(state, ['x'])


def test_readme_block_is_replaced_and_a_missing_block_is_named(tmp_path):
  readme = tmp_path / 'README.md'
  readme.write_text(f'# t\nbefore\n{reproduce.README_BEGIN}\nold table\n'
                    f'{reproduce.README_END}\nafter\n')
  reproduce.update_readme(str(readme), '| new |\n')
  assert readme.read_text() == (f'# t\nbefore\n{reproduce.README_BEGIN}\n'
                                f'| new |\n{reproduce.README_END}\nafter\n')
  (tmp_path / 'plain.md').write_text('# no block\n')
  with pytest.raises(ValueError, match='has no <!-- reproduction:begin -->'):
    reproduce.update_readme(str(tmp_path / 'plain.md'), '| new |\n')


def test_readme_block_keeps_the_rows_other_workdirs_wrote(tmp_path):
  """A suite workdir writes its rows without erasing another's; its own
  rows are replaced (and dropped when no longer finished); a new header
  replaces the block whole."""
  header = '| experiment | test |\n|---|---|\n'
  readme = tmp_path / 'README.md'
  readme.write_text(f'{reproduce.README_BEGIN}\n{header}| gpu row | 1 |\n'
                    f'| B | 2 |\n{reproduce.README_END}\n')
  block = lambda rows: (f'{reproduce.README_BEGIN}\n{header}{rows}'  # noqa: E731
                        f'{reproduce.README_END}\n')
  ours = reproduce.update_readme(str(readme), f'{header}| B | 3 |\n| C | 4 |\n')
  assert ours == ['B', 'C']
  assert readme.read_text() == block('| gpu row | 1 |\n| B | 3 |\n| C | 4 |\n')
  ours = reproduce.update_readme(str(readme), f'{header}| C | 5 |\n', ours)
  assert readme.read_text() == block('| gpu row | 1 |\n| C | 5 |\n')
  other = '| experiment | test | device |\n|---|---|---|\n| D | 5 | cpu |\n'
  reproduce.update_readme(str(readme), other, ours)
  assert readme.read_text() == (f'{reproduce.README_BEGIN}\n{other}'
                                f'{reproduce.README_END}\n')


def test_readme_block_gets_the_mean_and_range_of_each_claims_seeds(tmp_path):
  """Seeds written by different workdirs are averaged together; a claim
  with one seed gets no mean; a rewrite replaces the mean rows."""
  header = reproduce.markdown({'suite': 'paper', 'experiments': {}},
                              []).rstrip('\n') + '\n'
  row = lambda title, test, val, device: (  # noqa: E731
      f'| {title} | test error | 0.25% | {test} | {val} | 21500 | 50.12 | '
      f'1.00 h | 100.0 | {device} | abc1234 | finished |\n')
  readme = tmp_path / 'README.md'
  # (its row twice, as two blocks merged by git may hold it: counted once)
  readme.write_text(f'{reproduce.README_BEGIN}\n{header}' +
                    row('A, seed 1', '0.38%', '0.32%', 'gpu:H200') * 2 +
                    f'{reproduce.README_END}\n')
  table = (header + row('A', '0.42%', '0.30%', 'cpu:cpu') +
           row('B, seed 0', '0.30%', '-', 'cpu:cpu') +
           row('B, seed 1', '0.36%', '-', 'cpu:cpu') +
           row('B, seed 2', '0.27%', '-', 'cpu:cpu') +
           row('C', '0.50%', '0.40%', 'cpu:cpu') +
           row('D, seeded', '0.10%', '0.10%', 'cpu:cpu'))
  for _ in range(2):
    reproduce.update_readme(str(readme), table)
    lines = readme.read_text().splitlines()[3:-1]
    titles = [line.split(' | ')[0][2:] for line in lines]
    assert titles == ['A, seed 1', 'A', 'A, mean of 2 seeds', 'B, seed 0',
                      'B, seed 1', 'B, seed 2', 'B, mean of 3 seeds', 'C',
                      'D, seeded']
  assert lines[2] == ('| A, mean of 2 seeds | test error | 0.25% | 0.40% '
                      '(0.38-0.42%) | 0.31% (0.30-0.32%) | 21500 | 50.12 | - | '
                      '- | cpu:cpu, gpu:H200 | - | finished |')
  assert lines[6].startswith('| B, mean of 3 seeds | test error | 0.25% | '
                             '0.31% (0.27-0.36%) | - | 21500 | 50.12 | - | - | '
                             'cpu:cpu | - |')
  other = '| experiment | test |\n|---|---|\n| X | 1 |\n| X, seed 1 | 2 |\n'
  assert reproduce.seed_means(other.splitlines()[0],
                              other.splitlines()[2:]) == other.splitlines()[2:]


def test_the_projects_rows_file_has_the_block_and_the_header_it_writes():
  """docs/paper_suite_results.md, where the project keeps the paper suite's rows:
  its block exists and starts with the header ``markdown`` writes, so a
  ``--readme`` call merges into it instead of replacing it."""
  text = open(os.path.join(REPO, 'docs', 'paper_suite_results.md')).read()
  start = text.index(reproduce.README_BEGIN) + len(reproduce.README_BEGIN)
  block = text[start:text.index(reproduce.README_END)].strip().splitlines()
  header = reproduce.markdown({'suite': 'paper', 'experiments': {}},
                              []).strip().splitlines()
  assert block[:2] == header and len(block) > 2


def test_readme_gets_every_finished_row_and_a_finished_run_keeps_its_command(
    tmp_path, fake_suite):
  fake_suite += [_fake('a', 2), _fake('b', 2), _fake('c', 2)]
  readme = tmp_path / 'README.md'
  readme.write_text(f'{reproduce.README_BEGIN}\n{reproduce.README_END}\n')
  workdir = tmp_path / 'suite'
  assert reproduce.run_suite(str(workdir), 'paper', only=['b'],
                             readme=str(readme)) == 0
  state = _state(workdir)
  # A run that finished keeps the command that ran it, whatever the
  # config path is now.
  state['experiments']['b']['command'] = 'python -m ran --this'
  (workdir / 'reproduction.json').write_text(json.dumps(state))
  assert reproduce.run_suite(str(workdir), 'paper', only=['a'],
                             readme=str(readme)) == 0
  assert _state(workdir)['experiments']['b']['command'] == (
      'python -m ran --this')
  # Both finished rows, in suite order; c never ran.
  table = readme.read_text()
  assert table.index('| row a |') < table.index('| row b |')
  assert '| row c |' not in table and '| c |' not in table


def test_every_record_is_refreshed_and_the_readme_waits_for_a_finished_row(
    tmp_path, fake_suite):
  fake_suite += [_fake('a', 2), _fake('b', 2), _fake('long', 1000)]
  readme = tmp_path / 'README.md'
  progress = 'In progress: the hand-written state of a long run.\n'
  readme.write_text(f'{reproduce.README_BEGIN}\n{progress}'
                    f'{reproduce.README_END}\n')
  workdir = tmp_path / 'suite'
  assert reproduce.run_suite(str(workdir), 'paper', only=['long'],
                             max_seconds=1.0, readme=str(readme)) == 3
  assert progress in readme.read_text()  # nothing finished: kept
  assert reproduce.run_suite(str(workdir), 'paper', only=['a', 'b'],
                             readme=str(readme)) == 0
  # b's result is removed (to run it again) and a's record is stale:
  # a call that selects neither still refreshes both.
  os.remove(workdir / 'b' / 'summary.json')
  state = _state(workdir)
  state['experiments']['a']['rows'][0]['test'] = 0.99
  (workdir / 'reproduction.json').write_text(json.dumps(state))
  reproduce.run_suite(str(workdir), 'paper', only=['long'], max_seconds=0.5,
                      readme=str(readme))
  state = _state(workdir)['experiments']
  assert state['a']['rows'][0]['test'] == 0.25
  assert state['b']['status'] == 'its summary.json is gone; rerun to run it again'
  assert state['b']['rows'] == []
  table = readme.read_text()
  assert '| row a |' in table and '| row b |' not in table
  assert '| long |' in (workdir / 'REPRODUCTION.md').read_text()


def test_an_unreadable_record_is_named_and_the_rest_are_tabled(tmp_path,
                                                               fake_suite):
  def broken_rows(workdir):
    raise KeyError('epsilons')
  fake_suite += [_fake('a', 2)._replace(rows=broken_rows), _fake('b', 2)]
  assert reproduce.run_suite(str(tmp_path), 'paper') == 0
  state = _state(tmp_path)['experiments']
  assert state['a']['rows_error'] == "KeyError: 'epsilons'"
  table = (tmp_path / 'REPRODUCTION.md').read_text()
  assert "| a |" in table and "its record cannot be read: KeyError" in table
  assert '| row b |' in table


def test_finished_only_table_keeps_unfinished_rows_out():
  state = {'suite': 'paper', 'experiments': {
      'a': {'status': 'finished', 'wall_s': 4000.0, 'rows': [
          {'row': 'A', 'metric': 'test error', 'paper': '0.25%',
           'test': 0.003, 'validation': None, 'steps': 10, 'epochs': None,
           'images_per_s': None, 'device': 'gpu:H100', 'commit': None}]},
      'b': {'status': 'stopped at the time limit; rerun to continue',
            'wall_s': 5.0}}}
  table = reproduce.markdown(state, ['a', 'b'], finished_only=True)
  assert '| A | test error | 0.25% | 0.30% | - | 10 | - | 1.11 h | - | ' \
         'gpu:H100 | - | finished |' in table
  assert '| b |' not in table
  assert '| b |' in reproduce.markdown(state, ['a', 'b'])


def _cli(*args, timeout=120):
  return subprocess.run([sys.executable, '-m', 'experiments.reproduce', *args],
                        cwd=REPO, capture_output=True, text=True,
                        timeout=timeout, env=conftest.training_env())


def test_help_and_bad_flags_are_one_line(tmp_path):
  result = _cli('--help')
  assert result.returncode in (0, 1), result.stderr
  for flag in ('--workdir', '--suite', '--only', '--max_seconds',
               '--data_dir', '--affnist_dir', '--smallnorb_dir',
               '--cifar10_dir', '--svhn_dir', '--list'):
    assert flag in result.stdout, flag
  for args, message in (
      ((), '--workdir is required'),
      ((f'--workdir={tmp_path}', '--suite=full'), 'suite'),
      ((f'--workdir={tmp_path}', '--only=capsnet'), "--only names ['capsnet']"),
      ((f'--workdir={tmp_path}', f'--data_dir={tmp_path / "none"}'),
       'is not a directory'),
      ((f'--workdir={tmp_path}', '--max_seconds=-1'), 'max_seconds'),
      ((f'--workdir={tmp_path}', '--suite=smoke',
        f'--readme={os.path.join(REPO, "docs", "paper_suite_results.md")}'),
       '--readme goes with --suite=paper'),
      ((f'--workdir={tmp_path}', f'--readme={os.path.join(REPO, "pyproject.toml")}'),
       'has no <!-- reproduction:begin --> ... <!-- reproduction:end -->'),
  ):
    result = _cli(*args)
    assert result.returncode == 2, (args, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error:'), result.stderr
    assert message in lines[0], (message, lines)
  assert not os.path.exists(tmp_path / 'reproduction.json')


def test_list_prints_each_experiment_and_its_command(tmp_path):
  result = _cli(f'--workdir={tmp_path}', '--suite=smoke', '--list',
                '--only=capsnet_mnist,smallnorb')
  assert result.returncode == 0, result.stderr
  lines = result.stdout.strip().splitlines()
  assert lines[0] == 'capsnet_mnist: not started'
  assert lines[1].startswith('  python -m experiments.train '
                             f'--workdir={tmp_path}/capsnet_mnist')
  assert lines[2] == 'smallnorb: skipped: no --smallnorb_dir'


def _smoke_suite_command(workdir, *args):
  # The one CPU device a user's run has. Four forced host devices halved
  # the smoke models' training speed on the 2-core Intel CI machine, and
  # the fused EM kernel routes only in a one-device process
  # (docs/multi_host.md).
  env = conftest.training_env(full_speed=True)
  argv = [sys.executable, '-m', 'experiments.reproduce',
          f'--workdir={workdir}', '--suite=smoke', *args]
  return argv, env


def _smoke_suite(workdir, *args):
  argv, env = _smoke_suite_command(workdir, *args)
  return subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                        timeout=1800, env=env)


def _logged_step(metrics_path) -> int:
  """The last training step logged in a run's metrics.jsonl (0: none)."""
  step = 0
  if os.path.exists(metrics_path):
    for line in open(metrics_path).read().splitlines():
      try:
        record = json.loads(line)
      except json.JSONDecodeError:  # a line being written
        continue
      if 'train/loss' in record:
        step = max(step, record['step'])
  return step


@conftest.needs_mnist
@pytest.mark.slow
@pytest.mark.alone
def test_smoke_suite_stops_on_sigterm_resumes_and_finishes(tmp_path):
  """The smoke suite as a user with time windows runs it: a first call
  ended by SIGTERM (what a scheduler sends at a window's end; --max_seconds
  sends the experiment the same, and its own tests are above) once the
  CapsNet has logged step 100, then a call that finishes every experiment,
  resuming that one from its saved step. The per-experiment smoke runs'
  checks then run on the suite's workdirs (this test replaces their own
  slow tests): the CapsNet and EM learning claims, the two-digit,
  MultiMNIST and affNIST (a file in the release format) recounts."""
  from tests import test_affnist_train
  from tests import test_multimnist_train
  from tests import test_training_matrix_capsules
  from tests import test_training_vector_capsules
  from tests import test_two_digit_transfer
  affnist = test_affnist_train.write_affnist_file(tmp_path / 'affnist',
                                                  conftest.MNIST)
  workdir = tmp_path / 'suite'
  argv, env = _smoke_suite_command(workdir,
                                   f'--affnist_dir={tmp_path / "affnist"}')
  first = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env)
  metrics = workdir / 'capsnet_mnist' / 'metrics.jsonl'
  deadline = time.monotonic() + 900
  while (first.poll() is None and time.monotonic() < deadline and
         _logged_step(metrics) < 100):
    time.sleep(0.2)
  first.send_signal(signal.SIGTERM)
  out, _ = first.communicate(timeout=300)
  print(out[-3000:])
  assert first.returncode == 128 + signal.SIGTERM, out[-3000:]
  state = _state(workdir)['experiments']
  assert state['capsnet_mnist']['status'] == 'interrupted; rerun to continue'
  log = open(workdir / 'capsnet_mnist' / 'reproduce.log').read()
  stopped = int(log.split('stopped at step ')[1].split(',')[0])
  assert 100 <= stopped < capsnet_mnist.get_config('smoke').num_train_steps
  assert state['matrix_capsnet_mnist']['status'] == 'not started'

  second = _smoke_suite(workdir, f'--affnist_dir={tmp_path / "affnist"}')
  print(second.stdout[-3000:], second.stderr[-3000:])
  assert second.returncode == 0, second.stdout[-5000:] + second.stderr
  log = open(workdir / 'capsnet_mnist' / 'reproduce.log').read()
  assert f'Resuming from the checkpoint of step {stopped} ' in log
  state = _state(workdir)['experiments']
  names = [e.name for e in reproduce.suite_experiments('smoke')]
  assert set(state) == set(names)
  table = open(workdir / 'REPRODUCTION.md').read()
  for name in names:
    if name in ('smallnorb', 'capsnet_smallnorb'):
      assert state[name]['status'] == 'skipped: no --smallnorb_dir'
      continue
    if name in ('capsnet_svhn', 'capsnet_cifar10'):
      assert state[name]['status'].startswith('skipped: no --'), name
      continue
    assert state[name]['status'] == 'finished', (name, state[name])
    assert state[name]['rows'], name
    for row in state[name]['rows']:
      assert 0.0 <= row['test'] <= 1.0, row
      assert row['row'] in table and row['device'].startswith('cpu')
  assert state['capsnet_mnist']['calls'] == 2
  rows = {row['row']: row for name in names for row in state[name]['rows']}
  # A smoke row names the configuration that ran.
  capsnet = rows["CapsNet, 3 iterations + reconstruction, MNIST, the official "
                 "code's form (reduced: capsnet_mnist.py:smoke)"]
  summary = json.load(open(workdir / 'capsnet_mnist' / 'summary.json'))
  assert capsnet['test'] == summary['test']['error']
  assert capsnet['validation'] == summary['validation']['error']
  assert rows['affNIST, CapsNet']['test'] == json.load(open(
      workdir / 'affnist' / 'affnist_summary.json'))['models']['capsnet'][
          'affnist_accuracy']
  attacked = json.load(open(workdir / 'adversarial' / 'summary.json'))
  assert set(attacked['models']) == {'capsnet', 'baseline_cnn',
                                     'matrix_capsnet'}
  for name, row in attacked['models'].items():
    # Trained models: the attacks take accuracy down.
    assert row['bim'][-1] < row['clean_accuracy'] - 0.2, (name, row)

  test_training_vector_capsules.check_smoke_capsnet(workdir / 'capsnet_mnist')
  test_training_matrix_capsules.check_smoke_em(workdir / 'matrix_capsnet_mnist')
  test_two_digit_transfer.check_smoke_workdir(workdir / 'two_digit_transfer',
                                              conftest.MNIST)
  test_multimnist_train.check_smoke_workdir(workdir / 'multimnist', 'smoke')
  test_affnist_train.check_smoke_workdir(workdir / 'affnist', *affnist)


def test_bench_table_goes_under_its_device_and_replaces_its_last_one(
    tmp_path):
  path = tmp_path / 'BENCHMARKS.md'
  path.write_text('# Benchmarks\n\nearlier text\n')
  row = {'row': 'm batch 8 float32', 'test': 10.0, 'device': 'gpu:NVIDIA H100'}
  state = {'suite': 'bench', 'commit': 'abcdef012', 'updated': 'T',
           'experiments': {'m': {'status': 'finished', 'wall_s': 1.0,
                                 'rows': [row]}}}
  reproduce.update_benchmarks(str(path), state, '| first |\n')
  reproduce.update_benchmarks(str(path), state, '| second |\n')
  text = path.read_text()
  assert text.startswith('# Benchmarks\n\nearlier text\n\n## gpu:NVIDIA H100 '
                         '(`python -m experiments.reproduce --suite=bench`, '
                         'commit abcdef0, T)\n')
  assert '| second |' in text and '| first |' not in text
  assert text.count('<!-- bench:gpu:NVIDIA H100:begin -->') == 1


@pytest.mark.slow  # the benchmark itself: tests/test_benchmark.py
def test_bench_suite_runs_the_benchmark_for_both_dtypes(tmp_path):
  """Two rows of the real bench suite on this CPU, 1 timed step each."""
  (tmp_path / 'BENCHMARKS.md').write_text('# B\n')
  only = 'capsnet_mnist_smoke_float32,capsnet_mnist_smoke_bfloat16'
  result = _cli(f'--workdir={tmp_path / "w"}', '--suite=bench',
                f'--only={only}', '--bench_steps=1',
                f'--benchmarks={tmp_path / "BENCHMARKS.md"}', timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr
  state = _state(tmp_path / 'w')['experiments']
  for name, dtype in (('capsnet_mnist_smoke_float32', 'float32'),
                      ('capsnet_mnist_smoke_bfloat16', 'bfloat16')):
    assert state[name]['status'] == 'finished'
    (row,) = state[name]['rows']
    assert row['row'] == f'capsnet_mnist:smoke batch 64 {dtype}'
    assert row['test'] > 0 and row['eval_images_per_s'] > 0
    assert row['compile_s'] > 0 and row['peak_memory_bytes'] > 0
    assert row['fraction_of_peak'] is None  # a CPU has no datasheet peak
  text = (tmp_path / 'BENCHMARKS.md').read_text()
  assert '## cpu:cpu (`python -m experiments.reproduce --suite=bench`' in text
  assert '| capsnet_mnist:smoke batch 64 bfloat16 |' in text
  assert _cli(f'--workdir={tmp_path}', '--suite=paper',
              f'--benchmarks={tmp_path / "BENCHMARKS.md"}').returncode == 2


def test_ctrl_c_then_the_time_limit_signal_the_experiment_once(
    tmp_path, fake_suite, monkeypatch):
  """Ctrl-C is passed on; when the time limit then falls while the
  experiment is still saving, no second signal follows (that one would stop
  a training without its checkpoint)."""
  sent = []
  original = subprocess.Popen.send_signal
  monkeypatch.setattr(subprocess.Popen, 'send_signal',
                      lambda self, signum: (sent.append(signum),
                                            original(self, signum)))
  # Saving takes 2 s; the time limit falls 1 s into it.
  fake_suite.append(_fake('long', 1000, step_s=0.05, save_s=2.0))
  timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
  timer.start()
  try:
    status = reproduce.run_suite(str(tmp_path), 'paper', max_seconds=2.0)
  finally:
    timer.cancel()
  assert status == 128 + signal.SIGINT
  assert sent == [signal.SIGINT]
  assert 'stopped at step' in open(tmp_path / 'long' / 'reproduce.log').read()


def test_the_suite_process_starts_no_jax_backend(tmp_path):
  """The experiments train in child processes; a backend in the suite's own
  process would hold a GPU's memory (JAX preallocates it) meanwhile."""
  script = f'''
import os
from experiments import reproduce
from tests import test_reproduce
reproduce.suite_experiments = lambda name: [test_reproduce._fake('a', 2)]
assert reproduce.run_suite({str(tmp_path)!r}, 'paper') == 0
from capsjax import _jax_private
print('backends', _jax_private.backends_started())
'''
  result = subprocess.run([sys.executable, '-c', script], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env=conftest.training_env())
  assert result.returncode == 0, result.stderr
  assert 'backends False' in result.stdout, result.stdout
  assert _state(tmp_path)['commit']  # the commit is still recorded
