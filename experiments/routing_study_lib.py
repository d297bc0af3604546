"""The routing study's runs and its report; ``experiments.routing_study`` is
the command (flags -> config -> these), experiments/configs/routing_study.py
the config.

- ``study_experiments``: the study as a suite that ``experiments.reproduce``
  runs (resumable, in windows, with its record): each head's cost
  (``experiments.benchmark``), then one training run (``experiments.train``)
  per seed, dataset and head, each in WORKDIR/<name>.
- ``collect``: what the finished runs measured, per test and head: the
  values over the seeds, their mean and spread, and whether the difference
  from the no-routing control is larger than the spreads.
- ``write_report``: WORKDIR/results.json, results.md and routing_study.png
  from the workdir alone (rerun it any time), and with a page
  (docs/routing_study.md) its table and figure there.

Every test is reported as an error rate in [0, 1] (lower is better): the
pairs' error is 1 - Su's accuracy 1 (the two highest scores are not the two
digits), BIM's the test error under the attack.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import shutil
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import ml_collections

from capsjax import study
from experiments import reproduce

DATASETS = ('mnist', 'fashion_mnist')
DATASET_TITLES = {'mnist': 'MNIST', 'fashion_mnist': 'Fashion-MNIST'}
RESULTS_JSON, RESULTS_MD, FIGURE = ('results.json', 'results.md',
                                    'routing_study.png')
DOC_BEGIN, DOC_END = '<!-- routing_study:begin -->', '<!-- routing_study:end -->'
# Untimed train steps before each head's timed ones.
COST_WARMUP = 3


class Test(NamedTuple):
  """One test: its key, its title, the dataset of the runs it reads, and
  ``read(summary) -> error`` (None where the run did not make it)."""
  key: str
  title: str
  dataset: str
  read: Callable[[dict[str, Any]], float | None]


def _eval_error(name: str, field: str) -> Callable[[dict], float | None]:
  """1 - summary['evals'][name][field] (a list: its first entry)."""
  def read(summary: dict[str, Any]) -> float | None:
    value = (summary.get('evals') or {}).get(name, {}).get(field)
    if isinstance(value, list):
      value = value[0] if value else None
    return None if value is None else 1.0 - float(value)
  return read


def _test_error(summary: dict[str, Any]) -> float | None:
  return (summary.get('test') or {}).get('error')


def tests(config: ml_collections.ConfigDict) -> tuple[Test, ...]:
  """The study's tests, on the datasets of ``config.datasets``."""
  bim = config.evals.get('bim')
  epsilon = (f'epsilon {bim.epsilons[0]:g}, {bim.bim_steps} steps of '
             f'{bim.bim_step_size:g}' if bim else '')
  found = []
  for dataset in config.datasets:
    name = DATASET_TITLES[dataset]
    found.append(Test(f'{dataset}_test_error', f'{name} test error', dataset,
                      _test_error))
    if dataset == 'mnist':
      found += [
          Test('translated_error', 'MNIST placed on 40x40, untransformed, '
               'error', dataset, _eval_error('translated', 'accuracy')),
          Test('affine_error', 'affine-transformed MNIST (40x40) error',
               dataset, _eval_error('affine', 'accuracy')),
          Test('pairs_error', "Su's stacked pairs (56x28), top-2 error",
               dataset, _eval_error('pairs', 'top2'))]
    if bim:
      found.append(Test(f'{dataset}_bim_error',
                        f'{name} error under BIM ({epsilon})', dataset,
                        _eval_error('bim', 'bim')))
  return tuple(found)


def check_study(config: ml_collections.ConfigDict) -> None:
  """ValueError naming the first of the study's keys that is wrong."""
  bad = [head for head in config.heads if head not in study.HEADS]
  if not config.heads or bad:
    raise ValueError(f'config.heads must name heads of {study.HEADS}, got '
                     f'{tuple(config.heads)}.')
  if (isinstance(config.num_seeds, bool) or not isinstance(
      config.num_seeds, int) or config.num_seeds < 1):
    raise ValueError(f'config.num_seeds must be a positive int, got '
                     f'{config.num_seeds!r}.')
  bad = [name for name in config.datasets if name not in DATASETS]
  if not config.datasets or bad:
    raise ValueError(f'config.datasets must name datasets of {DATASETS}, '
                     f'got {tuple(config.datasets)}.')
  if config.cost_steps < 1:
    raise ValueError(f'config.cost_steps must be >= 1, got '
                     f'{config.cost_steps!r}.')


# ----------------------------------------------------------------------------
# The suite.


def run_name(dataset: str, head: str, seed: int) -> str:
  return f'{dataset}_{head}_seed{seed}'


