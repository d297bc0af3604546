"""Evaluations of a trained model that plug into training, as big_vision's.

A run's config lists them under ``config.evals``, each entry an evaluator
type (a module of this package) and its options:

    config.evals.pairs = dict(type='two_digit_transfer', num_pairs=0)
    config.evals.affnist = dict(type='affine', source='affnist',
                                directory='/data/affNIST')

After ``training.fit`` has selected the model on validation and tested it,
it calls ``run(config, context)``: every listed module's
``evaluate(context, **options) -> dict`` on the selected model, the results
under ``summary['evals'][name]``. A module may also define
``check(config, **options)``, which ``check(config)`` calls before any
training so that a bad option (a missing file) fails at once. A trained
workdir is evaluated the same way through ``training.load_context``.

Evaluators: ``classification`` (a split of the run's own dataset),
``affine`` (affine-transformed MNIST test digits or the affNIST test set),
``two_digit_transfer`` (Su's two-digit test), ``multimnist_figure`` (Sabour et
al. Fig. 5), ``adversarial`` (FGSM and BIM), ``reconstructions`` (Sabour et al.
Figs. 3 and 4), ``routing_picture`` (couplings or EM assignments),
``ensemble`` (several trained models' class scores averaged) and
``confusion`` (per-class accuracy and the confusion matrix).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import pkgutil
from collections.abc import Callable
from typing import Any

import ml_collections
from flax import nnx

from capsjax import data as data_lib


@dataclasses.dataclass
class Context:
  """What an evaluator is given.

  model: the selected model, its parameters on the host.
  config: the run's config.
  workdir: the run's directory (figures go there unless told otherwise).
  evaluate_split: Split of uint8 images -> {'accuracy', 'error', 'loss'}
    over all of it, with the family's own evaluation step (the run's
    preprocessing and loss), data-parallel on the run's devices.
  eval_inputs: uint8 images -> what the model reads at evaluation (the
    run's preprocessing: [0, 1] floats, a centre crop, smallNORB's crop).
  load_dataset: () -> the run's Dataset; read once, on first use of
    ``dataset``.
  write_files: whether this process writes files (process 0 of a
    multi-process run).
  load_workdir: (workdir, which, data_dir) -> the Context of another
    trained workdir (``training.load_context``, which training passes in:
    this package imports nothing of training); None where none is given.
  """
  model: nnx.Module
  config: ml_collections.ConfigDict
  workdir: str
  evaluate_split: Callable[[data_lib.Split], dict[str, float]]
  eval_inputs: Callable[[Any], Any]
  load_dataset: Callable[[], data_lib.Dataset]
  write_files: bool = True
  load_workdir: Callable[[str, str, str | None], Context] | None = None

  @functools.cached_property
  def dataset(self) -> data_lib.Dataset:
    return self.load_dataset()

  def output_path(self, name: str, directory: str | None = None) -> str:
    """``directory/name`` (default: the workdir), the directory made."""
    directory = directory or self.workdir
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, name)


def check_int(evaluator: str, name: str, value: Any, minimum: int,
              note: str = '') -> None:
  """ValueError unless the option ``name`` is an int >= ``minimum``."""
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f'the {evaluator} evaluator takes {name} >= {minimum}'
                     f'{note}, got {value!r}.')


def available() -> tuple[str, ...]:
  """The evaluator types: the modules of this package."""
  return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)))


def get(kind: str):
  """The evaluator module of type ``kind``; ValueError naming the known."""
  if kind not in available():
    raise ValueError(f'unknown evaluator type {kind!r}; known: '
                     f'{", ".join(available())}.')
  return importlib.import_module(f'{__name__}.{kind}')


def _entries(config: ml_collections.ConfigDict
             ) -> list[tuple[str, Any, dict[str, Any]]]:
  """(name, module, options) of each of ``config.evals``, checked."""
  entries = []
  for name, entry in (config.get('evals') or {}).items():
    options = dict(entry.to_dict() if hasattr(entry, 'to_dict') else entry)
    kind = options.pop('type', None)
    if kind is None:
      raise ValueError(f'config.evals.{name} names no evaluator type; set '
                       f'config.evals.{name}.type to one of '
                       f'{", ".join(available())}.')
    options = {k: tuple(v) if isinstance(v, list) else v
               for k, v in options.items()}
    entries.append((name, get(kind), options))
  return entries


def check(config: ml_collections.ConfigDict) -> None:
  """Rejects a bad ``config.evals`` entry before anything is trained."""
  for name, module, options in _entries(config):
    valid = [p.name for p in
             inspect.signature(module.evaluate).parameters.values()
             if p.kind == p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(valid))
    if unknown:
      raise ValueError(f'config.evals.{name}: the {module.__name__} '
                       f'evaluator takes no option {unknown}; its options: '
                       f'{", ".join(valid)}.')
    if hasattr(module, 'check'):
      module.check(config, **options)


def run(config: ml_collections.ConfigDict, context: Context
        ) -> dict[str, dict[str, Any]]:
  """name -> metrics of every evaluator of ``config.evals``, in order."""
  results = {}
  for name, module, options in _entries(config):
    results[name] = module.evaluate(context, **options)
  return results
