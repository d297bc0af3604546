"""The flags every training experiment shares and the error handling around it.

Experiments stay thin: flags -> config -> ``train_and_evaluate`` -> report.
Errors a user can fix (missing or corrupt data, bad config values, an
unwritable workdir, a diverged run) are printed as one clear message and exit
with status 2; set CAPSJAX_TRACEBACK=1 to see the full traceback. A
workdir that another process holds (``checkpoints.hold_workdir``) is such an
error, naming that process.
"""

import contextlib
import inspect
import os
import re
import sys
from collections.abc import Callable

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          'configs')
# The running experiment's default --config (set by ``run``).
_default_config = ''


def run_command(argv: list[str], body: Callable[[], None],
                errors: tuple[type[BaseException], ...] = (
                    OSError, ValueError, RuntimeError)) -> None:
  """What every experiment's ``main`` does around its ``body``.

  Rejects stray arguments, keeps absl's INFO logging (orbax logs every save
  and restore) off unless -v is given, makes glibc keep the memory XLA:CPU
  frees (``training.host_memory``: before JAX starts its backend), and turns
  ``errors`` into one ``error: ...`` line and exit status 2, and SIGINT or
  SIGTERM into one line and exit status 130 or 143 (a training run saves
  its checkpoint first).
  """
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  from capsjax.training import host_memory  # imports jax: after the flags
  logging.info('host memory: %s', host_memory.retain_freed_memory())
  from capsjax.kernels.conv import dispatch
  logging.info('CPU convolutions: %s',
               dispatch.prefer_eigen_convolutions())
  from capsjax.training import loop
  try:
    body()
  except loop.TrainingStopped as e:  # its one line is printed already
    sys.exit(e.exit_code)
  except KeyboardInterrupt:  # outside the training steps: nothing to save
    print('interrupted; rerun the same command to resume', file=sys.stderr)
    sys.exit(130)
  except errors as e:
    if os.environ.get('CAPSJAX_TRACEBACK') == '1':
      raise
    print(f'error: {type(e).__name__}: {e}', file=sys.stderr)
    sys.exit(2)