def cost_name(head: str) -> str:
  return f'cost_{head}'


def split_config_arg(config_file: str) -> tuple[str, list[str]]:
  """'path/routing_study.py:smoke,x' -> (absolute path, ['smoke', 'x'])."""
  match = re.fullmatch(r'(.*?\.py)(?::(.*))?', config_file)
  if match is None:
    raise ValueError(f'--config must be FILE.py[:VARIANTS], got {config_file!r}.')
  return (os.path.abspath(match.group(1)),
          [part for part in (match.group(2) or '').split(',') if part])


def config_overrides(argv: Sequence[str]) -> list[str]:
  """The --config.KEY=VALUE (or --config.KEY VALUE) arguments of a command
  line, as given: the study passes them on to each run."""
  found = []
  for i, arg in enumerate(argv):
    if arg.startswith('--config.'):
      found.append(arg)
      if '=' not in arg and i + 1 < len(argv):
        found.append(argv[i + 1])
  return found


def _model_options(overrides: Sequence[str]) -> list[str]:
  """--config.model_options.KEY=VALUE overrides as the benchmark's
  --model_option=KEY=VALUE."""
  prefix = '--config.model_options.'
  return [f'--model_option={arg[len(prefix):]}' for arg in overrides
          if arg.startswith(prefix) and '=' in arg]


def _training_row(name: str) -> Callable[[str], list[dict[str, Any]]]:
  return lambda workdir: [reproduce._run_row(
      reproduce._read(os.path.join(workdir, 'summary.json')), name, '-')]


def _cost_row(name: str) -> Callable[[str], list[dict[str, Any]]]:
  def rows(workdir: str) -> list[dict[str, Any]]:
    row = reproduce._read(os.path.join(workdir, 'bench.json'))['rows'][0]
    return [{'row': name, 'metric': 'train img/s (benchmark)', 'paper': '-',
             'test': None, 'validation': None, 'steps': row['steps'],
             'epochs': None, 'images_per_s': row['train_images_per_s'],
             'device': row.get('device'), 'commit': row.get('git_commit')}]
  return rows


def _cost_experiment(head: str, config: ml_collections.ConfigDict,
                     path: str, variants: list[str],
                     overrides: Sequence[str]) -> reproduce.Experiment:
  """The head's train step timed (``experiments.benchmark``) at the
  study's batch size: img/s, XLA's memory and FLOPs."""
  name = os.path.splitext(os.path.basename(path))[0]
  if os.path.dirname(path) != reproduce.launcher.CONFIG_DIR:
    raise ValueError(f'the study config must live in '
                     f'{reproduce.launcher.CONFIG_DIR} (its cost is measured '
                     f'by experiments.benchmark, which reads configs there), '
                     f'got {path}.')
  model = name + (f':{",".join(variants)}' if variants else '')

  def args(workdir: str, options: reproduce.Options) -> list[str]:
    del options
    return [f'--model={model}', f'--batch_size={config.batch_size}',
            f'--steps={config.cost_steps}', f'--warmup={COST_WARMUP}',
            *_model_options(overrides), f'--model_option=head={head}',
            f'--output={os.path.join(workdir, "bench.json")}']
  return reproduce.Experiment(cost_name(head), 'experiments.benchmark', args,
                              'bench.json', _cost_row(cost_name(head)))


def _training_experiment(dataset: str, head: str, seed: int, path: str,
                         variants: list[str], overrides: Sequence[str]
                         ) -> reproduce.Experiment:
  """One run: this config (Fashion-MNIST: its variant), the head and seed
  set after the command line's own overrides."""
  parts = variants + (['fashion_mnist'] if dataset == 'fashion_mnist' else [])
  config_file = path + (f':{",".join(parts)}' if parts else '')
  name = run_name(dataset, head, seed)

  def args(workdir: str, options: reproduce.Options) -> list[str]:
    del options
    return [f'--workdir={workdir}', f'--config={config_file}', *overrides,
            f'--config.model_options.head={head}', f'--config.seed={seed}']
  return reproduce.Experiment(name, 'experiments.train', args, 'summary.json',
                              _training_row(name))


def study_experiments(config: ml_collections.ConfigDict, config_file: str,
                      overrides: Sequence[str] = ()
                      ) -> list[reproduce.Experiment]:
  """The suite of ``config`` (built from ``config_file``, FILE.py[:VARIANTS],
  with ``overrides``): every head's cost, then the runs seed by seed, so
  that one seed of every head and dataset finishes first."""
  check_study(config)
  path, variants = split_config_arg(config_file)
  entries = [_cost_experiment(head, config, path, variants, overrides)
             for head in config.heads]
  for seed in range(config.num_seeds):
    for dataset in config.datasets:
      entries += [_training_experiment(dataset, head, seed, path, variants,
                                       overrides) for head in config.heads]
  return entries


