"""How a trained capsule network routes one test input.

    config.evals.routing = dict(type='routing_picture', index=0)

A CapsNet gets its DigitCaps coupling coefficients c_ij: for each class a
heatmap over the primary capsule grid, each capsule weighted by its length.
A matrix-capsule (EM) model gets its class layer's assignments R_ij: for
each class a heatmap over the ConvCaps2 grid, each capsule weighted by its
activation. Written to ``output_dir`` (default ``WORKDIR/figures``)
``/routing.png``.
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections

from capsjax import evaluators
from capsjax import figures

ROUTED_MODELS = ('capsnet', 'matrix_capsnet')


def check(config: ml_collections.ConfigDict, *, index: int = 0,
          output_dir: str = '') -> None:
  del output_dir
  if config.model not in ROUTED_MODELS:
    raise ValueError(f'the run holds a {config.model!r} model, which does not '
                     f'route; expected one of {ROUTED_MODELS}.')
  if index < 0:
    raise ValueError(f'index must be >= 0, got {index}.')


def evaluate(context: evaluators.Context, *, index: int = 0,
             output_dir: str = '') -> dict[str, Any]:
  """{'figure': the PNG's path, 'index', 'label'} of test image ``index``."""
  config = context.config
  check(config, index=index)
  test = context.dataset.test
  if index >= len(test.labels):
    raise ValueError(f'index {index} is past the {len(test.labels)} test '
                     f'images.')
  image = context.eval_inputs(test.images[index:index + 1])[0]
  path = context.output_path(
      'routing.png', output_dir or os.path.join(context.workdir, 'figures'))
  if context.write_files:
    figures.routing_figure(context.model, image, path,
                           class_names=figures.CLASS_NAMES.get(config.dataset))
  return {'figure': path, 'index': index, 'label': int(test.labels[index])}
