"""Reconstructions and capsule-dimension perturbations of a trained CapsNet.

  python -m experiments.capsnet_figures --workdir=/tmp/capsnet_mnist

Reads the model from WORKDIR (config.json and the checkpoint selected on
validation, or the latest with --which=latest) and the first --num_images
test images of the dataset it was trained on, then writes (the
``reconstructions`` evaluator)
  reconstructions.png  inputs above their reconstructions (Sabour et al.
                       Fig. 3), true and predicted labels;
  perturbation.png     the winning capsule of test image --perturbation_index
                       decoded with each of its dimensions offset by -0.25 ..
                       0.25 in steps of 0.05 (Sabour et al. Fig. 4)
into --output_dir (default WORKDIR/figures) and prints their paths.

Writing into WORKDIR, it holds the workdir as a training run does: it
stops with one line naming the process that holds it, if any.
"""

from absl import app
from absl import flags

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
_DATA_DIR, _WHICH = launcher.define_trained_run_flags(__name__)


def make_figures() -> None:
  with launcher.hold_for_output(_WORKDIR.value, _OUTPUT_DIR.value,
                                'experiments.capsnet_figures'):
    _make_figures()


def _make_figures() -> None:
  from capsjax import evaluators  # imports jax: after the flags
  from capsjax import training
  context = training.load_context(_WORKDIR.value, _WHICH.value,
                                  _DATA_DIR.value)
  paths = evaluators.get('reconstructions').evaluate(
      context, num_images=_NUM_IMAGES.value,
      perturbation_index=_PERTURBATION_INDEX.value,
      output_dir=_OUTPUT_DIR.value or '')
  for path in paths.values():
    print(path)


def main(argv):
  launcher.run_command(argv, make_figures, (OSError, ValueError, KeyError))


if __name__ == '__main__':
  app.run(main, flags_parser=launcher.parse_flags)