def select(experiments: Sequence[reproduce.Experiment],
           patterns: Sequence[str]) -> list[str]:
  """The names matching any of ``patterns`` (shell globs:
  'mnist_*_seed0', 'cost_*'); ValueError for one that matches none."""
  names = [e.name for e in experiments]
  for pattern in patterns:
    if not fnmatch.filter(names, pattern):
      raise ValueError(f'--only={pattern} matches no run of the study; its '
                       f'runs: {", ".join(names)}.')
  return [name for name in names
          if any(fnmatch.fnmatch(name, p) for p in patterns)]


# ----------------------------------------------------------------------------
# What the runs measured.


def _read_json(path: str) -> dict[str, Any] | None:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def mean_and_spread(values: Sequence[float]) -> tuple[float, float | None]:
  """(mean, sample standard deviation; None for one value)."""
  mean = sum(values) / len(values)
  if len(values) < 2:
    return mean, None
  return mean, math.sqrt(sum((v - mean) ** 2 for v in values)
                         / (len(values) - 1))


def compare(head: dict[str, Any], control: dict[str, Any] | None
            ) -> tuple[float | None, bool | None]:
  """(difference of the head's mean from the control's, whether it is
  larger than the sum of their spreads; None where undefined)."""
  if control is None:
    return None, None
  difference = head['mean'] - control['mean']
  if head['spread'] is None or control['spread'] is None:
    return difference, None
  return difference, abs(difference) > head['spread'] + control['spread']


def _test_results(test: Test, config: ml_collections.ConfigDict,
                  summaries: dict[str, dict]) -> dict[str, dict[str, Any]]:
  """head -> {'seeds', 'values', 'mean', 'spread', 'difference',
  'beyond_spread'} of one test, over the finished runs."""
  found = {}
  for head in config.heads:
    seeds, values = [], []
    for seed in range(config.num_seeds):
      summary = summaries.get(run_name(test.dataset, head, seed))
      value = None if summary is None else test.read(summary)
      if value is not None:
        seeds.append(seed)
        values.append(value)
    if values:
      mean, spread = mean_and_spread(values)
      found[head] = {'seeds': seeds, 'values': values, 'mean': mean,
                     'spread': spread}
  for head, record in found.items():
    control = found.get(study.CONTROL_HEAD) if head != study.CONTROL_HEAD \
        else None
    record['difference'], record['beyond_spread'] = compare(record, control)
  return found


def _head_costs(workdir: str, config: ml_collections.ConfigDict,
                summaries: dict[str, dict]) -> dict[str, dict[str, Any]]:
  """head -> its parameters, class score and cost: the benchmark's img/s
  and memory, the runs' mean img/s, and per 28x28 image the routing's
  FLOPs (``capsjax.flops``) and the whole forward pass's
  (``study.forward_flops``; XLA's own count leaves out the convolutions
  that run as oneDNN calls)."""
  options = config.model_options
  children = study.num_children(28, 28, options.primary_types)
  heads = {}
  for head in config.heads:
    bench = _read_json(os.path.join(workdir, cost_name(head), 'bench.json'))
    row = (bench or {}).get('rows', [{}])[0]
    runs = [summaries[name] for name in (
        run_name(dataset, head, seed) for dataset in config.datasets
        for seed in range(config.num_seeds)) if name in summaries]
    speeds = [s['train_images_per_s'] for s in runs
              if s.get('train_images_per_s')]
    heads[head] = {
        'score': study.SCORES[head],
        'num_params': row.get('num_params') or next(
            (s.get('num_params') for s in runs), None),
        'train_images_per_s': row.get('train_images_per_s'),
        'runs_train_images_per_s': (sum(speeds) / len(speeds) if speeds
                                    else None),
        'peak_memory_bytes': row.get('peak_memory_bytes'),
        'routing_flops_per_image': study.routing_cost(
            head, children, capsule_dim=options.capsule_dim).flops,
        'forward_flops_per_image': study.forward_flops(
            head, stem_widths=tuple(options.stem_widths),
            primary_types=options.primary_types,
            capsule_dim=options.capsule_dim),
        'device': row.get('device')}
  return heads


