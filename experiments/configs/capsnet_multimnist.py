"""CapsNet (Sabour et al. 2017, section 6) on MultiMNIST, and its baseline.

  python -m experiments.multimnist --workdir=/tmp/capsnet_multimnist \\
      --config=experiments/configs/capsnet_multimnist.py

Each training image overlays two MNIST training digits of different classes,
each shifted by up to 4 pixels, on a 36x36 canvas, drawn on device inside the
training step (``capsjax.data.multimnist_batch``) from the training split
minus its last ``validation_size`` digits. Validation: ``validation_pairs``
fixed pairs of those validation digits; test: ``test_pairs`` fixed pairs of
MNIST test digits (both fixed by ``eval_set_seed``, whatever ``seed``).
Both labels are targets; the decoder reconstructs each digit from its own
capsule (summed reconstruction error, each against its own digit). An
example is correct when the two highest scores are the two true classes.

Variants (``--config=...capsnet_multimnist.py:VARIANT``, comma-separated):
  paper     the default: the MNIST CapsNet on 36x36 inputs (11.36M
            parameters, as the paper's), batch 128. The step count and the
            set sizes are ours: 100k steps, 10k validation pairs, 100k test
            pairs (10 per test digit).
  baseline  the baseline CNN (the MNIST layout with VALID padding, 26.7M
            parameters on 36x36) with sigmoid outputs, trained with sigmoid
            cross-entropy on both labels; top-2 logits decide.
  cpu       reduced widths (conv1 32, 8 primary types, decoder 64-128; the
            baseline conv 32-32-16, FC 64-32) for runs on a CPU.
  smoke     tiny widths and 40 steps: the end-to-end check CI runs.
"""

from experiments.configs import common


def get_config(variant: str = ''):
  parts = list(filter(None, variant.split(',')))
  unknown = sorted(set(parts) - {'paper', 'baseline', 'cpu', 'smoke'})
  if unknown:
    raise ValueError(f'unknown variant {unknown[0]!r} of capsnet_multimnist; '
                     f'known: paper, baseline, cpu, smoke.')
  baseline = 'baseline' in parts
  config = common.base_config()
  config.shorter_run = common.smoke_run('capsnet_multimnist.py:smoke')
  config.dataset = 'multimnist'
  config.model_options.input_shape = (36, 36, 1)
  if baseline:
    config.model = 'baseline_cnn'
    config.model_options.padding = 'VALID'
    config.reconstruction_weight = 0.0
  else:
    config.model = 'capsnet'
    config.model_options.num_iterations = 3
    config.model_options.reconstruction = True
    config.reconstruction_weight = 0.0005
  # The MultiMNIST shift of each digit (the only augmentation).
  config.max_shift = 4
  config.num_train_steps = 100_000
  # Fixed overlaid pairs of the validation digits, to select on.
  config.validation_pairs = 10_000
  # Fixed overlaid pairs of the test digits, the test set.
  config.test_pairs = 100_000
  # Key of the fixed validation (this seed) and test (this seed + 1) pairs.
  config.eval_set_seed = 0
  if not baseline:  # the paper's Fig. 5: WORKDIR/multimnist_reconstructions.png
    config.evals.reconstructions = dict(type='multimnist_figure',
                                        num_examples=8)
  if 'cpu' in parts:
    if baseline:
      config.model_options.conv_channels = (32, 32, 16)
      config.model_options.fc_widths = (64, 32)
    else:
      config.model_options.conv1_channels = 32
      config.model_options.primary_types = 8
      config.model_options.decoder_widths = (64, 128)
    config.validation_pairs = 2000
    config.test_pairs = 10_000
    config.eval_every_steps = 500
    config.checkpoint_every_steps = 500
    config.log_every_steps = 50
  if 'smoke' in parts:
    if baseline:
      config.model_options.conv_channels = (8, 8, 4)
      config.model_options.fc_widths = (16, 8)
    else:
      config.model_options.conv1_channels = 16
      config.model_options.primary_types = 4
      config.model_options.decoder_widths = (32, 64)
    config.batch_size = 32
    config.num_train_steps = 40
    config.validation_size = 1000
    config.validation_pairs = 200
    config.test_pairs = 200
    config.eval_batch_size = 200
    config.eval_every_steps = 20
    config.checkpoint_every_steps = 20
    config.log_every_steps = 10
    if not baseline:
      config.evals.reconstructions.num_examples = 4
  return config
