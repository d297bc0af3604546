"""Reproduce the papers' tables with one command, in resumable pieces.

  python -m experiments.reproduce --workdir=/scratch/repro --suite=paper
  python -m experiments.reproduce --workdir=/scratch/repro --suite=paper \\
      --max_seconds=540    # a 10-minute window; repeat until it says done
  python -m experiments.reproduce --workdir=/tmp/repro_smoke --suite=smoke
  python -m experiments.reproduce --workdir=/scratch/repro --suite=bench

Suites:
  paper  every experiment of the two papers (and Su's test) at its full
         protocol, in the order CapsNet MNIST, matrix capsules MNIST, Su's
         two-digit test, MultiMNIST, then the rest (``--list`` shows them).
         smallNORB runs where --smallnorb_dir is given; affNIST tests on
         the real affNIST where --affnist_dir is given, on affine-transformed
         MNIST otherwise. The CapsNet MNIST row is the official code's
         form; the paper text's form at the same protocol and a second seed
         of each follow the ablations. Last, section 7's other datasets,
         each where its directory is given: CapsNet on smallNORB
         (--smallnorb_dir), SVHN (--svhn_dir) and CIFAR-10, an ensemble of
         7 (--cifar10_dir).
  smoke  the same experiments at their ``:smoke`` size (minutes on a CPU),
         less the check of the two forms.
  bench  every model's train and eval images/s, compile time and peak
         memory, float32 and bfloat16 (``experiments.benchmark``), and the
         fraction of the device's peak.

Each experiment is ``python -m experiments.<name>`` in WORKDIR/<name>,
with its output in WORKDIR/<name>/reproduce.log. It resumes from its own
checkpoints, so a rerun continues where the last call stopped and skips
what is finished. ``--max_seconds=N`` stops the call after N seconds: the
running experiment gets SIGTERM, saves a checkpoint of its current step and
exits; one still running 50 s later is killed and resumes from its last
periodic checkpoint (so allow a minute for that within a hard limit).
Every call rewrites WORKDIR/reproduction.json (also as each experiment
ends) and WORKDIR/REPRODUCTION.md: per row the paper's number, ours (test,
with validation beside it), steps, epochs, wall time (all calls added up),
the last call's training images/s, device and commit.
``--readme=docs/paper_suite_results.md`` (paper suite) also writes the table of the
suite's finished rows (all of them, whatever ``--only`` selects; nothing
while none has finished) between that markdown file's
``<!-- reproduction:begin -->`` and ``<!-- reproduction:end -->`` lines,
keeping the rows other suite workdirs wrote there (a GPU's, another
machine's), and a row of the mean and range over a claim's seeds once two
or more have finished; with --suite=bench, ``--benchmarks=BENCHMARKS.md``
writes its table there under the device's name.

Exit status: 0 when every selected experiment is finished, skipped for want
of its data, or waits for an experiment --only left out (the summary line
names what is left), 3 when --max_seconds stopped the call with work left
(rerun the same command), 130/143/129 on Ctrl-C/SIGTERM/SIGHUP (the
running experiment saves first; SIGHUP stays ignored under ``nohup``), 2
when an experiment failed (its log is named; a failure outranks the time
limit) or on a usage error.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

from absl import app
from absl import flags

from experiments import launcher


def _define_flags() -> None:
  """The command's flags, defined when it runs as the command: another
  command (experiments.routing_study) imports the suite runner with
  flags of its own."""
  global _WORKDIR, _SUITE, _ONLY, _MAX_SECONDS, _LIST, _BENCH_STEPS
  global _DATA_DIR, _AFFNIST_DIR, _SMALLNORB_DIR, _CIFAR10_DIR, _SVHN_DIR
  global _README, _BENCHMARKS
  _WORKDIR = flags.DEFINE_string(
      'workdir', None, 'Required. Directory of the suite: one subdirectory per '
      'experiment, reproduction.json and REPRODUCTION.md; rerun with the same '
      'one to continue.')
  _SUITE = flags.DEFINE_enum('suite', 'paper', ['paper', 'smoke', 'bench'],
                             'Which suite: paper (full protocols), smoke (the '
                             ':smoke sizes) or bench (speed and memory).')
  _ONLY = flags.DEFINE_list('only', [], 'Run only these experiments of the '
                            'suite (comma-separated names; see --list).')
  _MAX_SECONDS = flags.DEFINE_float(
      'max_seconds', 0.0, 'Stop this call after this many seconds (0: no '
      'limit): the running experiment saves its checkpoint and the next call '
      'continues.', lower_bound=0.0)
  _DATA_DIR = flags.DEFINE_string(
      'data_dir', '', 'Directory with mnist/ and fashion-mnist/ (the IDX files); '
      "'': each experiment's own search ($CAPSJAX_DATA_DIR, ../shared/data, "
      'TFDS).')
  _AFFNIST_DIR = flags.DEFINE_string(
      'affnist_dir', '', 'Directory of the affNIST test release; without it the '
      'affNIST experiment tests on affine-transformed MNIST.')
  _SMALLNORB_DIR = flags.DEFINE_string(
      'smallnorb_dir', '', 'Directory of the six smallNORB files; without it '
      'the smallNORB experiments (matrix capsules, CapsNet) are skipped.')
  _CIFAR10_DIR = flags.DEFINE_string(
      'cifar10_dir', '', "Directory of CIFAR-10's binary (or python) release; "
      'without it the CIFAR-10 ensemble is skipped.')
  _SVHN_DIR = flags.DEFINE_string(
      'svhn_dir', '', "Directory of SVHN's train_32x32.mat and test_32x32.mat; "
      'without it the SVHN experiment is skipped.')
  _BENCH_STEPS = flags.DEFINE_integer(
      'bench_steps', 20, 'Timed steps per benchmark row (--suite=bench).',
      lower_bound=1)
  _README = flags.DEFINE_string(
      'readme', '', "Also write the finished rows into this markdown file's "
      '<!-- reproduction:begin --> ... <!-- reproduction:end --> block (this '
      'project keeps them in docs/paper_suite_results.md).')
  _BENCHMARKS = flags.DEFINE_string(
      'benchmarks', '', 'With --suite=bench: also write the table into this '
      "file (BENCHMARKS.md) under the device's name, replacing that device's "
      'earlier table.')
  _LIST = flags.DEFINE_bool('list', False, "Print the suite's experiments, "
                            'their commands and their status, and exit.')


EXIT_TIME_LIMIT = 3
README_BEGIN, README_END = '<!-- reproduction:begin -->', '<!-- reproduction:end -->'
# After SIGTERM an experiment saves its checkpoint and exits; past this it is
# killed (its previous checkpoint stays the latest).
# How long a stopping experiment may take to save and exit before it is
# killed (it then resumes from its last periodic checkpoint): saving takes
# seconds, and the docs tell a hard-limited window to leave a minute.
STOP_GRACE_S = 50.0
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Options(NamedTuple):
  """What the flags say about the data, for building the commands."""
  data_dir: str = ''
  affnist_dir: str = ''
  smallnorb_dir: str = ''
  bench_steps: int = 20
  cifar10_dir: str = ''
  svhn_dir: str = ''


class Experiment(NamedTuple):
  """One entry of a suite.

  ``args(workdir, options)`` is the experiment's command after ``python -m
  <module>``; ``result`` the file, in its workdir, that exists
  once it is finished; ``rows(workdir)`` its table rows from that file;
  ``needs(options)`` a reason to skip it ('' to run); ``after`` the
  experiments whose workdirs it reads.
  """
  name: str
  module: str
  args: Callable[[str, Options], list[str]]
  result: str
  rows: Callable[[str], list[dict[str, Any]]]
  needs: Callable[[Options], str] = lambda options: ''
  after: tuple[str, ...] = ()


def _read(path: str) -> dict[str, Any]:
  with open(path) as f:
    return json.load(f)


def _config(spec: str, workdir: str, options: Options,
            *overrides: str) -> list[str]:
  """--workdir, --config=configs/SPEC, the data directory and overrides."""
  args = [f'--workdir={workdir}',
          f'--config={os.path.join(launcher.CONFIG_DIR, spec)}']
  if options.data_dir:
    args.append(f'--config.data_dir={options.data_dir}')
  return args + list(overrides)


def _run_row(summary: dict[str, Any], title: str, paper: str,
             metric: str = 'test error') -> dict[str, Any]:
  """A table row of a training run's summary.json."""
  key = 'error' if metric == 'test error' else 'accuracy'
  return {'row': title, 'metric': metric, 'paper': paper,
          'test': summary['test'].get(key),
          'validation': (summary.get('validation') or {}).get(key),
          'steps': summary['steps'], 'epochs': summary.get('epochs'),
          'images_per_s': summary.get('train_images_per_s'),
          'device': summary.get('device'), 'commit': summary.get('git_commit')}


