"""Reconstructions and capsule-dimension perturbations of a trained CapsNet
(Sabour et al. 2017, Figs. 3 and 4).

    config.evals.figures = dict(type='reconstructions', num_images=8)

Writes into ``output_dir`` (default ``WORKDIR/figures``):
  reconstructions.png  the first ``num_images`` test images above their
                       reconstructions, true and predicted labels;
  perturbation.png     the winning capsule of test image
                       ``perturbation_index`` decoded with each of its
                       dimensions offset by -0.25 .. 0.25 in steps of 0.05.
"""

from __future__ import annotations

import os

import ml_collections
import numpy as np

from capsjax import evaluators
from capsjax import figures


def check(config: ml_collections.ConfigDict, *, num_images: int = 8,
          perturbation_index: int = 0, output_dir: str = '') -> None:
  del output_dir
  if config.model != 'capsnet':
    raise ValueError(f"the run holds a {config.model!r} model; these figures "
                     "need a 'capsnet' with a decoder.")
  if num_images < 1 or perturbation_index < 0:
    raise ValueError(f'num_images must be >= 1 and perturbation_index >= 0, '
                     f'got {num_images} and {perturbation_index}.')


def evaluate(context: evaluators.Context, *, num_images: int = 8,
             perturbation_index: int = 0, output_dir: str = ''
             ) -> dict[str, str]:
  """{'reconstructions', 'perturbation'}: the paths of the two PNGs."""
  config = context.config
  check(config, num_images=num_images, perturbation_index=perturbation_index)
  test = context.dataset.test
  if perturbation_index >= len(test.labels):
    raise ValueError(f'perturbation_index {perturbation_index} is past the '
                     f'{len(test.labels)} test images.')
  images = context.eval_inputs(test.images[:num_images])
  outputs = figures.model_outputs(context.model, images)
  if 'reconstructions' not in outputs:
    raise ValueError('the model has no reconstruction decoder; nothing to '
                     'draw (train with model_options.reconstruction=True).')
  output_dir = output_dir or os.path.join(context.workdir, 'figures')
  paths = {'reconstructions': context.output_path('reconstructions.png',
                                                  output_dir),
           'perturbation': context.output_path('perturbation.png', output_dir)}
  if context.write_files:
    class_names = figures.CLASS_NAMES.get(config.dataset)
    figures.reconstruction_grid(
        images, outputs['reconstructions'], paths['reconstructions'],
        labels=test.labels[:num_images],
        predictions=np.argmax(outputs['class_scores'], axis=-1),
        class_names=class_names)
    image = context.eval_inputs(
        test.images[perturbation_index:perturbation_index + 1])[0]
    figures.perturbation_grid(context.model, image, paths['perturbation'],
                              class_names=class_names)
  return paths
