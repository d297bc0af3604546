"""Does routing matter? Every routing on one backbone, one command.

  python -m experiments.routing_study --workdir=/scratch/routing_study
  python -m experiments.routing_study --workdir=/scratch/routing_study \\
      --max_seconds=3000   # a window; repeat until it says done
  python -m experiments.routing_study --workdir=/tmp/routing_study_smoke \\
      --config=experiments/configs/routing_study.py:smoke
  python -m experiments.routing_study --workdir=/scratch/routing_study \\
      --report --doc=docs/routing_study.md

Runs the study of the config (experiments/configs/routing_study.py: the
heads, seeds and datasets; what each run is) as ``experiments.reproduce``
runs a suite: each head's cost (``experiments.benchmark``), then one
training run (``experiments.train``) per seed, dataset and head, each in
WORKDIR/<name> with its checkpoints. A rerun of the same command continues
every unfinished run from its checkpoint and skips the finished ones;
``--max_seconds`` ends a call (the running experiment saves first) and
``--only`` runs some (shell globs: --only='mnist_*_seed0,cost_*').
--config.KEY=VALUE overrides reach every run. The record:
WORKDIR/reproduction.json and REPRODUCTION.md (each run's command, status,
calls, wall time, commit).

Every call then rewrites the report from the workdir alone (--report: only
that): WORKDIR/results.json (every run's numbers, per test and head the mean,
spread and difference from the no-routing control, each head's cost),
results.md (the tables) and routing_study.png (the figure); ``--doc`` also
writes the tables and the figure into that page's block.

Exit status as experiments.reproduce's: 0 when everything selected is
finished, 3 when --max_seconds stopped the call with work left, 2 when a run
failed (its log is named) or on a usage error, 130/143/129 on
Ctrl-C/SIGTERM/SIGHUP.
"""

from __future__ import annotations

import os
import sys

from absl import app
from absl import flags

from experiments import launcher
from experiments import reproduce

_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'Required. Directory of the study: one subdirectory '
    'per run, the record and the report; rerun with the same one to '
    'continue.')
_MAX_SECONDS = flags.DEFINE_float(
    'max_seconds', 0.0, 'Stop this call after this many seconds (0: no '
    'limit): the running experiment saves its checkpoint and the next call '
    'continues.', lower_bound=0.0)
_ONLY = flags.DEFINE_list(
    'only', [], 'Run only the runs matching these shell globs '
    '(comma-separated; --list shows the names).')
_REPORT = flags.DEFINE_bool(
    'report', False, 'Only rewrite the report from the workdir: train '
    'nothing.')
_DOC = flags.DEFINE_string(
    'doc', '', 'Also write the tables and the figure into this markdown '
    "page's <!-- routing_study:begin --> ... <!-- routing_study:end --> "
    'block (docs/routing_study.md), the figure beside it.')
_LIST = flags.DEFINE_bool(
    'list', False, "Print the study's runs, their status and commands, and "
    'exit.')
_CONFIG = launcher.define_config('routing_study.py')


def _study_lib():
  """``routing_study_lib``, imported after the flags are read: it imports
  JAX, which --help and a bad flag must not wait for."""
  from experiments import routing_study_lib
  return routing_study_lib


def run_study(workdir: str) -> int:
  """The study in ``workdir`` as the flags ask; the exit status."""
  study_lib = _study_lib()
  config_file = launcher.config_arg()
  config = _CONFIG.value
  experiments = study_lib.study_experiments(
      config, config_file, study_lib.config_overrides(sys.argv[1:]))
  only = study_lib.select(experiments, _ONLY.value)
  suite = os.path.basename(config_file)
  if _LIST.value:
    print(reproduce.list_suite(workdir, suite, only, reproduce.Options(),
                               experiments))
    return 0
  status = 0
  if not _REPORT.value:
    status = reproduce.run_suite(workdir, suite, only=only,
                                 max_seconds=_MAX_SECONDS.value,
                                 experiments=experiments)
  from capsjax.training import checkpoints
  with checkpoints.hold_workdir(workdir, 'experiments.routing_study'):
    results = study_lib.write_report(
        workdir, config, experiments, doc=_DOC.value,
        command=' '.join(['python -m experiments.routing_study']
                         + sys.argv[1:]))
  print(f"{os.path.join(workdir, study_lib.RESULTS_MD)}: "
        f"{results['finished_runs']} of {results['planned_runs']} runs "
        f'finished' + (f'; {_DOC.value} updated' if _DOC.value else ''))
  return status


def main(argv):
  if not _WORKDIR.value:
    launcher.usage_error(ValueError('--workdir is required: the directory '
                                    'of the study (rerun with the same one '
                                    'to continue).'))
  if _DOC.value:
    try:
      _study_lib().check_doc(_DOC.value)  # now, not after hours of training
    except ValueError as e:
      launcher.usage_error(e)
  workdir = os.path.abspath(_WORKDIR.value)
  result = []
  launcher.run_command(argv, lambda: result.append(run_study(workdir)))
  sys.exit(result[0] if result else 0)


if __name__ == '__main__':
  app.run(main, flags_parser=launcher.parse_flags)