def _training(name: str, title: str, paper: str, paper_spec: str,
              smoke_spec: str, smoke_overrides: tuple[str, ...] = (),
              module: str = 'experiments.train',
              result: str = 'summary.json',
              paper_overrides: tuple[str, ...] = ()
              ) -> dict[str, Experiment]:
  """A single training run (the paper and smoke suites' entries); a smoke
  row names the configuration that ran."""
  def rows(label: str) -> Callable[[str], list[dict[str, Any]]]:
    return lambda workdir: [_run_row(
        _read(os.path.join(workdir, 'summary.json')), label, paper)]
  smoke_label = f'{title} (reduced: {smoke_spec}' + (
      f' {" ".join(smoke_overrides)})' if smoke_overrides else ')')
  return {
      suite: Experiment(
          name, module,
          lambda workdir, options, spec=spec, extra=extra: _config(
              spec, workdir, options, *extra),
          result, rows(label))
      for suite, spec, extra, label in (
          ('paper', paper_spec, paper_overrides, title),
          ('smoke', smoke_spec, smoke_overrides, smoke_label))}


# In the smoke suite the ablations, the baseline CNN and Fashion-MNIST train
# 20 steps of their :smoke model (each run's fixed cost, start-up,
# compilation and the evaluations, is most of it): the CapsNet smoke run
# already shows that model learning, and the baseline's 600 smoke steps take
# 4-5 minutes on a 2-core CPU. One validation pass, over 1,000 images (the
# default 5,000 twice cost a quarter of such a run); the test set is whole.
_SHORT = ('--config.num_train_steps=20', '--config.eval_every_steps=20',
          '--config.validation_size=1000',
          '--config.checkpoint_every_steps=10')


def _affnist_rows(workdir: str) -> list[dict[str, Any]]:
  record = _read(os.path.join(workdir, 'affnist_summary.json'))
  rows = []
  for name, title, paper in (('capsnet', 'affNIST, CapsNet', '79%'),
                             ('baseline_cnn', 'affNIST, CNN', '66%')):
    model = record['models'][name]
    real = model.get('affnist_accuracy') is not None
    row = _run_row(_read(os.path.join(workdir, name, 'summary.json')),
                   title + ('' if real else ' (affine-transformed MNIST: no '
                            '--affnist_dir)'), paper, 'accuracy')
    row['test'] = model['affnist_accuracy' if real else 'affine_mnist_accuracy']
    row['validation'] = model['expanded_mnist_validation_accuracy']
    rows.append(row)
  return rows


def _two_digit_rows(workdir: str) -> list[dict[str, Any]]:
  summary = _read(os.path.join(workdir, 'summary.json'))
  titles = {'two_digit_capsnet': ("Su's two-digit test, capsules (later "
                                  'routing), accuracy 1', 'above 95% (Su)'),
            'two_digit_capsnet_blog_routing': (
                "Su's two-digit test, capsules (blog routing), accuracy 1",
                'about 91% (Su)'),
            'two_digit_baseline': ("Su's two-digit test, pooling CNN, "
                                   'accuracy 1', 'about 40% (Su)')}
  rows = []
  for name, record in summary['models'].items():
    title, paper = titles.get(name, (name, '-'))
    row = _run_row(_read(os.path.join(workdir, name, 'summary.json')), title,
                   paper, 'accuracy')
    # Validation: single digits (Su's protocol never selects on pairs).
    row.update(test=record['pair_top2_accuracy'],
               validation=record['validation_accuracy'])
    rows.append(row)
  return rows


