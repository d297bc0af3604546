"""Su's two-digit transfer test (seed 004; SPEC section 3).

  python -m experiments.two_digit_transfer --workdir=/tmp/two_digit \\
      --config=experiments/configs/two_digit_transfer.py

Trains 'two_digit_baseline' (trunk + global average pool + Dense 128 + Dense
10 sigmoid) and 'two_digit_capsnet' (trunk + shared-weight capsules, 3
routing iterations) on single MNIST digits with Su's binary margin loss, then
tests both on pairs of different test digits side by side (28x56).

Su's training, as far as the seed gives it: Adam at Keras' default learning
rate 1e-3 without decay, no augmentation (``max_shift = 0``). The seed does
not say how long; 1,720 steps of batch 64 is two epochs of the 55,000
training digits (the last 5,000 are the validation split).

Keys beyond ``common.base_config``:
  models                which models to train and test, in order.
  model_options         options both models take (the trunk widths).
  head_options.<model>  options of one model only.
  evals.pairs           the test (``capsjax.evaluators.two_digit_pairs``):
                        num_pairs, the first N pairs (0: all, about
                        9,000); confidence_threshold, accuracy 2 needs both
                        top scores above it (0.5).
  figure_pairs          pairs drawn in WORKDIR/pairs.png.
The pairs are drawn with ``seed``, the seed of the training runs too.

Variants: smoke (tiny trunks, 20 steps, 200 pairs: seconds on a CPU; CI).
"""

import ml_collections

from experiments.configs import common


def get_config(variant: str = ''):
  config = common.base_config()
  config.dataset = 'mnist'
  config.models = ('two_digit_baseline', 'two_digit_capsnet')
  config.model = ''  # set per model by the experiment
  config.model_options.trunk_widths = (64, 64, 128, 128)
  config.head_options = ml_collections.ConfigDict({
      'two_digit_baseline': {'hidden_width': 128},
      'two_digit_capsnet': {'capsule_dim': 16, 'num_iterations': 3},
  })
  config.reconstruction_weight = 0.0
  config.max_shift = 0
  config.batch_size = 64
  config.num_train_steps = 1720
  config.learning_rate = 1e-3
  config.lr_decay_rate = 1.0
  config.log_every_steps = 50
  config.eval_every_steps = 430
  config.checkpoint_every_steps = 430
  config.evals.pairs = dict(type='two_digit_pairs', num_pairs=0,
                            confidence_threshold=0.5)
  config.figure_pairs = 8
  for part in filter(None, variant.split(',')):
    if part == 'smoke':
      config.model_options.trunk_widths = (4, 4, 8, 8)
      config.head_options.two_digit_baseline.hidden_width = 8
      config.head_options.two_digit_capsnet.capsule_dim = 4
      config.validation_size = 500
      config.batch_size = 32
      config.num_train_steps = 20
      config.log_every_steps = 10
      config.eval_every_steps = 20
      config.checkpoint_every_steps = 20
      config.eval_batch_size = 100
      config.evals.pairs.num_pairs = 200
    else:
      raise ValueError(f'unknown variant {part!r} of two_digit_transfer; '
                       f'known: smoke.')
  return config
