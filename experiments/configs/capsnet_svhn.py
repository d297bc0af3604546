"""CapsNet on SVHN (Sabour et al. 2017, section 7: 4.3% test error).

  python -m experiments.train --workdir=/tmp/capsnet_svhn \\
      --config=experiments/configs/capsnet_svhn.py \\
      --config.data_dir=/path/to/svhn

SVHN cannot be downloaded on machines without internet: put the cropped
digits' ``train_32x32.mat`` and ``test_32x32.mat`` in data_dir, or install
capsjax[tfds] on a machine online (TFDS name ``svhn_cropped``).

The paper: "a smaller network on the small training set of SVHN with only
73257 images": 64 channels in the first convolution, 16 primary capsule
types of 6 dimensions, 8-dimensional class capsules. The official code has
no SVHN pipeline, so the rest is this config's choice, stated here: the
MNIST model otherwise (9x9 kernels, 'VALID' padding: 8x8x16 = 1,024 primary
capsules, 3 routing iterations, the official form and loss, the decoder
reconstructing the 32x32x3 input) and the MNIST input: pixels in [0, 1],
shifted by up to 2 pixels with zero padding; 26,700 steps of batch 128,
about 50 epochs of the 68,257 images left beside validation (as
capsnet_mnist.py's 50 epochs).

Variants (``--config=experiments/configs/capsnet_svhn.py:VARIANT``):
  smoke  a reduced CapsNet (same code, smaller widths): 200 steps of batch
         32, the whole pipeline in minutes on a CPU.
"""

from experiments.configs import capsnet_mnist
from experiments.configs import common


def get_config(variant: str = ''):
  config = capsnet_mnist.get_config()
  config.shorter_run = common.smoke_run('capsnet_svhn.py:smoke')
  config.dataset = 'svhn'
  config.validation_size = 5000
  config.model_options.input_shape = (32, 32, 3)
  config.model_options.conv1_channels = 64
  config.model_options.primary_types = 16
  config.model_options.primary_dim = 6
  config.model_options.digit_dim = 8
  config.num_train_steps = 26_700
  for part in filter(None, variant.split(',')):
    if part == 'smoke':
      config.model_options.conv1_channels = 16
      config.model_options.primary_types = 4
      config.model_options.decoder_widths = (64, 128)
      common.short_schedule(config)
    else:
      raise ValueError(f'unknown variant {part!r} of capsnet_svhn; known: '
                       'smoke.')
  return config