def _adversarial_rows(workdir: str) -> list[dict[str, Any]]:
  summary = _read(os.path.join(workdir, 'summary.json'))
  epsilon = summary['epsilons'][-1]
  rows = []
  for name, record in summary['models'].items():
    trained_dir = record['workdir']
    if not os.path.isdir(trained_dir):
      # The suite's workdir has moved (copied back from a GPU machine):
      # the trained models sit beside this experiment.
      trained_dir = os.path.join(os.path.dirname(workdir),
                                 os.path.basename(trained_dir))
    trained = _read(os.path.join(trained_dir, 'summary.json'))
    rows.append({
        'row': f'BIM at epsilon {epsilon}, {name}', 'metric': 'accuracy',
        'paper': 'capsules less vulnerable than a CNN (smallNORB)',
        'test': record['bim'][-1] if 'bim' in record else None,
        'validation': None, 'steps': trained.get('steps'),
        'epochs': trained.get('epochs'), 'images_per_s': None,
        'device': summary.get('device'), 'commit': summary.get('git_commit')})
  return rows


_ATTACKED = ('capsnet_mnist', 'baseline_cnn_mnist', 'matrix_capsnet_mnist')


def _adversarial(spec: str) -> Experiment:
  def args(workdir: str, options: Options) -> list[str]:
    models = ','.join(os.path.join(os.path.dirname(workdir), name)
                      for name in _ATTACKED)
    return _config(spec, workdir, options, f'--models={models}')
  return Experiment('adversarial', 'experiments.adversarial', args,
                    'summary.json', _adversarial_rows, after=_ATTACKED)


def _experiments(suite: str) -> list[Experiment]:
  """The paper or smoke suite, in the order they run."""
  smoke = suite == 'smoke'
  entries = [
      _training('capsnet_mnist', 'CapsNet, 3 iterations + reconstruction, '
                "MNIST, the official code's form", '0.25%', 'capsnet_mnist.py',
                'capsnet_mnist.py:smoke'),
      _training('matrix_capsnet_mnist', 'Matrix capsules (A=B=C=D=32), MNIST',
                '0.44%', 'matrix_capsnet_mnist.py',
                'matrix_capsnet_mnist.py:smoke'),
  ]
  experiments = [entry[suite] for entry in entries]
  experiments.append(Experiment(
      'two_digit_transfer', 'experiments.two_digit_transfer',
      lambda workdir, options: _config(
          'two_digit_transfer.py' + (':smoke' if smoke else ''), workdir,
          options), 'summary.json', _two_digit_rows))
  experiments += [entry[suite] for entry in (
      _training('multimnist', 'MultiMNIST, CapsNet', '5.2%',
                'capsnet_multimnist.py', 'capsnet_multimnist.py:smoke',
                module='experiments.multimnist',
                result='multimnist_summary.json'),
      _claim('capsnet_mnist_norecon'),
      _claim('capsnet_mnist_iter1'),
      _claim('capsnet_mnist_iter1_norecon'),
      _training('baseline_cnn_mnist', 'baseline CNN, MNIST', '0.39%',
                'baseline_cnn_mnist.py', 'baseline_cnn_mnist.py:smoke',
                _SHORT),
      _training('capsnet_fashion_mnist', 'CapsNet, Fashion-MNIST',
                '- (not in the paper)', 'capsnet_fashion_mnist.py',
                'capsnet_fashion_mnist.py:smoke', _SHORT),
      # Beyond the two papers: Mazzia et al.'s model and protocol.
      _claim('efficient_capsnet_mnist'),
  )]
  if not smoke:
    experiments += _form_ablation() + _more_seeds()

  def affnist_args(workdir: str, options: Options) -> list[str]:
    extra = ([f'--config.affnist_dir={options.affnist_dir}']
             if options.affnist_dir else [])
    return _config('capsnet_affnist.py' + (':smoke' if smoke else ''),
                   workdir, options, *extra)
  experiments.append(Experiment('affnist', 'experiments.affnist',
                                affnist_args, 'affnist_summary.json',
                                _affnist_rows))
  experiments.append(_adversarial('adversarial.py' +
                                  (':small' if smoke else '')))

  def smallnorb_args(workdir: str, options: Options) -> list[str]:
    spec = 'matrix_capsnet_smallnorb.py' + (':smoke' if smoke else '')
    return [f'--workdir={workdir}',
            f'--config={os.path.join(launcher.CONFIG_DIR, spec)}',
            # (without the directory the experiment is skipped; --list
            # shows where it goes)
            f'--config.data_dir={options.smallnorb_dir or "SMALLNORB_DIR"}']
  experiments.append(Experiment(
      'smallnorb', 'experiments.train', smallnorb_args,
      'summary.json',
      lambda workdir: [_run_row(_read(os.path.join(workdir, 'summary.json')),
                                'Matrix capsules, smallNORB', '1.8%')],
      needs=lambda options: '' if options.smallnorb_dir else
      'skipped: no --smallnorb_dir'))
  return experiments + _other_datasets(smoke)


def _smoke_spec(spec: str) -> str:
  """The :smoke variant of a config spec: 'capsnet_mnist.py:iter1' ->
  'capsnet_mnist.py:smoke,iter1'."""
  return (spec.replace('.py:', '.py:smoke,') if ':' in spec
          else spec + ':smoke')


# The single-run claims that also have seeds 1 and 2 in the paper suite
# (``_more_seeds``): the paper's ablations and Efficient-CapsNet. name ->
# (row title, paper's number, config spec).
_SEEDED_CLAIMS = {
    'capsnet_mnist_norecon': ('CapsNet, 3 iterations, no reconstruction, '
                              'MNIST', '0.35%', 'capsnet_mnist.py:norecon'),
    'capsnet_mnist_iter1': ('CapsNet, 1 iteration + reconstruction, MNIST',
                            '0.29%', 'capsnet_mnist.py:iter1'),
    'capsnet_mnist_iter1_norecon': ('CapsNet, 1 iteration, no '
                                    'reconstruction, MNIST', '0.34%',
                                    'capsnet_mnist.py:iter1,norecon'),
    'efficient_capsnet_mnist': ('Efficient-CapsNet (self-attention routing), '
                                'MNIST', '0.26%', 'efficient_capsnet_mnist.py'),
}


