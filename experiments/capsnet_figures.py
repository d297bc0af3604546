"""Reconstructions and capsule-dimension perturbations of a trained CapsNet.

  python -m experiments.capsnet_figures --workdir=/tmp/capsnet_mnist

Reads the model from WORKDIR (config.json and the checkpoint selected on
validation, or the latest with --which=latest) and the first --num_images
test images of the dataset it was trained on, then writes
  reconstructions.png  inputs above their reconstructions (Sabour et al.
                       Fig. 3), true and predicted labels;
  perturbation.png     the winning capsule of test image --perturbation_index
                       decoded with each of its dimensions offset by -0.25 ..
                       0.25 in steps of 0.05 (Sabour et al. Fig. 4)
into --output_dir (default WORKDIR/figures) and prints their paths.
"""

import os

import numpy as np
from absl import app
from absl import flags
from flax import nnx

from capsjax import data as data_lib
from capsjax import figures
from capsjax import train_lib
from experiments import launcher

_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'Workdir of a trained CapsNet (holds config.json and the '
    'checkpoints).', required=True)
_OUTPUT_DIR = flags.DEFINE_string(
    'output_dir', None, 'Where to write the PNGs (default: WORKDIR/figures).')
_NUM_IMAGES = flags.DEFINE_integer(
    'num_images', 8, 'Number of test images in reconstructions.png.',
    lower_bound=1)
_PERTURBATION_INDEX = flags.DEFINE_integer(
    'perturbation_index', 0, 'Index of the test image whose capsule '
    'perturbation.png perturbs.', lower_bound=0)
_DATA_DIR = flags.DEFINE_string(
    'data_dir', None, "Dataset directory (default: the run's config.data_dir, "
    'then the usual search).')
_WHICH = flags.DEFINE_enum(
    'which', 'best', ['best', 'latest'], "Checkpoint: 'best' (selected on "
    "validation) or 'latest'.")


def test_split(config: dict, data_dir: str | None) -> data_lib.Split:
  """The test split of the dataset the run in ``config`` trained on."""
  data_dir = data_dir or config.get('data_dir') or None
  return data_lib.load_dataset(config['dataset'], data_dir=data_dir,
                               validation_size=0).test


def write_figures(model: nnx.Module, test: data_lib.Split, output_dir: str,
                  num_images: int, perturbation_index: int,
                  class_names=None) -> list[str]:
  if perturbation_index >= len(test.labels):
    raise ValueError(f'--perturbation_index {perturbation_index} is past the '
                     f'{len(test.labels)} test images.')
  images = data_lib.to_float(test.images[:num_images])
  outputs = figures.model_outputs(model, images)
  if 'reconstructions' not in outputs:
    raise ValueError('the model has no reconstruction decoder; nothing to '
                     'draw (train with model_options.reconstruction=True).')
  paths = [os.path.join(output_dir, 'reconstructions.png'),
           os.path.join(output_dir, 'perturbation.png')]
  figures.reconstruction_grid(
      images, outputs['reconstructions'], paths[0],
      labels=test.labels[:num_images],
      predictions=np.argmax(outputs['lengths'], axis=-1),
      class_names=class_names)
  image = data_lib.to_float(test.images[perturbation_index])
  figures.perturbation_grid(model, image, paths[1], class_names=class_names)
  return paths


def make_figures() -> None:
  workdir = _WORKDIR.value
  config = train_lib.read_workdir_config(workdir)
  if config.get('model') != 'capsnet':
    raise ValueError(f"{workdir} holds a {config.get('model')!r} model; "
                     "these figures need a 'capsnet' with a decoder.")
  model = train_lib.load_trained_model(workdir, _WHICH.value)
  test = test_split(config, _DATA_DIR.value)
  output_dir = _OUTPUT_DIR.value or os.path.join(workdir, 'figures')
  paths = write_figures(model, test, output_dir, _NUM_IMAGES.value,
                        _PERTURBATION_INDEX.value,
                        figures.CLASS_NAMES.get(config['dataset']))
  for path in paths:
    print(path)


def main(argv):
  launcher.run_command(argv, make_figures, (OSError, ValueError, KeyError))


if __name__ == '__main__':
  app.run(main)
