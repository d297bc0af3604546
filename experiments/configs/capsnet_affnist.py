"""affNIST generalisation (Sabour et al. 2017, section 5.2): CapsNet vs a CNN.

  python -m experiments.affnist --workdir=/tmp/affnist \\
      --config=experiments/configs/capsnet_affnist.py \\
      [--config.affnist_dir=/path/to/affNIST]

Both models train on MNIST digits placed at a uniformly random position on a
black 40x40 canvas (no other augmentation) and never see an affine
transform. The CapsNet trains first (WORKDIR/capsnet); the CNN
(WORKDIR/baseline_cnn) then stops at the first validation evaluation at or
above the CapsNet's best validation accuracy on expanded (40x40) MNIST
(``match_capsnet``; the paper matched the two on the expanded test set, we
match on validation so that the test set stays unseen). Both are tested on
the expanded MNIST test set, on ``affine_test_size`` MNIST test digits
transformed by the affNIST recipe (``capsjax.data.affine_mnist``, seed
``affine_seed``) and, when ``affnist_dir`` is given, on the real affNIST
test set (320,000 images).

Top-level keys: data_dir (MNIST; copied into both runs), affnist_dir,
affine_test_size, affine_seed, match_capsnet, num_figure_examples. The
training configs are ``capsnet`` and ``baseline`` (every key of
common.base_config; override as ``--config.capsnet.num_train_steps=...``).

Variants (comma-separated):
  paper  the default: the MNIST CapsNet on 40x40 (13.5M parameters) and
         the baseline CNN layout with conv 256-256-48, VALID padding (14.4M,
         "a similar number of parameters"); 50k steps of batch 128 each (the
         paper gives no step count).
  cpu    reduced widths (CapsNet conv1 32, 8 primary types, decoder 64-128:
         1.9M; CNN conv 32-32-16, FC 64-32, SAME: 1.7M) for runs on a CPU.
  smoke  tiny models, 40 steps each: the end-to-end check CI runs.
"""

import ml_collections

from experiments.configs import common


def training_config(model: str) -> ml_collections.ConfigDict:
  """One model's training on MNIST digits placed at random on 40x40."""
  config = common.base_config()
  config.shorter_run = common.smoke_run('capsnet_affnist.py:smoke')
  config.dataset = 'mnist'
  config.model = model
  # Random placement on the canvas replaces the +-2 pixel shift.
  config.max_shift = 0
  # Training digits are placed at random on a black canvas of this side.
  config.canvas_size = 40
  # Key of the fixed placements of the validation (this seed) and test (this
  # seed + 1) digits.
  config.eval_set_seed = 0
  config.num_train_steps = 50_000
  config.model_options.input_shape = (40, 40, 1)
  if model == 'capsnet':
    config.model_options.num_iterations = 3
    config.model_options.reconstruction = True
    config.reconstruction_weight = 0.0005
  else:
    config.model_options.conv_channels = (256, 256, 48)
    config.model_options.padding = 'VALID'
    config.reconstruction_weight = 0.0
  return config


def get_config(variant: str = ''):
  parts = list(filter(None, variant.split(',')))
  unknown = sorted(set(parts) - {'paper', 'cpu', 'smoke'})
  if unknown:
    raise ValueError(f'unknown variant {unknown[0]!r} of capsnet_affnist; '
                     f'known: paper, cpu, smoke.')
  config = ml_collections.ConfigDict()
  # MNIST directory ('' searches as usual); copied into both runs.
  config.data_dir = ''
  # Directory (or file) of the affNIST release; '' skips the real test set.
  config.affnist_dir = ''
  # MNIST test digits transformed by the affNIST recipe for the test.
  config.affine_test_size = 10_000
  # Key of those transformations.
  config.affine_seed = 0
  # The CNN stops at the first validation accuracy >= the CapsNet's best.
  config.match_capsnet = True
  # Transformed test digits drawn in WORKDIR/affnist_examples.png.
  config.num_figure_examples = 12
  config.capsnet = training_config('capsnet')
  config.baseline = training_config('baseline_cnn')
  if 'cpu' in parts:
    config.capsnet.model_options.conv1_channels = 32
    config.capsnet.model_options.primary_types = 8
    config.capsnet.model_options.decoder_widths = (64, 128)
    config.baseline.model_options.conv_channels = (32, 32, 16)
    config.baseline.model_options.fc_widths = (64, 32)
    config.baseline.model_options.padding = 'SAME'
    for run in (config.capsnet, config.baseline):
      run.eval_every_steps = 250
      run.checkpoint_every_steps = 500
      run.log_every_steps = 50
  if 'smoke' in parts:
    config.capsnet.model_options.conv1_channels = 16
    config.capsnet.model_options.primary_types = 4
    config.capsnet.model_options.decoder_widths = (32, 64)
    config.baseline.model_options.conv_channels = (8, 8, 4)
    config.baseline.model_options.fc_widths = (16, 8)
    config.affine_test_size = 500
    config.num_figure_examples = 6
    for run in (config.capsnet, config.baseline):
      run.batch_size = 32
      run.num_train_steps = 40
      run.validation_size = 500
      run.eval_batch_size = 250
      run.eval_every_steps = 20
      run.checkpoint_every_steps = 20
      run.log_every_steps = 10
  return config