def _run_digest(name: str, summary: dict[str, Any] | None,
                record: dict[str, Any]) -> dict[str, Any]:
  """A run's status, command, calls and wall time from the suite's record,
  and the numbers of its summary."""
  digest = {key: record.get(key) for key in ('status', 'command', 'calls',
                                              'wall_s')}
  if summary is None:
    return digest
  digest.update({key: summary.get(key) for key in (
      'steps', 'selected_step', 'num_params', 'train_images_per_s',
      'train_wall_s_this_run', 'device', 'git_commit')})
  digest['validation_error'] = (summary.get('validation') or {}).get('error')
  digest['test_error'] = (summary.get('test') or {}).get('error')
  digest['evals'] = summary.get('evals')
  return digest


def collect(workdir: str, config: ml_collections.ConfigDict,
            experiments: Sequence[reproduce.Experiment]) -> dict[str, Any]:
  """Everything the report says, from the workdir: the heads (parameters,
  scores, cost), per test and head the results, per run its digest, and the
  suite's progress, wall time, commits and devices."""
  state = _read_json(os.path.join(workdir, 'reproduction.json')) or {}
  records = state.get('experiments', {})
  summaries = {}
  for experiment in experiments:
    if experiment.module == 'experiments.train':
      summary = _read_json(os.path.join(workdir, experiment.name,
                                        'summary.json'))
      if summary is not None:
        summaries[experiment.name] = summary
  runs = {e.name: _run_digest(e.name, summaries.get(e.name),
                              records.get(e.name, {}))
          for e in experiments}
  return {
      'suite': state.get('suite'),
      'tests': [{'key': t.key, 'title': t.title, 'dataset': t.dataset}
                for t in tests(config)],
      'heads': _head_costs(workdir, config, summaries),
      'results': {t.key: _test_results(t, config, summaries)
                  for t in tests(config)},
      'runs': runs,
      'finished_runs': len(summaries),
      'planned_runs': sum(e.module == 'experiments.train'
                          for e in experiments),
      'wall_s': sum(r.get('wall_s') or 0.0 for r in records.values()),
      'commits': sorted({s['git_commit'] for s in summaries.values()
                         if s.get('git_commit')}),
      'devices': sorted({s['device'] for s in summaries.values()
                         if s.get('device')}),
      'control': study.CONTROL_HEAD,
  }


# ----------------------------------------------------------------------------
# The tables and the figure.


def _percent(value: float | None) -> str:
  return '-' if value is None else f'{100 * value:.2f}%'


def _number(value: float | None, form: str) -> str:
  return '-' if value is None else format(value, form)


def heads_table(results: dict[str, Any]) -> str:
  """Markdown: per head its class score, parameters and cost."""
  lines = ['| head | class score | parameters | train img/s (benchmark) | '
           'train img/s (runs, mean) | train step memory MiB (XLA) | routing '
           'MFLOPs / image | forward MFLOPs / image |',
           '|---|---|---|---|---|---|---|---|']
  for head, record in results['heads'].items():
    memory = record['peak_memory_bytes']
    lines.append(
        f"| {head} | {record['score']} | "
        f"{_number(record['num_params'], ',')} | "
        f"{_number(record['train_images_per_s'], '.0f')} | "
        f"{_number(record['runs_train_images_per_s'], '.0f')} | "
        f"{_number(memory and memory / 2**20, '.0f')} | "
        f"{record['routing_flops_per_image'] / 1e6:.3f} | "
        f"{record['forward_flops_per_image'] / 1e6:.1f} |")
  return '\n'.join(lines) + '\n'


def _beyond(record: dict[str, Any], head: str, control: str) -> str:
  if head == control:
    return '(the control)'
  if record['difference'] is None:
    return f'- (no {control} run)'
  if record['beyond_spread'] is None:
    return '- (one seed)'
  return 'yes' if record['beyond_spread'] else 'no'


def results_table(results: dict[str, Any]) -> str:
  """Markdown: per test and head the mean error, its spread over the seeds,
  the difference from the control and whether it is beyond the spreads."""
  control = results['control']
  lines = ['| test | head | mean error | spread (sd) | seeds | difference '
           f'from {control} | beyond the spreads |',
           '|---|---|---|---|---|---|---|']
  for test in results['tests']:
    for head, record in results['results'][test['key']].items():
      difference = record['difference']
      lines.append(
          f"| {test['title']} | {head} | {_percent(record['mean'])} | "
          f"{_percent(record['spread'])} | {len(record['values'])} | "
          f"{'-' if difference is None else f'{100 * difference:+.2f} pp'} | "
          f'{_beyond(record, head, control)} |')
  return '\n'.join(lines) + '\n'


def _wall(seconds: float) -> str:
  return f'{seconds / 3600:.1f} h' if seconds >= 3600 else f'{seconds:.0f} s'


