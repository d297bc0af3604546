"""CapsNet (Sabour et al. 2017) on MNIST: 3 routing iterations + reconstruction.

  python -m experiments.capsnet_mnist --workdir=/tmp/capsnet_mnist \\
      --config=experiments/configs/capsnet_mnist.py

Variants (``--config=experiments/configs/capsnet_mnist.py:VARIANT``):
  smoke    a reduced CapsNet (same code, smaller widths) that trains on a CPU
           in about two minutes; CI runs it.
  norecon  the paper's ablation without the reconstruction loss.
  iter1    1 routing iteration.
Any key can be overridden: ``--config.num_train_steps=1000``.
"""

from experiments.configs import common


def get_config(variant: str = ''):
  config = common.base_config()
  config.dataset = 'mnist'
  config.model = 'capsnet'
  config.model_options.num_iterations = 3
  config.model_options.reconstruction = True
  config.reconstruction_weight = 0.0005
  # About 50 epochs of 55k images; the official code trained ~300k steps.
  config.num_train_steps = 21_500
  for part in filter(None, variant.split(',')):
    if part == 'smoke':
      config.model_options.conv1_channels = 32
      config.model_options.primary_types = 8
      config.model_options.decoder_widths = (64, 128)
      config.batch_size = 64
      config.num_train_steps = 900
      config.eval_every_steps = 300
      config.checkpoint_every_steps = 300
      config.log_every_steps = 50
      config.lr_decay_steps = 500
    elif part == 'norecon':
      config.model_options.reconstruction = False
    elif part == 'iter1':
      config.model_options.num_iterations = 1
    elif part == 'fashion':
      config.dataset = 'fashion_mnist'
    else:
      raise ValueError(f'unknown variant {part!r} of capsnet_mnist; known: '
                       f'smoke, norecon, iter1, fashion.')
  return config
