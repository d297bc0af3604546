"""Draw how a trained capsule network routes one test input.

  python -m experiments.routing_pictures --workdir=/tmp/capsnet_mnist --index=0

A CapsNet workdir gets the DigitCaps coupling coefficients c_ij: for each
class a heatmap over the primary capsule grid, each capsule weighted by its
length. A matrix-capsule (EM) workdir gets the class layer's assignments
R_ij: for each class a heatmap over the ConvCaps2 grid, each capsule
weighted by its activation. The picture goes to --output_dir (default
WORKDIR/figures)/routing.png, whose path is printed (the ``routing_picture``
evaluator).

Writing into WORKDIR, it holds the workdir as a training run does: it
stops with one line naming the process that holds it, if any.
"""

from absl import app
from absl import flags

from experiments import launcher

_WORKDIR = flags.DEFINE_string(
    'workdir', None, "Workdir of a trained 'capsnet' or 'matrix_capsnet' "
    '(holds config.json and the checkpoints).', required=True)
_INDEX = flags.DEFINE_integer(
    'index', 0, 'Index of the test image to route.', lower_bound=0)
_OUTPUT_DIR = flags.DEFINE_string(
    'output_dir', None, 'Where to write routing.png (default: '
    'WORKDIR/figures).')
_DATA_DIR, _WHICH = launcher.define_trained_run_flags(__name__)


def draw_routing() -> None:
  with launcher.hold_for_output(_WORKDIR.value, _OUTPUT_DIR.value,
                                'experiments.routing_pictures'):
    _draw_routing()


def _draw_routing() -> None:
  from capsjax import evaluators  # imports jax: after the flags
  from capsjax import training
  context = training.load_context(_WORKDIR.value, _WHICH.value,
                                  _DATA_DIR.value)
  picture = evaluators.get('routing_picture').evaluate(
      context, index=_INDEX.value, output_dir=_OUTPUT_DIR.value or '')
  print(f'test image {picture["index"]} (label {picture["label"]}): '
        f'{picture["figure"]}')


def main(argv):
  launcher.run_command(argv, draw_routing, (OSError, ValueError, KeyError))


if __name__ == '__main__':
  app.run(main, flags_parser=launcher.parse_flags)