def _claim(name: str, *paper_overrides: str, seed: int = 0
           ) -> dict[str, Experiment]:
  """``_training`` of one of ``_SEEDED_CLAIMS``; seed > 0 names the entry
  NAME_seedN and its row 'TITLE, seed N'."""
  title, paper, spec = _SEEDED_CLAIMS[name]
  if seed:
    name, title = f'{name}_seed{seed}', f'{title}, seed {seed}'
  return _training(name, title, paper, spec, _smoke_spec(spec), _SHORT,
                   paper_overrides=paper_overrides)


def _form_ablation() -> list[Experiment]:
  """The paper suite's check on its first row: the paper text's form at the
  same protocol (do the official code's loss scale and primary-capsule
  coupling explain the 0.30-0.36% of the ports that follow the text?) and
  a second seed of each form. Each trains as long as the first row, so the
  smoke suite leaves them out (the configs' tests cover their variants)."""
  title = 'CapsNet, 3 iterations + reconstruction, MNIST'
  runs = (('capsnet_mnist_text', "the paper text's form", ':text', ()),
          ('capsnet_mnist_seed1', "the official code's form, seed 1", '',
           ('--config.seed=1',)),
          ('capsnet_mnist_text_seed1', "the paper text's form, seed 1",
           ':text', ('--config.seed=1',)),
          # The learning rate annealed to ~1e-6 within the 50 epochs (the
          # best open port decays 0.9 per epoch to ~6e-6), three seeds.
          *((f'capsnet_mnist_annealed{"" if seed == 0 else f"_seed{seed}"}',
             f"the official code's form, annealed, seed {seed}", ':annealed',
             (f'--config.seed={seed}',)) for seed in range(3)))
  return [_training(name, f'{title}, {form}', '0.25%',
                    'capsnet_mnist.py' + variant,
                    _smoke_spec('capsnet_mnist.py' + variant),
                    paper_overrides=seed)['paper']
          for name, form, variant, seed in runs]


def _more_seeds() -> list[Experiment]:
  """Seeds 1 and 2 of each of ``_SEEDED_CLAIMS``: each claim's three seeds,
  the first being its entry in the suite. Paper suite only, as
  ``_form_ablation``."""
  return [_claim(name, f'--config.seed={seed}', seed=seed)['paper']
          for name in _SEEDED_CLAIMS for seed in (1, 2)]


def _ensemble_rows(workdir: str) -> list[dict[str, Any]]:
  """The ensemble's row and its models' mean, from ensemble_summary.json."""
  record = _read(os.path.join(workdir, 'ensemble_summary.json'))
  models = record['models']
  paper = record.get('paper_test_error')
  base = {'metric': 'test error', 'steps': models[0]['steps'],
          'epochs': models[0]['epochs'],
          'images_per_s': record.get('train_images_per_s'),
          'device': record.get('device'), 'commit': record.get('git_commit')}
  mean = lambda values: (  # noqa: E731
      None if None in values else sum(values) / len(values))
  return [
      base | {'row': f'CapsNet, CIFAR-10, ensemble of {len(models)}',
              'paper': '-' if paper is None else f'{100 * paper:.1f}%',
              'test': record['test']['error'],
              'validation': (record.get('validation') or {}).get('error')},
      base | {'row': f'CapsNet, CIFAR-10, one model (mean of {len(models)})',
              'paper': '-',
              'test': mean([m['test']['error'] for m in models]),
              'validation': mean([(m.get('validation') or {}).get('error')
                                  for m in models])}]


def _other_datasets(smoke: bool) -> list[Experiment]:
  """Sabour et al. section 7: CapsNet on smallNORB, SVHN and CIFAR-10 (an
  ensemble), each run where its data directory is given."""
  variant = ':smoke' if smoke else ''

  def args(spec: str, field: str, placeholder: str):
    # (without the directory the experiment is skipped; --list shows where
    # it goes)
    return lambda workdir, options: [
        f'--workdir={workdir}',
        f'--config={os.path.join(launcher.CONFIG_DIR, spec + variant)}',
        f'--config.data_dir={getattr(options, field) or placeholder}']

  def needs(field: str):
    return lambda options: ('' if getattr(options, field) else
                            f'skipped: no --{field}')

  def single(title: str, paper: str, spec: str):
    return lambda workdir: [_run_row(
        _read(os.path.join(workdir, 'summary.json')),
        title + (f' (reduced: {spec}{variant})' if smoke else ''), paper)]

  return [
      Experiment('capsnet_smallnorb', 'experiments.train',
                 args('capsnet_smallnorb.py', 'smallnorb_dir',
                      'SMALLNORB_DIR'), 'summary.json',
                 single('CapsNet, smallNORB', '2.7%', 'capsnet_smallnorb.py'),
                 needs=needs('smallnorb_dir')),
      Experiment('capsnet_svhn', 'experiments.train',
                 args('capsnet_svhn.py', 'svhn_dir', 'SVHN_DIR'),
                 'summary.json',
                 single('CapsNet, SVHN', '4.3%', 'capsnet_svhn.py'),
                 needs=needs('svhn_dir')),
      Experiment('capsnet_cifar10', 'experiments.capsnet_ensemble',
                 args('capsnet_cifar10.py', 'cifar10_dir', 'CIFAR10_DIR'),
                 'ensemble_summary.json', _ensemble_rows,
                 needs=needs('cifar10_dir')),
  ]


# --suite=bench: (config, batch size) of every shipped model; 0 is the
# config's batch size. (MultiMNIST's two-label step is not one that
# experiments.benchmark times.)
BENCH_MODELS = (
    ('capsnet_mnist', 0), ('capsnet_mnist:smoke', 0),
    ('baseline_cnn_mnist', 0),
    ('two_digit_capsnet', 128), ('two_digit_baseline', 128),
    ('matrix_capsnet_mnist', 0), ('matrix_capsnet_mnist:smoke', 0),
    ('matrix_capsnet_smallnorb', 0), ('matrix_capsnet_smallnorb:small', 0),
)


