"""Train a capsule network on your own images, or predict with one.

  python -m experiments.own_images --workdir=/tmp/mine \\
      --config=experiments/configs/own_images.py:smoke \\
      --config.images=/path/to/folder
  python -m experiments.own_images --workdir=/tmp/mine --predict=new_photos/

Training prints the data's report, the model's size and memory, then the
per-class test accuracy (the confusion matrix is drawn in
WORKDIR/figures/confusion_test.png). --predict prints one line per image:
the file, its class name and the winning capsule's length.
"""

import sys

from absl import flags

from capsjax import training
from capsjax.training import own_images
from experiments import launcher

_PREDICT = flags.DEFINE_multi_string(
    'predict', None, 'Instead of training: image files or folders (read '
    'recursively) to classify with the model trained in --workdir; prints '
    'each file, its class name and capsule length. Repeat for several.')


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


def _predict(workdir: str, paths: list[str]) -> None:
  context = training.load_context(workdir)
  say = lambda line: print(line, file=sys.stderr)  # noqa: E731
  predictions = training.predict(context, paths, say=say)
  score = own_images.score_name(context.config)
  print(f'# file\tclass\t{score}')
  for p in predictions:
    print(f'{p.path}\t{p.class_name}\t{p.score:.4f}')


def main(config, workdir: str) -> None:
  if _PREDICT.value:
    _predict(workdir, _PREDICT.value)
    return
  _report(training.train(config, workdir))


if __name__ == '__main__':
  launcher.run(main, 'own_images.py')
