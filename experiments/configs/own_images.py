"""Your own images: a capsule network of any family on a folder, a .npz or a
TFDS dataset, its shapes taken from the data.

  python -m experiments.own_images --workdir=/tmp/mine \\
      --config=experiments/configs/own_images.py:smoke \\
      --config.images=/path/to/folder
  python -m experiments.own_images --workdir=/tmp/mine --predict=new_photos/

--config.images is a folder with one subfolder per class (optionally
train/ and test/ folders of that shape, and val/, valid/ or validation/
beside them as the validation split), a .npz file (x_train, y_train,
x_test, y_test, class_names) or tfds:NAME (read from --config.data_dir).
The images are decoded once into WORKDIR/image_cache at image_size x
image_size; the model's input shape, its number of classes and their names
come from the data.

Variants (joined with commas, e.g. :em,smoke):
  capsnet  Sabour et al.'s CapsNet with dynamic routing and its decoder
           (the default): Conv1 256 9x9, 32 primary capsule types, 16-D
           class capsules, 3 routing iterations, the paper's text form.
  su       Su's capsule model: a small convolutional trunk whose every
           position is a capsule, one transform shared by all of them
           (any image size, the same parameters).
  em       matrix capsules with EM routing (Hinton et al. 2018), the 68K
           model (A=64, B=8, C=D=16), capsjax's routing options.
  efficient  Efficient-CapsNet (Mazzia et al. 2021): four convolutions with
           batch normalisation, depthwise primary capsules, self-attention
           routing, its decoder; the authors' Adam (learning rate 5e-4,
           epsilon 1e-7) and loss (efficient_capsnet_mnist.py), the
           2-pixel shifts (their MNIST augmentation assumes digits on
           black). Images of at least 28x28.
  smoke    a small model of the family that trains on a 2-core CPU in a
           few minutes (600 steps, stopped after 150 s of training).
Any key can be overridden: ``--config.image_size=48``.
"""

from experiments.configs import common
from experiments.configs import matrix_capsnet_mnist

FAMILIES = ('capsnet', 'su', 'em', 'efficient')


def _capsnet(config):
  config.model = 'capsnet'
  config.model_options.num_iterations = 3
  config.model_options.reconstruction = True
  # The paper's text: squash(conv(x) + b), the margin loss summed over the
  # classes; the official code's form learns classification more slowly in
  # short runs (capsnet_mnist.py:smoke).
  config.model_options.form = 'text'
  config.loss_form = 'text'
  config.reconstruction_weight = 0.0005


def _su(config):
  """Su's model with his code's Adam (Keras' epsilon 1e-7, no decay)."""
  config.model = 'two_digit_capsnet'
  config.model_options.trunk_widths = (64, 64, 128, 128)
  config.model_options.capsule_dim = 16
  config.model_options.num_iterations = 3
  config.model_options.accumulate = False
  config.model_options.squash_constant = 0.5
  config.adam_epsilon = 1e-7
  config.lr_decay_rate = 1.0


def _em(config):
  matrix_capsnet_mnist.em_defaults(config)
  config.model_options.A = 64
  config.model_options.B = 8
  config.model_options.C = 16
  config.model_options.D = 16
  # > 0: train and evaluate on the central window of this size.
  config.center_crop = 0
  config.batch_size = 32


def _efficient(config):
  config.model = 'efficient_capsnet'
  config.model_options.reconstruction = True
  config.loss_form = 'text'
  config.reconstruction_weight = 0.0005
  config.learning_rate = 5e-4
  config.adam_epsilon = 1e-7