def _bench_rows(workdir: str) -> list[dict[str, Any]]:
  from capsjax import flops
  out = []
  for row in _read(os.path.join(workdir, 'bench.json'))['rows']:
    peak = flops.device_peak(row.get('device') or '')
    peak_flops = peak and (peak.bfloat16_flops if row['dtype'] == 'bfloat16'
                           else peak.float32_flops)
    step_s = row.get('train_step_s')
    fraction = (row['train_flops_xla'] / step_s / peak_flops
                if peak_flops and step_s and row.get('train_flops_xla')
                else None)
    out.append({'row': f"{row['model']} batch {row['batch_size']} "
                       f"{row['dtype']}", 'metric': 'train images/s',
                'paper': '-', 'test': row['train_images_per_s'],
                'validation': None, 'steps': row['steps'], 'epochs': None,
                'images_per_s': row['train_images_per_s'],
                'eval_images_per_s': row['eval_images_per_s'],
                'compile_s': row['compile_s'],
                'peak_memory_bytes': row['peak_memory_bytes'],
                'fraction_of_peak': fraction, 'device': row.get('device'),
                'commit': None})
  return out


def _bench_experiments() -> list[Experiment]:
  experiments = []
  for model, batch in BENCH_MODELS:
    for dtype in ('float32', 'bfloat16'):
      def args(workdir, options, model=model, batch=batch, dtype=dtype):
        return [f'--model={model}', f'--batch_size={batch}',
                f'--dtype={dtype}', f'--steps={options.bench_steps}',
                '--warmup=2', f'--output={os.path.join(workdir, "bench.json")}']
      experiments.append(Experiment(
          f"{model.replace(':', '_')}_{dtype}", 'experiments.benchmark',
          args, 'bench.json', _bench_rows))
  return experiments


def suite_experiments(suite: str) -> list[Experiment]:
  """The experiments of ``suite`` ('paper', 'smoke' or 'bench'), in order."""
  if suite == 'bench':
    return _bench_experiments()
  if suite not in ('paper', 'smoke'):
    raise ValueError(f"suite must be 'paper', 'smoke' or 'bench', got "
                     f'{suite!r}.')
  return _experiments(suite)


def select(experiments: list[Experiment], only: list[str]
           ) -> list[Experiment]:
  """The experiments named in ``only`` (all when empty), in suite order."""
  names = [e.name for e in experiments]
  unknown = [name for name in only if name not in names]
  if unknown:
    raise ValueError(f'--only names {unknown}, not experiments of this suite; '
                     f'choose from {names}.')
  return [e for e in experiments if not only or e.name in only]


def finished(experiment: Experiment, workdir: str) -> bool:
  """Whether ``experiment`` of the suite in ``workdir`` has its result."""
  return os.path.exists(os.path.join(workdir, experiment.name,
                                     experiment.result))


def command(experiment: Experiment, workdir: str, options: Options
            ) -> list[str]:
  return [sys.executable, '-m', experiment.module,
          *experiment.args(os.path.join(workdir, experiment.name), options)]


class _Child:
  """A running experiment: its output copied to the terminal and its log."""

  def __init__(self, argv: list[str], log_path: str):
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    self._log = open(log_path, 'ab')
    self._log.write(f'\n$ {" ".join(argv)}\n'.encode())
    # The repository on the path: `experiments` is not installed with
    # capsjax in every setup (a wheel install), and the suite may be run
    # from another directory.
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(
        filter(None, [REPOSITORY, env.get('PYTHONPATH')]))
    # Its own session: a Ctrl-C at the terminal reaches the suite alone,
    # which passes it on once (a second signal stops a training at once,
    # without its checkpoint).
    self.process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        start_new_session=True)
    self._signalled = False
    self.log_error: OSError | None = None
    self._copy = threading.Thread(target=self._copy_output, daemon=True)
    self._copy.start()

  def _copy_output(self) -> None:
    # Bytes as they come (progress bars redraw with \r); a notebook's
    # stdout takes text only. The pipe is read to its end whatever happens
    # to the log (a full disk) or the terminal (closed): a child whose
    # pipe nobody reads blocks in its next print and never saves.
    out = getattr(sys.stdout, 'buffer', None)
    to_log = to_terminal = True
    while chunk := os.read(self.process.stdout.fileno(), 65536):
      if to_log:
        try:
          self._log.write(chunk)
          self._log.flush()  # `tail -f` of the log follows a run of hours
        except OSError as e:
          to_log, self.log_error = False, e
      if to_terminal:
        try:
          if out is None:
            sys.stdout.write(chunk.decode(errors='replace'))
          else:
            out.write(chunk)
          sys.stdout.flush()
        except (OSError, ValueError):
          to_terminal = False

  def signal_once(self, signum: int) -> None:
    """Ask it to save and stop. Once only: a second signal stops a training
    at once, without its checkpoint."""
    if not self._signalled and self.process.poll() is None:
      self._signalled = True
      self.process.send_signal(signum)

  def stop(self, signum: int) -> None:
    """Ask it to save and stop; kill it if it takes longer than the grace."""
    self.signal_once(signum)
    try:
      self.process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
      self.process.kill()
      self.process.wait()

  def close(self) -> int:
    self._copy.join()
    try:
      self._log.close()
    except OSError as e:
      self.log_error = self.log_error or e
    return self.process.returncode


class _Signals:
  """SIGINT, SIGTERM or SIGHUP to the suite: remembered, and passed on to
  the child."""

  def __init__(self):
    self.signum = None
    self.child: _Child | None = None

  def _handle(self, signum, frame) -> None:
    self.signum = signum
    if self.child is not None:
      self.child.signal_once(signum)

  def __enter__(self) -> _Signals:
    from capsjax.training import checkpoints
    self._previous = {s: signal.signal(s, self._handle)
                      for s in checkpoints.stop_signals()}
    return self

  def __exit__(self, *exc_info) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)


def _load_state(path: str, suite: str) -> dict[str, Any]:
  if not os.path.exists(path):
    return {'suite': suite, 'experiments': {}}
  state = _read(path)
  if state.get('suite') != suite:
    raise ValueError(f'{path} belongs to the {state.get("suite")!r} suite; '
                     f'run --suite={state.get("suite")} there, or choose '
                     f'another --workdir for --suite={suite}.')
  return state