def summary_lines(results: dict[str, Any]) -> str:
  """What ran: runs finished, wall time, commits and devices."""
  commits = ', '.join(c[:7] for c in results['commits']) or '-'
  return (f"{results['finished_runs']} of {results['planned_runs']} runs "
          f"finished (suite {results['suite']!r}; wall time "
          f"{_wall(results['wall_s'])}; commit {commits}; "
          f"{', '.join(results['devices']) or '-'}). Errors in percent, lower "
          f'is better; spread: the standard deviation over the seeds; beyond '
          f'the spreads: the difference from the control is larger than the '
          f"sum of the two spreads (a rough mark of three seeds, not a "
          f'significance test).\n')


def markdown(results: dict[str, Any]) -> str:
  return (summary_lines(results) + '\n' + heads_table(results) + '\n'
          + results_table(results))


def figure(results: dict[str, Any], path: str) -> bool:
  """Each test a panel, each head a bar (its mean error, the spread as an
  error bar, each seed a dot; the control grey) into ``path``; False
  (nothing written) while no run has finished."""
  panels = [t for t in results['tests'] if results['results'][t['key']]]
  if not panels:
    return False
  from matplotlib.figure import Figure
  columns = min(3, len(panels))
  rows = -(-len(panels) // columns)
  fig = Figure(figsize=(4.6 * columns, 3.6 * rows), dpi=100)
  axes = fig.subplots(rows, columns, squeeze=False).ravel()
  heads = list(results['heads'])
  for ax, test in zip(axes, panels, strict=False):
    found = results['results'][test['key']]
    for x, head in enumerate(heads):
      if head not in found:
        continue
      record = found[head]
      colour = 'tab:grey' if head == results['control'] else 'tab:blue'
      ax.bar(x, 100 * record['mean'], color=colour, alpha=0.6,
             yerr=None if record['spread'] is None else 100 * record['spread'],
             capsize=3)
      ax.plot([x] * len(record['values']),
              [100 * v for v in record['values']], 'k.', markersize=4)
    ax.set_xticks(range(len(heads)))
    ax.set_xticklabels(heads, rotation=45, ha='right', fontsize=8)
    ax.set_ylabel('error (%)')
    ax.set_title(test['title'], fontsize=9)
    ax.grid(axis='y', alpha=0.3)
  for ax in axes[len(panels):]:
    ax.set_visible(False)
  fig.suptitle('Routing study: mean over seeds, bars \u00b1 one standard '
               'deviation, dots the seeds; grey: the no-routing control',
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, facecolor='white')
  return True


NOT_RUN = ('The study has not run yet: no run has finished, so there is no '
           'number here.\n')


def doc_block(results: dict[str, Any], figure_name: str | None) -> str:
  """The page's block: what ran, the tables, the figure."""
  if not results['finished_runs']:
    return NOT_RUN
  text = markdown(results)
  if figure_name:
    text += f'\n![The routing study]({figure_name})\n'
  return text


def check_doc(path: str) -> None:
  """ValueError unless ``path`` is a file with the study's block."""
  if not os.path.isfile(path):
    raise ValueError(f'--doc={path} is not a file.')
  with open(path) as f:
    text = f.read()
  if not 0 <= text.find(DOC_BEGIN) < text.find(DOC_END):
    raise ValueError(f'--doc={path} has no {DOC_BEGIN} ... {DOC_END} block '
                     f'for the results: add the two lines, in that order.')


def write_report(workdir: str, config: ml_collections.ConfigDict,
                 experiments: Sequence[reproduce.Experiment], *,
                 command: str = '', doc: str = '') -> dict[str, Any]:
  """results.json, results.md and the figure in ``workdir``, from what it
  holds; with ``doc`` the page's block (and the figure beside the page).
  Returns the results."""
  from capsjax.training import metrics
  os.makedirs(workdir, exist_ok=True)
  results = collect(workdir, config, experiments)
  results['command'] = command
  results['config'] = json.loads(config.to_json_best_effort())
  metrics.write_json_atomic(os.path.join(workdir, RESULTS_JSON), results)
  metrics.write_text_atomic(os.path.join(workdir, RESULTS_MD),
                            markdown(results))
  drawn = figure(results, os.path.join(workdir, FIGURE))
  if doc:
    check_doc(doc)
    if drawn:
      shutil.copyfile(os.path.join(workdir, FIGURE),
                      os.path.join(os.path.dirname(os.path.abspath(doc)),
                                   FIGURE))
    reproduce.write_block(doc, doc_block(results, FIGURE if drawn else None),
                          DOC_BEGIN, DOC_END)
  return results
