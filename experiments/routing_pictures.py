"""Draw how a trained capsule network routes one test input.

  python -m experiments.routing_pictures --workdir=/tmp/capsnet_mnist --index=0

A CapsNet workdir gets the DigitCaps coupling coefficients c_ij: for each
class a heatmap over the primary capsule grid, each capsule weighted by its
length. A matrix-capsule (EM) workdir gets the class layer's assignments
R_ij: for each class a heatmap over the ConvCaps2 grid, each capsule
weighted by its activation. The picture goes to --output_dir (default
WORKDIR/figures)/routing.png, whose path is printed.
"""

import os

import ml_collections
from absl import app
from absl import flags

from capsjax import data as data_lib
from capsjax import figures
from capsjax import train_em
from capsjax import train_lib
from experiments import launcher

_WORKDIR = flags.DEFINE_string(
    'workdir', None, "Workdir of a trained 'capsnet' or 'matrix_capsnet' "
    '(holds config.json and the checkpoints).', required=True)
_INDEX = flags.DEFINE_integer(
    'index', 0, 'Index of the test image to route.', lower_bound=0)
_OUTPUT_DIR = flags.DEFINE_string(
    'output_dir', None, 'Where to write routing.png (default: '
    'WORKDIR/figures).')
_DATA_DIR = flags.DEFINE_string(
    'data_dir', None, "Dataset directory (default: the run's config.data_dir, "
    'then the usual search).')
_WHICH = flags.DEFINE_enum(
    'which', 'best', ['best', 'latest'], "Checkpoint: 'best' (selected on "
    "validation) or 'latest'.")

_ROUTED_MODELS = ('capsnet', 'matrix_capsnet')


def load_test_split(config: ml_collections.ConfigDict, data_dir: str | None
                    ) -> data_lib.Split:
  """The test split the run in ``config`` was evaluated on."""
  options = {}
  if config.dataset == 'smallnorb':
    options = {'stereo': config.stereo,
               'viewpoint_split': config.viewpoint_split or None}
  return data_lib.load_dataset(
      config.dataset, data_dir=data_dir or config.data_dir or None,
      validation_size=0, **options).test


def model_input(config: ml_collections.ConfigDict, images):
  """uint8 test images -> what the model saw at evaluation."""
  if config.model == 'matrix_capsnet':
    return train_em.preprocess(config, images, None)
  return data_lib.to_float(images)


def draw_routing() -> None:
  workdir = _WORKDIR.value
  config = train_lib.read_workdir_config(workdir)
  if config.model not in _ROUTED_MODELS:
    raise ValueError(f'{workdir} holds a {config.model!r} model, which does '
                     f'not route; expected one of {_ROUTED_MODELS}.')
  model = train_lib.load_trained_model(workdir, _WHICH.value)
  test = load_test_split(config, _DATA_DIR.value)
  index = _INDEX.value
  if index >= len(test.labels):
    raise ValueError(
        f'--index {index} is past the {len(test.labels)} test images.')
  image = model_input(config, test.images[index:index + 1])[0]
  output_dir = _OUTPUT_DIR.value or os.path.join(workdir, 'figures')
  path = os.path.join(output_dir, 'routing.png')
  figures.routing_figure(model, image, path,
                         class_names=figures.CLASS_NAMES.get(config.dataset))
  print(f'test image {index} (label {int(test.labels[index])}): {path}')


def main(argv):
  launcher.run_command(argv, draw_routing, (OSError, ValueError, KeyError))


if __name__ == '__main__':
  app.run(main)