def _update_rows(experiment: Experiment, workdir: str,
                 record: dict[str, Any]) -> None:
  """``record``'s status and rows from what WORKDIR/<name> holds now."""
  if finished(experiment, workdir):
    record['status'] = 'finished'
  elif record['status'] == 'finished':
    record['status'] = (f'its {experiment.result} is gone; rerun to run it '
                        f'again')
  record['rows'] = []
  record.pop('rows_error', None)
  if record['status'] != 'finished':
    return
  try:
    record['rows'] = experiment.rows(os.path.join(workdir, experiment.name))
  except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
    # One unreadable record must not stop the others' tables.
    record['rows_error'] = f'{type(e).__name__}: {e}'


def _say(line: str) -> None:
  """Print, but never fail a suite for a closed terminal (a hangup)."""
  try:
    print(line, flush=True)
  except (OSError, ValueError):
    pass


def run_suite(workdir: str, suite: str, *, only: list[str] = (),
              max_seconds: float = 0.0, options: Options | None = None,
              readme: str = '', benchmarks: str = '',
              log: Callable[[str], None] = _say,
              experiments: list[Experiment] | None = None) -> int:
  """Run (or continue) the suite in ``workdir``; the exit status.

  The suite holds ``workdir`` (``checkpoints.hold_workdir``; no JAX backend
  is started for it): a second suite on it stops at once, naming this one.
  Each experiment holds its own WORKDIR/<name>. ``experiments``: another
  command's own suite (``experiments.routing_study``'s), run under the name
  ``suite`` in place of ``suite_experiments(suite)``.
  """
  from capsjax.training import checkpoints
  options = options or Options()
  by_name = {e.name: e for e in (suite_experiments(suite) if experiments is None
                                 else experiments)}
  experiments = select(list(by_name.values()), list(only))
  workdir = os.path.abspath(workdir)
  with checkpoints.hold_workdir(workdir, 'experiments.reproduce'):
    return _run_suite(workdir, suite, by_name, experiments, max_seconds,
                      options, readme, benchmarks, log)


