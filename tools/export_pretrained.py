"""Write a trained workdir's selected model as a shipped model of
``capsjax.pretrained``: ``capsjax/pretrained_models/NAME.npz`` and
``NAME.json``.

    python tools/export_pretrained.py --workdir=W --name=capsnet_mnist_smoke \\
        --commit=$(git rev-parse HEAD) --command='python -m ...'

The model is the one the run tested (``training.load_context``: selected
on validation); the JSON holds the run's config, the command and commit
given, its date, accuracies and training time (the workdir's
``summary.json``) and the ``.npz``'s SHA-256. Both digests, the ``.npz``'s
and the ``.json`` content's, are printed: copy them into
``capsjax.pretrained.MODELS``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from capsjax import pretrained  # noqa: E402


def _info(workdir: str, context, args) -> dict:
  """The JSON beside the parameters (its 'sha256' added by the caller)."""
  from capsjax.evaluators import confusion
  with open(os.path.join(workdir, 'summary.json')) as f:
    summary = json.load(f)
  config = context.config
  # The class count as the model states it: its scores for a blank image.
  blank = np.zeros((1, pretrained.MNIST_SIZE, pretrained.MNIST_SIZE, 1),
                   np.uint8)
  num_classes = confusion.predict_scores(context, blank).shape[-1]
  shape = [int(n) for n in context.eval_inputs(blank).shape[1:]]
  return {
      'classes': list(confusion.class_names(config, num_classes)),
      'image_size': pretrained.MNIST_SIZE,
      'channels': shape[-1],
      'model_input': shape,
      'command': args.command,
      'commit': args.commit,
      'date': time.strftime('%Y-%m-%d', time.gmtime(
          os.path.getmtime(os.path.join(workdir, 'summary.json')))),
      'device': args.device,
      'steps_trained': summary['steps'],
      # The config's guard for slow machines stopped it before its steps.
      'stopped_by_time_limit': summary.get('stopped_by_time_limit', False),
      'selected_step': summary['selected_step'],
      'validation_accuracy': summary['validation']['accuracy'],
      'test_accuracy': summary['test']['accuracy'],
      # A run trained in resumed windows (a paper-suite run) counts its
      # last call only; its record has every window.
      'train_seconds_last_call': round(summary['train_wall_s_this_run'], 1),
      'num_params': summary['num_params'],
      'dtype': args.dtype,
      'config': config.to_dict(),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--name', required=True)
  parser.add_argument('--command', required=True)
  parser.add_argument('--commit', required=True)
  parser.add_argument('--device', default='2-core CPU')
  parser.add_argument('--dtype', default='float32',
                      choices=('float32', 'float16'),
                      help="the stored parameters' dtype: float16 for a "
                      'model whose float32 file would pass 5 MB')
  args = parser.parse_args()
  from capsjax import training
  context = training.load_context(args.workdir)
  os.makedirs(pretrained.MODELS_DIR, exist_ok=True)
  npz_path = pretrained.MODELS_DIR / f'{args.name}.npz'
  info = _info(args.workdir, context, args)
  from flax import nnx
  info['sha256'] = pretrained.save_params(
      nnx.state(context.model, pretrained.SHIPPED), npz_path, args.dtype)
  # The config's data folder is this machine's, not the user's.
  info['config']['data_dir'] = ''
  with open(pretrained.MODELS_DIR / f'{args.name}.json', 'w') as f:
    json.dump(info, f, indent=1)
    f.write('\n')
  print(f'{npz_path}: {os.path.getsize(npz_path):,} bytes, SHA-256 '
        f'{info["sha256"]}; its .json content: SHA-256 '
        f'{pretrained.info_sha256(info)}')


if __name__ == '__main__':
  main()