def _smoke(config, family):
  """A small model of ``family`` for a few minutes on a CPU; the CapsNet and
  Su's model with a higher, faster decaying learning rate for so short a
  run (as capsnet_mnist.py:smoke), the EM model as matrix_capsnet_mnist.py's
  smoke on 24x24 images."""
  config.num_train_steps = 600
  # A guard for slower machines: stop (and evaluate) after 150 s of
  # training steps.
  config.max_train_seconds = 150
  config.eval_every_steps = 300
  config.checkpoint_every_steps = 300
  config.log_every_steps = 50
  config.eval_batch_size = 250
  if family == 'capsnet':
    config.model_options.conv1_channels = 32
    config.model_options.primary_types = 8
    config.model_options.decoder_widths = (64, 128)
    config.batch_size = 64
    config.learning_rate = 2e-3
    config.lr_decay_steps = 100
    config.lr_decay_rate = 0.85
  elif family == 'efficient':
    # The whole model (1.6M parameters with its decoder at 32x32x3);
    # running averages that follow a short run (efficient_capsnet_mnist.py's
    # smoke).
    config.model_options.batch_norm_momentum = 0.9
    config.batch_size = 64
    config.learning_rate = 2e-3
    config.lr_decay_steps = 100
    config.lr_decay_rate = 0.85
  elif family == 'su':
    config.model_options.trunk_widths = (16, 16, 32, 32)
    config.model_options.capsule_dim = 8
    config.batch_size = 64
    config.learning_rate = 2e-3
  else:
    config.image_size = 24
    config.model_options.A = 32
    config.model_options.B = 4
    config.model_options.C = 8
    config.model_options.D = 8
    config.learning_rate = 1e-2
    config.lr_decay_steps = 100
    config.lr_decay_rate = 0.85
    config.margin_schedule = 'linear'
    config.margin_steps = 330


def get_config(variant: str = ''):
  config = common.base_config()
  config.shorter_run = common.smoke_run(
      'own_images.py:smoke', 'trains a small model in a few minutes')
  config.dataset = 'own_images'
  # Validation is a folder of the source (val/, valid/ or validation/
  # beside train/) or a fraction of the training images
  # (validation_fraction).
  del config['validation_size']
  # The images: a folder with one subfolder per class (optionally train/ and
  # test/ folders of that shape, and a val/, valid/ or validation/ folder),
  # a .npz file (x_train, y_train, x_test, y_test, class_names) or
  # tfds:NAME. Transparent images are composited onto white.
  config.images = ''
  # For tfds:NAME, TFDS's data_dir ('' its default, ~/tensorflow_datasets).
  config.data_dir = ''
  # Every image is resized to image_size x image_size: capsule layers grow
  # with the square of the side (32 or 48 suit them; 224 needs tens of GB).
  config.image_size = 32
  # 'center_crop' keeps the central square (the aspect ratio), 'stretch' the
  # whole image.
  config.resize_mode = 'center_crop'
  # 0: from the data (grey stays 1 channel, any colour image makes all RGB);
  # 1 or 3 converts every image.
  config.channels = 0
  # Held out as the test split when the source has none (per class, by
  # split_seed).
  config.test_fraction = 0.2
  # Of the training images, carved as the validation split (per class)
  # when the folder has no validation folder.
  config.validation_fraction = 0.1
  # The seed of the test and validation splits (the training seed is seed).
  config.split_seed = 0
  # Skip (and count) image files that cannot be decoded instead of stopping
  # (after all of them are named, one line each).
  config.skip_bad_images = False
  # Where decoded images are cached ('' : WORKDIR/image_cache).
  config.cache_dir = ''
  # Stop before training when the estimated memory exceeds what is free.
  config.memory_check = True
  # > 0: the memory (GB) the check assumes instead of what it detects.
  config.memory_limit_gb = 0.0
  # Set from the data (the folder names): index -> name, in config.json.
  config.class_names = ()
  # Set from the data: the number of classes.
  config.model_options.num_classes = 0
  config.max_shift = 2
  config.batch_size = 64
  config.num_train_steps = 5000
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  config.evals.per_class = dict(type='confusion', split='test')
  parts = [p for p in variant.split(',') if p]
  unknown = [p for p in parts if p not in FAMILIES + ('smoke',)]
  if unknown:
    raise ValueError(f'unknown variant {unknown[0]!r} of own_images; known: '
                     f'{", ".join(FAMILIES)}, smoke.')
  families = [p for p in parts if p in FAMILIES] or ['capsnet']
  if len(families) > 1:
    raise ValueError(f'own_images takes one family, got {families}.')
  family = families[0]
  {'capsnet': _capsnet, 'su': _su, 'em': _em,
   'efficient': _efficient}[family](config)
  if family in ('capsnet', 'em', 'efficient'):
    # Set from the data: (image_size, image_size, channels).
    config.model_options.input_shape = (0, 0, 0)
  else:
    # Set from the data: the images' channels (any size is read).
    config.model_options.input_channels = 0
  if 'smoke' in parts:
    _smoke(config, family)
  return config