def _run_suite(workdir: str, suite: str, by_name: dict[str, Experiment],
               experiments: list[Experiment], max_seconds: float,
               options: Options, readme: str, benchmarks: str,
               log: Callable[[str], None]) -> int:
  """``run_suite`` in a workdir this process holds."""
  from capsjax.training import metrics
  state_path = os.path.join(workdir, 'reproduction.json')
  state = _load_state(state_path, suite)
  start = time.monotonic()
  deadline = start + max_seconds if max_seconds else None
  for experiment in experiments:
    state['experiments'].setdefault(
        experiment.name, {'status': 'not started', 'wall_s': 0.0, 'calls': 0})
  status = 0

  def time_limit() -> int:
    return status if status == 2 else EXIT_TIME_LIMIT  # a failure first

  def save() -> None:
    # The commit alone: metrics.environment() would start a JAX backend
    # here, and on a GPU this process would then hold the memory its
    # experiments need.
    state.update(commit=metrics.git_commit(), updated=time.strftime(
        '%Y-%m-%dT%H:%M:%SZ', time.gmtime()))
    metrics.write_json_atomic(state_path, state)

  with _Signals() as signals:
    for experiment in experiments:
      if signals.signum is not None:  # came between two experiments
        break
      record = state['experiments'][experiment.name]
      exp_dir = os.path.join(workdir, experiment.name)
      argv = command(experiment, workdir, options)
      if finished(experiment, workdir):
        # Its record keeps the command that ran it: the config path may
        # since have moved (another checkout).
        record.setdefault('command', ' '.join(['python'] + argv[1:]))
        record['status'] = 'finished'
        continue
      record['command'] = ' '.join(['python'] + argv[1:])
      if reason := experiment.needs(options):
        record['status'] = reason
        continue
      waiting = [name for name in experiment.after
                 if not finished(by_name[name], workdir)]
      if waiting:
        record['status'] = f'waits for {", ".join(waiting)}'
        continue
      if deadline is not None and time.monotonic() >= deadline:
        record['status'] = 'not started: time limit'
        status = time_limit()
        continue
      log(f'=== {experiment.name}: {record["command"]}')
      began = time.monotonic()
      child = signals.child = _Child(argv, os.path.join(exp_dir,
                                                        'reproduce.log'))
      if signals.signum is not None:  # came while it was being started
        child.signal_once(signals.signum)
      timed_out = False
      while child.process.poll() is None:
        try:
          child.process.wait(None if deadline is None else
                             max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
          timed_out = True
          log(f'=== {experiment.name}: --max_seconds reached; stopping it '
              f'(it saves a checkpoint of its current step)')
          child.stop(signal.SIGTERM)
        if signals.signum is not None:
          child.stop(signals.signum)
      code = child.close()
      signals.child = None
      record['wall_s'] += time.monotonic() - began
      record['calls'] += 1
      if child.log_error is not None:
        log(f'=== {experiment.name}: its log could not be written '
            f'({child.log_error}); its output went to this terminal only')
      if finished(experiment, workdir):
        record['status'] = 'finished'
      elif timed_out and code in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
        record['status'] = 'stopped at the time limit; rerun to continue'
        status = time_limit()
      elif timed_out and code == -signal.SIGKILL:
        record['status'] = (f'killed at the time limit after {STOP_GRACE_S:.0f}'
                            f' s of stopping; rerun to continue from its last '
                            f'checkpoint')
        status = time_limit()
      elif signals.signum is not None:
        record['status'] = 'interrupted; rerun to continue'
      else:
        record['status'] = (f'failed (exit {code}); see '
                            f'{os.path.join(exp_dir, "reproduce.log")}')
        status = 2
      log(f'=== {experiment.name}: {record["status"]} '
          f'({time.monotonic() - began:.0f} s)')
      # Recorded as each experiment ends: a suite killed later (a hard
      # window limit) keeps this call's wall time.
      save()
      if signals.signum is not None:
        break
    # The records and tables cover the whole suite, not only this call's
    # --only: an experiment may have finished, or lost its result, since
    # it was last selected.
    names = [name for name in by_name if name in state['experiments']]
    for name in names:
      _update_rows(by_name[name], workdir, state['experiments'][name])
    save()
    metrics.write_text_atomic(os.path.join(workdir, 'REPRODUCTION.md'),
                              markdown(state, names))
    finished_rows = markdown(state, names, finished_only=True)
    if any(state['experiments'][name]['status'] == 'finished'
           for name in names):
      # (without a finished row the README keeps what it says)
      if readme:
        state['readme_rows'] = update_readme(
            readme, finished_rows, state.get('readme_rows', []))
        save()
      if benchmarks:
        update_benchmarks(benchmarks, state, finished_rows)
  if signals.signum is not None:
    return 128 + signals.signum
  left = [e.name for e in experiments
          if state['experiments'][e.name]['status'] != 'finished'
          and not state['experiments'][e.name]['status'].startswith('skipped')]
  log(f'{state_path}: {len(experiments) - len(left)} of {len(experiments)} '
      f'experiments finished or skipped' +
      (f'; left: {", ".join(left)}' if left else '') +
      ('; rerun the same command to continue'
       if status == EXIT_TIME_LIMIT else ''))
  return status


def _percent(value) -> str:
  return '-' if value is None else f'{100 * value:.2f}%'


def _wall_time(seconds: float) -> str:
  return f'{seconds / 3600:.2f} h' if seconds >= 3600 else f'{seconds:.0f} s'


def markdown(state: dict[str, Any], names: list[str],
             finished_only: bool = False) -> str:
  """The rows of ``names`` as a markdown table (bench: its own columns)."""
  bench = state['suite'] == 'bench'
  if bench:
    head = ('| model | train img/s | eval img/s | compile s | peak memory GiB '
            '| fraction of peak | device | status |\n|---|---|---|---|---|---'
            '|---|---|\n')
  else:
    head = ('| experiment | metric | paper | ours (test) | validation | steps '
            '| epochs | wall time | train img/s (last call) | device | commit '
            '| status |\n'
            '|---|---|---|---|---|---|---|---|---|---|---|---|\n')
  lines = []
  for name in names:
    record = state['experiments'].get(name)
    if record is None or (finished_only and record['status'] != 'finished'):
      continue
    rows = record.get('rows') or [{'row': name}]
    status = record['status'] + (
        f" (its record cannot be read: {record['rows_error']})"
        if record.get('rows_error') else '')
    for row in rows:
      number = lambda key, spec: (  # noqa: E731
          '-' if row.get(key) is None else format(row[key], spec))
      if bench:
        memory = row.get('peak_memory_bytes')
        lines.append(
            f"| {row['row']} | {number('test', '.1f')} | "
            f"{number('eval_images_per_s', '.1f')} | "
            f"{number('compile_s', '.1f')} | "
            f"{'-' if memory is None else f'{memory / 2**30:.2f}'} | "
            f"{number('fraction_of_peak', '.3f')} | {row.get('device') or '-'} "
            f"| {status} |")
        continue
      lines.append(
          f"| {row['row']} | {row.get('metric', '-')} | "
          f"{row.get('paper', '-')} | {_percent(row.get('test'))} | "
          f"{_percent(row.get('validation'))} | {row.get('steps', '-')} | "
          f"{number('epochs', '.2f')} | {_wall_time(record['wall_s'])} | "
          f"{number('images_per_s', '.1f')} | {row.get('device') or '-'} | "
          f"{(row.get('commit') or '-')[:7]} | {status} |")
  return head + '\n'.join(lines) + '\n'


def write_block(path: str, table: str, begin: str, end: str,
                heading: str = '') -> None:
  """Replace the lines between ``begin`` and ``end`` in ``path`` with
  ``table``. Without the two lines: an error, or with ``heading``, the
  heading and the block appended to the file."""
  with open(path) as f:
    text = f.read()
  start, stop = text.find(begin), text.find(end)
  if start < 0 or stop < start:
    if not heading:
      raise ValueError(f'{path} has no {begin} ... {end} block to write the '
                       f'table into; add the two lines where it belongs.')
    text = f'{text.rstrip()}\n\n{heading}\n\n{begin}\n{end}\n'
    start, stop = text.find(begin), text.find(end)
  from capsjax.training import metrics
  start += len(begin)
  metrics.write_text_atomic(path, text[:start] + '\n' + table + text[stop:])


def update_readme(path: str, table: str, written_before: list[str] = ()
                  ) -> list[str]:
  """The finished rows into a markdown file's reproduction block (the
  project's: docs/paper_suite_results.md), keeping the rows that other suite
  workdirs wrote (a GPU's, another machine's).

  ``written_before``: the rows' titles this workdir wrote earlier; those,
  and the titles in ``table``, are this workdir's: replaced by ``table``'s
  rows (gone when no longer finished). Other rows stay, first. A new header
  replaces the block whole. A claim with several seeds' rows, whichever
  workdirs wrote them, gets their mean (``seed_means``). Returns the titles
  this workdir has written.
  """
  with open(path) as f:
    text = f.read()
  start, stop = text.find(README_BEGIN), text.find(README_END)
  old = (text[start + len(README_BEGIN):stop].strip().splitlines()
         if 0 <= start < stop else [])
  new = table.strip().splitlines()
  ours = set(written_before) | {_title(row) for row in new[2:]}
  if len(old) > 2 and old[:2] == new[:2]:
    new[2:] = [row for row in old[2:] if _title(row) not in ours] + new[2:]
  # One row a title (two blocks merged by git may hold one twice): the last.
  new[2:] = list({_title(row): row for row in new[2:]}.values())
  write_block(path, '\n'.join(new[:2] + seed_means(new[0] if new else '',
                                                    new[2:])) + '\n',
              README_BEGIN, README_END)
  return sorted(ours)


_SEED_TITLE = re.compile(r', seed \d+$')
_MEAN_TITLE = re.compile(r', mean of \d+ seeds$')


def _title(row: str) -> str:
  return row.split(' | ')[0].removeprefix('| ')


def _cells(row: str) -> list[str]:
  return [cell.strip() for cell in row.strip().strip('|').split('|')]


def seed_means(header: str, rows: list[str]) -> list[str]:
  """``rows`` of the paper table (``header``: its first line) with a row
  after each claim's last seed: the mean and the range of the test and
  validation errors of its seeds' rows (a claim's seeds: the rows titled
  TITLE or TITLE, seed N; two or more of them). Such rows already in
  ``rows`` are dropped first. Another table's rows come back unchanged."""
  names = _cells(header)
  if 'ours (test)' not in names:
    return rows
  rows = [row for row in rows if not _MEAN_TITLE.search(_title(row))]
  groups: dict[str, list[tuple[int, dict[str, str]]]] = {}
  for index, row in enumerate(rows):
    cells = _cells(row)
    if len(cells) == len(names):
      groups.setdefault(_SEED_TITLE.sub('', cells[0]), []).append(
          (index, dict(zip(names, cells, strict=True))))
  after: dict[int, str] = {}
  for claim, members in groups.items():
    if len(members) < 2:
      continue
    seeds = [record for _, record in members]
    mean = {}  # in the header's order
    for name in names:
      # What the seeds share (metric, paper, steps, epochs, status).
      values = {record[name] for record in seeds}
      mean[name] = values.pop() if len(values) == 1 else '-'
    for name in ('ours (test)', 'validation'):
      try:
        errors = [float(record[name].removesuffix('%')) for record in seeds]
      except ValueError:  # '-': no number to average
        mean[name] = '-'
        continue
      mean[name] = (f'{sum(errors) / len(errors):.2f}% '
                    f'({min(errors):.2f}-{max(errors):.2f}%)')
    mean['experiment'] = f'{claim}, mean of {len(seeds)} seeds'
    for name in ('wall time', 'train img/s (last call)', 'commit'):
      if name in mean:
        mean[name] = '-'
    if 'device' in mean:
      mean['device'] = ', '.join(sorted({record['device'] for record in seeds}))
    after[members[-1][0]] = '| ' + ' | '.join(mean.values()) + ' |'
  return [line for index, row in enumerate(rows)
          for line in (row, after.get(index)) if line is not None]


def update_benchmarks(path: str, state: dict[str, Any], table: str) -> None:
  """The bench table into ``path`` under its device's name."""
  devices = sorted({row['device'] for record in state['experiments'].values()
                    for row in record.get('rows') or [] if row.get('device')})
  if not devices:
    return
  name = ', '.join(devices)
  write_block(path, table, f'<!-- bench:{name}:begin -->',
              f'<!-- bench:{name}:end -->',
              heading=f'## {name} (`python -m experiments.reproduce '
                      f'--suite=bench`, commit {(state.get("commit") or "?")[:7]}'
                      f', {state.get("updated")})')


def list_suite(workdir: str, suite: str, only: list[str], options: Options,
               experiments: list[Experiment] | None = None) -> str:
  """Each selected experiment's status and command, two lines each
  (``experiments``: as ``run_suite``'s)."""
  workdir = os.path.abspath(workdir)
  state = _load_state(os.path.join(workdir, 'reproduction.json'), suite)
  lines = []
  if experiments is None:
    experiments = suite_experiments(suite)
  for experiment in select(experiments, only):
    status = ('finished' if finished(experiment, workdir) else
              experiment.needs(options) or state['experiments'].get(
                  experiment.name, {}).get('status', 'not started'))
    lines.append(f'{experiment.name}: {status}\n  python ' + ' '.join(
        command(experiment, workdir, options)[1:]))
  return '\n'.join(lines)


def main(argv):
  if not _WORKDIR.value:
    launcher.usage_error(ValueError('--workdir is required: the directory '
                                    'of the suite (rerun with the same one '
                                    'to continue).'))
  # Absolute: the experiments' own data search is relative to their
  # working directory.
  absolute = lambda path: path and os.path.abspath(path)  # noqa: E731
  options = Options(absolute(_DATA_DIR.value), absolute(_AFFNIST_DIR.value),
                    absolute(_SMALLNORB_DIR.value), _BENCH_STEPS.value,
                    absolute(_CIFAR10_DIR.value), absolute(_SVHN_DIR.value))
  for flag, path in (('data_dir', options.data_dir),
                     ('affnist_dir', options.affnist_dir),
                     ('smallnorb_dir', options.smallnorb_dir),
                     ('cifar10_dir', options.cifar10_dir),
                     ('svhn_dir', options.svhn_dir)):
    if path and not os.path.isdir(path):
      launcher.usage_error(ValueError(f'--{flag}={path} is not a directory.'))
  for flag, path in (('readme', _README.value),
                     ('benchmarks', _BENCHMARKS.value)):
    if path and not os.path.isfile(path):
      launcher.usage_error(ValueError(f'--{flag}={path} is not a file.'))
  if _BENCHMARKS.value and _SUITE.value != 'bench':
    launcher.usage_error(ValueError('--benchmarks goes with --suite=bench '
                                    '(--readme takes the paper rows).'))
  if _README.value and _SUITE.value != 'paper':
    launcher.usage_error(ValueError(
        '--readme goes with --suite=paper (its block holds the paper rows; '
        '--suite=bench writes --benchmarks=BENCHMARKS.md).'))
  if _README.value:
    with open(_README.value) as f:
      text = f.read()
    if not 0 <= text.find(README_BEGIN) < text.find(README_END):
      # Found now, not after hours of training.
      launcher.usage_error(ValueError(
          f'--readme={_README.value} has no {README_BEGIN} ... {README_END} '
          'block to write the rows into: add the two lines, in that order, '
          'where the table belongs.'))
  if _LIST.value:
    launcher.run_command(argv, lambda: print(list_suite(
        _WORKDIR.value, _SUITE.value, _ONLY.value, options)))
    return
  result = []
  launcher.run_command(argv, lambda: result.append(run_suite(
      _WORKDIR.value, _SUITE.value, only=_ONLY.value,
      max_seconds=_MAX_SECONDS.value, options=options, readme=_README.value,
      benchmarks=_BENCHMARKS.value)))
  sys.exit(result[0] if result else 0)


if __name__ == '__main__':
  _define_flags()
  app.run(main, flags_parser=launcher.parse_flags)
