"""Train a capsule network on your own images, or predict with one.

  python -m experiments.own_images --workdir=/tmp/mine \\
      --config=experiments/configs/own_images.py:smoke \\
      --config.images=/path/to/folder
  python -m experiments.own_images --workdir=/tmp/mine --predict=new_photos/

Training prints the data's report, where each split comes from and the
images of each class in it, the model's size and memory, then the
per-class test accuracy (the confusion matrix is drawn in
WORKDIR/figures/confusion_test.png). --predict prints one line per image:
the file, its class name and the winning capsule's length; each file it
cannot read is one line on stderr.
"""

import os
import sys

from absl import flags

from experiments import launcher

_PREDICT = flags.DEFINE_multi_string(
    'predict', None, 'Instead of training: image files or folders (read '
    'recursively) to classify with the model trained in --workdir; prints '
    'each file, its class name and capsule length. Repeat for several. A '
    'file that is missing or cannot be decoded is named on stderr (one line '
    'each) and the rest are predicted; the exit status is 0 when at least '
    'one image was predicted, 2 when none could be. --workdir must hold a '
    'trained model (it is only read, never created).')


def _report(summary: dict) -> None:
  per_class = summary.get('evals', {}).get('per_class', {})
  accuracies = per_class.get('per_class_accuracy') or {}
  if accuracies:
    print('Per-class test accuracy:')
    width = max(len(name) for name in accuracies)
    for name, accuracy in accuracies.items():
      shown = '-' if accuracy is None else f'{100 * accuracy:.1f}%'
      print(f'  {name:<{width}}  {shown}')
  if per_class.get('figure'):
    print(f'Confusion matrix: {per_class["figure"]}')


def _check_trained(workdir: str) -> None:
  """FileNotFoundError naming ``workdir`` unless a run saved its model
  there: predict reads a workdir, it never makes one."""
  if os.path.isfile(os.path.join(workdir, 'config.json')):
    return
  what = ('no such folder' if not os.path.exists(workdir) else
          'no trained model in it: no config.json')
  raise FileNotFoundError(
      f'{workdir}: {what}. Train a model there first (python -m '
      f'experiments.own_images --workdir={workdir} '
      f'--config=experiments/configs/own_images.py --config.images=FOLDER), '
      f'then predict with the same --workdir.')


def _predict(workdir: str, paths: list[str]) -> None:
  _check_trained(workdir)
  from capsjax import training  # imports jax: after the flags
  from capsjax.training import own_images
  context = training.load_context(workdir)
  say = lambda line: print(line, file=sys.stderr)  # noqa: E731
  predictions = training.predict(context, paths, say=say)
  score = own_images.score_name(context.config)
  lines = [f'# file\tclass\t{score}'] + [
      f'{p.path}\t{p.class_name}\t{p.score:.4f}' for p in predictions]
  # Its reader may stop early (| head -1): then quietly, with the status
  # of a command ended by SIGPIPE.
  from capsjax import pretrained
  if not pretrained.print_until_closed(lines):
    sys.exit(pretrained.CLOSED_PIPE_STATUS)


def main(config, workdir: str) -> None:
  if _PREDICT.value:
    _predict(workdir, _PREDICT.value)
    return
  from capsjax import training  # imports jax: after the flags
  _report(training.train(config, workdir))


if __name__ == '__main__':
  # --predict only reads the workdir: the launcher neither holds nor makes
  # it.
  launcher.run(main, 'own_images.py',
               reads_workdir=lambda: bool(_PREDICT.value))