def _one_line(error: BaseException) -> str:
  """A flag error as one line: its first line and, if longer, its last."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  if len(lines) > 1:
    return f'{lines[0]} {lines[-1]}'
  return lines[0] if lines else type(error).__name__


def _innermost(error: BaseException) -> str:
  """ml_collections' message (with its "did you mean"), on one line; it
  wraps the KeyError in an AttributeError."""
  while error.args and isinstance(error.args[0], BaseException):
    error = error.args[0]
  return ' '.join(str(error.args[0] if error.args else error).split())


def usage_error(error: BaseException) -> None:
  """Print a bad flag as one ``error: ...`` line and exit with status 2."""
  print(f'error: {_one_line(error)} (see --help)', file=sys.stderr)
  sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
  """``app.run``'s flags_parser: a bad flag is one error line and exit 2.

  (absl's own parser prints a multi-line FATAL message and exits with 1.)
  """
  try:
    return flags.FLAGS(argv)
  except SystemExit as e:
    # absl's --help (and --helpshort, --helpfull) prints and exits 1: asking
    # for help is no failure.
    if e.code == 1 and set(argv[1:]) & {'--help', '-h', '-?', '--helpshort',
                                        '--helpfull'}:
      sys.exit(0)
    raise
  except flags.Error as e:
    usage_error(e)
  except (AttributeError, KeyError) as e:  # --config.KEY naming no key
    _override_error(e, _config_arg(argv, _default_config))


def _config_arg(argv: list[str], default: str) -> str:
  """The --config value of a command line (FILE[:VARIANTS]), or default."""
  for i, arg in enumerate(argv):
    if arg.startswith('--config='):
      return arg.split('=', 1)[1]
    if arg == '--config' and i + 1 < len(argv):
      return argv[i + 1]
  return default


def _check_config_file(spec: str) -> None:
  """A missing config file is one line listing the configs there are."""
  path = re.sub(r'(\.py):[^/]*$', r'\1', spec)
  if not os.path.isfile(path):
    names = sorted(f for f in os.listdir(CONFIG_DIR)
                   if f.endswith('.py') and not f.startswith('_')
                   and f != 'common.py')
    usage_error(ValueError(
        f'--config: no config file {path}. The configs: '
        f'{", ".join(os.path.join("experiments/configs", n) for n in names)}'
        f' (add :VARIANT, e.g. :smoke).'))


def _nearest_keys(spec: str, key: str) -> list[str]:
  """Config keys close to ``key`` (model_options.KEY for a model option
  given without its prefix), from the config file itself."""
  import difflib
  import importlib.util
  path, _, variant = spec.partition(':')
  try:
    module_spec = importlib.util.spec_from_file_location('_config', path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    config = module.get_config(variant) if variant else module.get_config()
  except Exception:  # noqa: BLE001 - a hint only; the error stands alone
    return []

  def flat(d, prefix=''):
    for name, value in d.items():
      if hasattr(value, 'items'):
        yield from flat(value, f'{prefix}{name}.')
      yield f'{prefix}{name}'
  keys = list(flat(config))
  # Every option of the model, set or not.
  keys += [f'model_options.{name}' for name in
           _model_options(config.get('model'))
           if f'model_options.{name}' not in keys]
  leaf = key.split('.')[-1]
  exact = [k for k in keys if k.split('.')[-1] == leaf and k != key]
  return exact or difflib.get_close_matches(key, keys, n=3)


def _override_error(error: BaseException, spec: str) -> None:
  """An override naming no key: one line, with the keys it may mean."""
  message = _innermost(error)
  match = re.search(r"'([\w.]+)'", message)
  # ml_collections' own suggestion stands; ours imports JAX (3 s).
  hints = (_nearest_keys(spec, match.group(1))
           if match and 'Did you mean' not in message else [])
  hint = (f' Did you mean {" or ".join(f"--config.{k}" for k in hints)}?'
          if hints else '')
  usage_error(ValueError(f'a --config.KEY=VALUE override names a key the '
                         f'config lacks: {message}{hint}'))


def _define_distributed_flags() -> dict[str, flags.FlagHolder]:
  """--distributed and the jax.distributed.initialize arguments."""
  module = sys.argv[0]
  return {
      'distributed': flags.DEFINE_bool(
          'distributed', False, 'Run as one process of a multi-process '
          '(multi-host) job: jax.distributed.initialize, then data '
          'parallelism over the devices of all processes. Start the same '
          'command on every host.', module_name=module),
      'coordinator_address': flags.DEFINE_string(
          'coordinator_address', None, 'host:port of process 0 (with '
          '--distributed; default: detected from SLURM, Open MPI, Kubernetes '
          'or a TPU pod).', module_name=module),
      'num_processes': flags.DEFINE_integer(
          'num_processes', None, 'Number of processes (with --distributed; '
          'default: detected).', lower_bound=1, module_name=module),
      'process_id': flags.DEFINE_integer(
          'process_id', None, 'This process, 0 .. num_processes - 1 (with '
          '--distributed; default: detected).', lower_bound=0,
          module_name=module),
  }


def _key_comments(path: str) -> dict[str, str]:
  """``config.KEY = ...`` lines of a config file -> the comment lines just
  above them, joined (the key's meaning where the file gives one)."""
  meanings, comment = {}, []
  with open(path) as f:
    for line in f:
      stripped = line.strip()
      match = re.match(r'config\.([\w.]+)\s*=', stripped)
      if stripped.startswith('#'):
        comment.append(stripped.lstrip('# '))
        continue
      if match and comment:
        meanings.setdefault(match.group(1), ' '.join(comment))
      comment = []
  return meanings


def _model_options(model) -> dict:
  """The options of ``config.model`` (a name or a 'module:Class' of
  yours) and their defaults; {} when it names no model."""
  if not model:  # e.g. a config of several runs: answered without JAX
    return {}
  from capsjax import models  # imports jax: after the flags
  try:
    return models.model_options(model)
  except ValueError:
    return {}


def _option_meaning(key: str, flat: dict, models) -> str:
  """``[PREFIX.]model_options.OPTION`` -> which model's option it is."""
  prefix, _, option = key.partition('model_options.')
  model = flat.get(f'{prefix}model')
  options = _model_options(model)
  if '.' in option or not options:
    return ''
  default = options.get(option, '?')
  shown = ('required' if default is inspect.Parameter.empty else
           f'default {default!r}')
  constructor = models.model_class(model)
  return (f'option {option} of {constructor.__module__}.'
          f'{constructor.__qualname__} ({shown}; its docstring says what '
          f'it does)')


def key_meaning(key: str, meanings: dict[str, str], flat: dict, models
                ) -> str:
  """The meaning of a flattened config key: its own comment, else that of
  the longest suffix that has one (``capsnet.learning_rate`` is a
  ``learning_rate``), else a model option's or an evaluator option's."""
  parts = key.split('.')
  for i in range(len(parts)):
    suffix = '.'.join(parts[i:])
    if suffix in meanings:
      return meanings[suffix]
    if suffix.startswith('model_options.'):
      meaning = _option_meaning('.'.join(parts[:i]) + ('.' if i else '') +
                                suffix, flat, models)
      if meaning:
        return meaning
  if len(parts) >= 3 and '.'.join(parts[:1]) in meanings:
    # A field of a dict-valued key (e.g. runs.NAME.num_epochs): the
    # dict's own comment says what its fields are.
    return f'a field of {parts[0]}: {meanings[parts[0]]}'
  if parts[0] == 'evals' and len(parts) >= 3:
    kind = flat.get(f'evals.{parts[1]}.type', '?')
    return (f'option {parts[-1]} of the {parts[1]!r} evaluation (type '
            f'{kind!r}: capsjax.evaluators.{kind})')
  return ''


def config_description(config, config_file: str) -> str:
  """The config file's docstring, then every key with its value (overrides
  applied) and its meaning from the comments of the config files."""
  import ast
  import glob
  import json
  # ml_collections returns the flag's value, variant included.
  config_file = re.sub(r'(\.py):[^/]*$', r'\1', config_file)
  with open(config_file) as f:
    doc = ast.get_docstring(ast.parse(f.read())) or ''
  # A key's meaning is where it is defined: common.py for the shared keys
  # (a config's comments there explain its value, which a variant may
  # change), else this config file, else the configs it builds on.
  meanings = {}
  for path in sorted(glob.glob(os.path.join(CONFIG_DIR, '*.py'))):
    meanings.update(_key_comments(path))
  meanings.update(_key_comments(config_file))
  meanings.update(_key_comments(os.path.join(CONFIG_DIR, 'common.py')))
  from capsjax import models  # imports jax: after the flags
  from capsjax.training import metrics
  lines = [doc, '', f'Keys of {config_file} (override with '
           f'--config.KEY=VALUE):']
  flat = metrics.flat_config(json.loads(config.to_json_best_effort()))
  for name, value in flat.items():
    meaning = key_meaning(name, meanings, flat, models)
    lines.append(f'  {name} = {json.dumps(value)}' +
                 (f'  # {meaning}' if meaning else ''))
  return '\n'.join(lines)


def define_trained_run_flags(module_name: str
                             ) -> tuple[flags.FlagHolder, flags.FlagHolder]:
  """``--data_dir`` and ``--which``: the flags of a command that reads a
  trained workdir (its figures), as (data_dir, which). ``module_name``: the
  command's ``__name__``, so that its ``--help`` lists them (absl names a
  ``python -m`` module by its path)."""
  if module_name == '__main__':
    module_name = sys.argv[0]
  data_dir = flags.DEFINE_string(
      'data_dir', None, "Dataset directory (default: the run's "
      'config.data_dir, then the usual search).', module_name=module_name)
  which = flags.DEFINE_enum(
      'which', 'selected', ['selected', 'best', 'latest'],
      "Checkpoint: 'selected' (the tested one), 'best' (of validation "
      "accuracy) or 'latest'.", module_name=module_name)
  return data_dir, which


def hold_for_output(workdir: str, output_dir: str | None, purpose: str
                    ) -> contextlib.AbstractContextManager:
  """What a command that reads a trained ``workdir`` and writes into
  ``output_dir`` (None: WORKDIR/figures) holds: the workdir, exclusively,
  when it writes there (so not during a training run, nor beside another
  such command); otherwise nothing beyond the shared hold of loading it."""
  from capsjax.training import checkpoints  # imports jax: after the flags
  workdir = os.path.realpath(workdir)
  target = os.path.realpath(output_dir or os.path.join(workdir, 'figures'))
  if not os.path.isdir(workdir) or (
      os.path.commonpath([workdir, target]) != workdir):
    # (A missing workdir is not created: loading it says what is wrong.)
    return contextlib.nullcontext()
  return checkpoints.hold_workdir(workdir, purpose)


def command_name() -> str:
  """This experiment as the lock file names it to a second process."""
  name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
  return f'experiments.{name}' if name and name != '-c' else 'a capsjax run'


def train(config, workdir: str) -> dict:
  """``capsjax.training.train``, imported once the flags are read: what
  ``run`` runs for an experiment that is one training run."""
  from capsjax import training  # imports jax: after the flags
  return training.train(config, workdir)


def define_config(default_config: str) -> flags.FlagHolder:
  """--config (default ``configs/<default_config>``) with its
  --config.KEY=VALUE overrides: a missing file, a bad override or a config
  that fails to build is one error line and exit status 2."""
  global _default_config
  _default_config = os.path.join(CONFIG_DIR, default_config)
  spec = _config_arg(sys.argv, _default_config)
  _check_config_file(spec)
  try:
    # ml_collections reads --config.KEY=VALUE overrides here already: an
    # unknown KEY raises now, before app.run parses the flags.
    config = config_flags.DEFINE_config_file(
        'config', _default_config,
        'Experiment config file, optionally with :variant (e.g. :smoke); '
        'override single keys with --config.KEY=VALUE.', lock_config=True)
  except (AttributeError, KeyError) as e:
    _override_error(e, spec)
  except (TypeError, ValueError) as e:
    usage_error(e)
  flags.FLAGS.register_flag_by_module(sys.argv[0], flags.FLAGS['config'])
  return config


def config_arg() -> str:
  """The command line's --config, FILE[:VARIANTS] (the default if none)."""
  return _config_arg(sys.argv, _default_config)


def run(train_and_evaluate: Callable, default_config: str, *,
        workdir_help: str = 'Directory for checkpoints, TensorBoard metrics '
        'and summary.json; rerun with the same one to resume.',
        reads_workdir: Callable[[], bool] | None = None) -> None:
  """Define --workdir and --config (default ``configs/<default_config>``), run.

  ``reads_workdir``: asked once the flags are parsed; True when the command
  only reads a trained workdir (e.g. --predict), which is then not held
  here (loading its model holds it shared) nor ever created.
  """
  workdir = flags.DEFINE_string(
      'workdir', None, f'Required. {workdir_help}',
      module_name=sys.argv[0])  # --help lists the main module's flags
  config_help = flags.DEFINE_bool(
      'config_help', False, "Print the config's keys with their values and "
      'meanings (after any --config.KEY=VALUE overrides) and exit.',
      module_name=sys.argv[0])
  config = define_config(default_config)
  distributed = _define_distributed_flags()

  def main(argv):
    if config_help.value:
      print(config_description(config.value, config_flags.get_config_filename(
          flags.FLAGS['config'])))
      return
    if not workdir.value:
      usage_error(ValueError('--workdir is required: the directory for this '
                             "run's checkpoints and results (rerun with the "
                             'same one to resume).'))

    def body():
      import jax  # after the flags

      from capsjax.training import checkpoints
      if distributed['distributed'].value:
        from capsjax.training import sharding
        sharding.initialize_distributed(
            distributed['coordinator_address'].value,
            distributed['num_processes'].value,
            distributed['process_id'].value)
      if reads_workdir is not None and reads_workdir():
        train_and_evaluate(config.value, workdir.value)
        return
      # Held before the data is read: a second launch on a busy workdir
      # stops at once, naming the run that holds it.
      with checkpoints.hold_workdir(workdir.value, command_name(),
                                    process_index=jax.process_index()):
        train_and_evaluate(config.value, workdir.value)

    run_command(argv, body)

  app.run(main, flags_parser=parse_flags)
