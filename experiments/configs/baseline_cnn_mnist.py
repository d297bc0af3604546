"""The baseline CNN of Sabour et al. 2017 (35.4M parameters) on MNIST.

  python -m experiments.train --workdir=/tmp/baseline_mnist \\
      --config=experiments/configs/baseline_cnn_mnist.py

Variants: smoke (narrow layers for CPU tests), fashion (Fashion-MNIST).
"""

from experiments.configs import common


def get_config(variant: str = ''):
  config = common.base_config()
  config.shorter_run = common.smoke_run('baseline_cnn_mnist.py:smoke')
  config.model = 'baseline_cnn'
  config.num_train_steps = 21_500
  config.reconstruction_weight = 0.0
  for part in filter(None, variant.split(',')):
    if part == 'smoke':
      config.model_options.conv_channels = (32, 32, 16)
      config.model_options.fc_widths = (64, 32)
      config.batch_size = 64
      config.num_train_steps = 600
      config.eval_every_steps = 300
      config.checkpoint_every_steps = 300
      config.log_every_steps = 50
    elif part == 'fashion':
      config.dataset = 'fashion_mnist'
    else:
      raise ValueError(f'unknown variant {part!r} of baseline_cnn_mnist; '
                       f'known: smoke, fashion.')
  return config
