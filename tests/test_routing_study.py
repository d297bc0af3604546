"""experiments.routing_study: the study's suite, its report and its command.

The suite and the report are tested on their own (no training: the report
reads summaries written here); the command's usage errors in subprocesses;
the smoke study end to end, two heads trained, resumed and reported, in the
slow test at the bottom.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from experiments import reproduce
from experiments import routing_study_lib as study_lib
from experiments.configs import routing_study
from tests import conftest
from tests import helpers

CONFIG_FILE = os.path.join(reproduce.launcher.CONFIG_DIR, 'routing_study.py')


def _names(experiments):
  return [e.name for e in experiments]


def test_the_suite_measures_costs_first_then_runs_seed_by_seed():
  config = routing_study.get_config()
  experiments = study_lib.study_experiments(
      config, CONFIG_FILE, ['--config.data_dir=/data'])
  names = _names(experiments)
  heads = routing_study.HEADS
  assert len(names) == len(heads) + len(heads) * 3 * 2
  assert names[:len(heads)] == [f'cost_{h}' for h in heads]
  assert names[len(heads):len(heads) + 2] == ['mnist_dynamic_1_seed0',
                                               'mnist_dynamic_3_seed0']
  assert names.index('fashion_mnist_uniform_seed0') < names.index(
      'mnist_dynamic_1_seed1')
  assert names[-1] == 'fashion_mnist_uniform_seed2'
  by_name = dict(zip(names, experiments, strict=True))
  run = by_name['fashion_mnist_su_seed2']
  assert run.module == 'experiments.train'
  # The command line's overrides first, the run's head and seed after them.
  assert run.args('/w/run', reproduce.Options()) == [
      '--workdir=/w/run', f'--config={CONFIG_FILE}:fashion_mnist',
      '--config.data_dir=/data', '--config.model_options.head=su',
      '--config.seed=2']
  cost = by_name['cost_em'].args('/w/cost_em', reproduce.Options())
  assert cost == ['--model=routing_study', '--batch_size=64', '--steps=30',
                  '--warmup=3', '--model_option=head=em',
                  '--output=/w/cost_em/bench.json']


def test_the_smoke_variant_is_two_heads_one_seed_on_mnist():
  config = routing_study.get_config('smoke')
  names = _names(study_lib.study_experiments(config, CONFIG_FILE + ':smoke'))
  assert names == ['cost_dynamic_3', 'cost_uniform', 'mnist_dynamic_3_seed0',
                   'mnist_uniform_seed0']
  # A Fashion-MNIST run keeps only the tests that apply to it.
  fashion = routing_study.get_config('smoke,fashion_mnist')
  assert (fashion.dataset, list(fashion.evals)) == ('fashion_mnist', ['bim'])


def test_only_takes_globs_and_one_matching_nothing_is_an_error():
  experiments = study_lib.study_experiments(routing_study.get_config(), CONFIG_FILE)
  assert study_lib.select(experiments, ['cost_*', 'mnist_su_seed?']) == [
      'cost_dynamic_1', 'cost_dynamic_3', 'cost_su', 'cost_em',
      'cost_self_attention', 'cost_inverted_dot_product',
      'cost_self_routing', 'cost_uniform', 'mnist_su_seed0', 'mnist_su_seed1',
      'mnist_su_seed2']
  with pytest.raises(ValueError, match='--only=mnist_capsnet_\\* matches no'):
    study_lib.select(experiments, ['mnist_capsnet_*'])


def test_config_overrides_are_passed_on_as_given():
  argv = ['--workdir=w', '--config.seed=3', '--config.num_train_steps', '5',
          '--max_seconds=1', '--config=experiments/configs/routing_study.py']
  assert study_lib.config_overrides(argv) == [
      '--config.seed=3', '--config.num_train_steps', '5']


def test_a_bad_study_key_is_named():
  config = routing_study.get_config('smoke')
  config.heads = ('dynamic_3', 'capsnet')
  with pytest.raises(ValueError, match='config.heads must name heads'):
    study_lib.study_experiments(config, CONFIG_FILE)


def _write_summary(workdir, name, test_error, *, affine=0.5, top2=0.5,
                   bim=0.2):
  os.makedirs(workdir / name)
  summary = {'test': {'error': test_error}, 'validation': {'error': 0.01},
             'steps': 20, 'num_params': 6520, 'train_images_per_s': 100.0,
             'git_commit': 'abcdef0123', 'device': 'cpu:fake',
             'evals': {'translated': {'accuracy': affine},
                       'affine': {'accuracy': affine},
                       'pairs': {'top2': top2}, 'bim': {'bim': [bim]}}}
  (workdir / name / 'summary.json').write_text(json.dumps(summary))


def _study_config():
  config = routing_study.get_config('smoke')
  config.num_seeds = 3
  return config


def test_the_report_gives_mean_spread_and_the_difference_from_the_control(
    tmp_path):
  config = _study_config()
  experiments = study_lib.study_experiments(config, CONFIG_FILE + ':smoke')
  for seed, error in enumerate((0.010, 0.012, 0.014)):
    _write_summary(tmp_path, f'mnist_dynamic_3_seed{seed}', error)
  for seed, error in enumerate((0.020, 0.021, 0.022)):
    _write_summary(tmp_path, f'mnist_uniform_seed{seed}', error)
  os.makedirs(tmp_path / 'cost_uniform')
  (tmp_path / 'cost_uniform' / 'bench.json').write_text(json.dumps({'rows': [{
      'num_params': 6588, 'train_images_per_s': 500.0, 'batch_size': 32,
      'peak_memory_bytes': 2**20, 'train_flops_xla': 32e6, 'steps': 3}]}))
  doc = tmp_path / 'docs' / 'page.md'
  os.makedirs(doc.parent)
  doc.write_text(f'# Page\n\n{study_lib.DOC_BEGIN}\n'
                 f'{study_lib.NOT_RUN}{study_lib.DOC_END}\n')
  results = study_lib.write_report(str(tmp_path), config, experiments,
                                   doc=str(doc))
  test = results['results']['mnist_test_error']
  assert test['dynamic_3']['mean'] == pytest.approx(0.012)
  assert test['dynamic_3']['spread'] == pytest.approx(0.002)
  assert test['dynamic_3']['difference'] == pytest.approx(-0.009)
  assert test['dynamic_3']['beyond_spread'] is True
  # Equal on the affine test: no difference beyond the spreads.
  assert results['results']['affine_error']['dynamic_3']['difference'] == 0
  assert results['results']['affine_error']['dynamic_3'][
      'beyond_spread'] is False
  assert results['finished_runs'] == 6 and results['planned_runs'] == 6
  assert results['heads']['uniform']['peak_memory_bytes'] == 2**20
  assert results['heads']['uniform']['num_params'] == 6588
  table = (tmp_path / 'results.md').read_text()
  assert ('| MNIST test error | dynamic_3 | 1.20% | 0.20% | 3 | -0.90 pp | yes '
          '|') in table
  assert '| MNIST test error | uniform | 2.10% | 0.10% | 3 | - | (the control) |' \
      in table
  assert (tmp_path / 'routing_study.png').stat().st_size > 0
  page = doc.read_text()
  assert study_lib.NOT_RUN not in page and '-0.90 pp' in page
  assert '![The routing study](routing_study.png)' in page
  # The figure beside the page, as the page links it.
  assert (tmp_path / 'routing_study.png').read_bytes() == (
      doc.parent / 'routing_study.png').read_bytes()
  saved = json.loads((tmp_path / 'results.json').read_text())
  assert saved['results']['mnist_test_error']['uniform']['seeds'] == [0, 1, 2]


def test_before_any_run_the_page_says_the_study_has_not_run(tmp_path):
  config = _study_config()
  experiments = study_lib.study_experiments(config, CONFIG_FILE + ':smoke')
  doc = tmp_path / 'docs' / 'page.md'
  os.makedirs(doc.parent)
  doc.write_text(f'{study_lib.DOC_BEGIN}\nold\n{study_lib.DOC_END}\n')
  results = study_lib.write_report(str(tmp_path / 'work'), config,
                                   experiments, doc=str(doc))
  assert results['finished_runs'] == 0
  assert study_lib.NOT_RUN in doc.read_text()
  assert not (tmp_path / 'work' / 'routing_study.png').exists()
  assert not (doc.parent / 'routing_study.png').exists()


def _command(*args, env=None):
  return subprocess.run(
      [sys.executable, '-m', 'experiments.routing_study', *args],
      cwd=conftest.REPO, capture_output=True, text=True, timeout=120,
      env=env or conftest.training_env())


@pytest.mark.parametrize('args,message', [
    (['--workdir=W', '--bogus'], 'Unknown command line flag'),
    (['--max_seconds=1'], '--workdir is required'),
    (['--workdir=W', '--only=capsnet_*'], '--only=capsnet_* matches no run'),
])
def test_bad_flags_are_one_line_and_exit_2(tmp_path, args, message):
  args = [arg.replace('=W', f'={tmp_path / "w"}') for arg in args]
  result = _command(*args)
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], result.stderr
  assert not (tmp_path / 'w' / 'reproduction.json').exists()


@pytest.mark.parametrize('key,value,message', [
    ('heads', ('dynamic_2',), 'config.heads must name heads'),
    ('heads', (), 'config.heads must name heads'),
    ('num_seeds', 0, 'config.num_seeds must be a positive int, got 0'),
    ('num_seeds', True, 'config.num_seeds must be a positive int, got True'),
    ('datasets', ('cifar10',), 'config.datasets must name datasets'),
    ('cost_steps', 0, 'config.cost_steps must be >= 1, got 0'),
])
def test_a_bad_study_config_names_its_key(key, value, message):
  # The command turns this ValueError into one line and exit 2 as it does
  # --only's above.
  config = routing_study.get_config()
  study_lib.check_study(config)
  config[key] = value
  with pytest.raises(ValueError, match=re.escape(message)):
    study_lib.check_study(config)


@pytest.mark.slow
def test_the_smoke_study_trains_resumes_skips_and_reports(tmp_path):
  data_dir = helpers.write_tiny_mnist(str(tmp_path / 'mnist'))
  workdir = tmp_path / 'study'
  args = [f'--workdir={workdir}', f'--config={CONFIG_FILE}:smoke',
          f'--config.data_dir={data_dir}', '--config.validation_size=40',
          '--config.eval_batch_size=40', '--config.num_train_steps=4']
  first = _command(*args, '--only=cost_*,mnist_dynamic_3_seed0')
  assert first.returncode == 0, first.stdout + first.stderr
  state = json.loads((workdir / 'reproduction.json').read_text())
  assert state['experiments']['mnist_dynamic_3_seed0']['status'] == 'finished'
  assert 'mnist_uniform_seed0' not in state['experiments']
  second = _command(*args)
  assert second.returncode == 0, second.stdout + second.stderr
  state = json.loads((workdir / 'reproduction.json').read_text())
  for name in ('cost_dynamic_3', 'cost_uniform', 'mnist_dynamic_3_seed0',
               'mnist_uniform_seed0'):
    assert state['experiments'][name]['status'] == 'finished', name
    assert state['experiments'][name]['calls'] == 1, name  # none run twice
  summary = json.loads((workdir / 'mnist_uniform_seed0' /
                        'summary.json').read_text())
  assert summary['steps'] == 4
  assert set(summary['evals']) == {'translated', 'affine', 'pairs', 'bim'}
  assert '--config.model_options.head=uniform' in state['experiments'][
      'mnist_uniform_seed0']['command']
  results = json.loads((workdir / 'results.json').read_text())
  assert results['finished_runs'] == 2
  assert set(results['results']['pairs_error']) == {'dynamic_3', 'uniform'}
  assert '| MNIST test error | uniform |' in (workdir / 'results.md').read_text()
  assert (workdir / 'routing_study.png').exists()
  # A third call trains nothing and rewrites the report.
  third = _command(*args, '--report')
  assert third.returncode == 0 and '2 of 2 runs finished' in third.stdout
