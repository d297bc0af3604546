"""CapsNet on CIFAR-10, an ensemble of 7 (Sabour et al. 2017, section 7: 10.6%).

  python -m experiments.capsnet_ensemble --workdir=/tmp/capsnet_cifar10 \\
      --config=experiments/configs/capsnet_cifar10.py \\
      --config.data_dir=/path/to/cifar-10-batches-bin

Trains ``ensemble_size`` models that differ only in their seed (seed,
seed + 1, ..), each in WORKDIR/model_I, then averages their class scores
(the ``ensemble`` evaluator). One model alone:
``python -m experiments.train --workdir=W --config=<this file>``.

CIFAR-10 cannot be downloaded on machines without internet: put the binary
release (``data_batch_1.bin`` .. ``test_batch.bin``, as
``cifar-10-binary.tar.gz`` extracts) or the python one in data_dir, or
install capsjax[tfds] on a machine online (TFDS name ``cifar10``).

The paper: "the same architecture as the simple model we used for MNIST
except for the three color channels and using 64 different types of
primary capsule", 3 routing iterations, 24x24 patches, a "none-of-the-above"
category in the routing softmaxes, 7 models. The official code's run (its
README: ``--dataset=cifar10 --max_steps=600000 --hparams_override=
num_prime_capsules=64,padding=SAME,leaky=true,remake=false``) adds what the
paper does not say: 'SAME' padding in both convolutions (a 24x24 Conv1
grid, 12x12x64 = 9,216 primary capsules; 'VALID' would leave 4x4x64)
and no reconstruction decoder. Its input (``cifar10_input.inputs``): random
24x24 crops, left-right flips, brightness and contrast, per-image
standardisation of the 0-255 pixels; the central 24x24 at test. This config
is that run: the official form and loss (``model_options.form``,
``loss_form``), ``leaky`` in both capsule layers, 600,000 steps of batch
128 (1,707 epochs of the 45,000 images left beside validation).

Variants (``--config=experiments/configs/capsnet_cifar10.py:VARIANT``):
  smoke  a reduced CapsNet (same code, smaller widths), 2 models of 200
         steps of batch 32: the whole pipeline in minutes on a CPU.
"""

from experiments.configs import capsnet_mnist
from experiments.configs import common


def get_config(variant: str = ''):
  config = capsnet_mnist.get_config()
  config.shorter_run = common.smoke_run(
      'capsnet_cifar10.py:smoke', 'runs a reduced CapsNet ensemble end to end '
      'in minutes')
  config.dataset = 'cifar10'
  config.validation_size = 5000
  config.model_options.input_shape = (24, 24, 3)
  config.model_options.primary_types = 64
  config.model_options.padding = 'SAME'
  # The "none-of-the-above" category: an extra zero logit in every routing
  # softmax (the official leaky=true, in both capsule layers).
  config.model_options.leaky = True
  config.model_options.reconstruction = False
  # CIFAR-10 is read from its 32x32 files and cropped on the device
  # (training.vector_capsules.preprocess): no shifts.
  config.max_shift = 0
  # Left-right flips of the training crops (the official input flips).
  config.random_flip = True
  # Pixels are standardised from [0, pixel_max]: 255, the official code's
  # scale (its floats are the stored bytes); 1.0 differs only where the
  # standardisation's std floor 1/sqrt(24 * 24 * 3) binds.
  config.pixel_max = 255.0
  config.num_train_steps = 600_000
  config.eval_every_steps = 5000
  config.checkpoint_every_steps = 5000
  # Models of the ensemble (experiments.capsnet_ensemble): seeds seed ..
  # seed + ensemble_size - 1.
  config.ensemble_size = 7
  for part in filter(None, variant.split(',')):
    if part == 'smoke':
      config.model_options.conv1_channels = 32
      config.model_options.primary_types = 8
      config.ensemble_size = 2
      common.short_schedule(config)
    else:
      raise ValueError(f'unknown variant {part!r} of capsnet_cifar10; known: '
                       'smoke.')
  return config
