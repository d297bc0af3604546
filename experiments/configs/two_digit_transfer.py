"""Su's two-digit transfer test, Su's protocol.

From Su Jianlin's 2018 post 揭开迷雾，来一顿美味的Capsule盛宴
("Lifting the fog: a Capsule feast").

  python -m experiments.two_digit_transfer --workdir=/tmp/two_digit \\
      --config=experiments/configs/two_digit_transfer.py

Trains on single MNIST digits with Su's binary margin loss, then tests on
pairs of two different test digits in one image: stacked (56x28, as Su's
code joins them; ``evals.pairs``) and side by side (28x56, a harder
variant; ``evals.side_by_side``), the same trained models and the same pairs.

Su's training (bojone/Capsule, capsule_test.py): batch 128, Adam at Keras'
defaults (lr 1e-3, epsilon 1e-7, no decay), Keras initialisers (the models'
default ``kernel_init='glorot_uniform'``), no augmentation, 10 epochs for the
capsule model and 20 for the baseline, the last weights. Here the training
digits are the first 55,000 (Su used all 60,000): the last 5,000 are a
validation split that is only watched (``select_on_validation = False``:
the last weights are tested), and that chose the capsule model's default
routing. The pairs are all those of the test split (about 9,000), drawn
with seed 0 whatever the training seed.

Keys beyond ``common.base_config``:
  models      the runs to train and test, in order (names in ``runs``).
  runs.<name> model: the registry name; num_epochs over the training
              split (num_train_steps > 0 instead gives the steps);
              model_options: merged over ``model_options`` (the trunk).
  evals.pairs, evals.side_by_side  the two tests
              (``capsjax.evaluators.two_digit_transfer``): num_pairs (0: all),
              seed of the pairs, confidence_threshold (accuracy 2 needs
              both top scores above it, 0.5), layout.
  figure_pairs  pairs drawn in WORKDIR/pairs.png and pairs_side_by_side.png.

Runs: 'two_digit_baseline' (trunk + global average pool + Dense 128 + Dense
10 sigmoid), 'two_digit_capsnet' (trunk + shared capsules, 3 iterations of
Su's later routing: agreement with s / |s|), and
'two_digit_capsnet_blog_routing' (his blog's routing: agreement with
squash(s)). More seeds of one run:
  --config.seed=1 --config.models="('two_digit_capsnet',)"

Variants: smoke (tiny trunks, 20 steps, 200 pairs: seconds on a CPU; CI).
"""

import ml_collections

from experiments.configs import common

_CAPSULES = {'capsule_dim': 16, 'num_iterations': 3, 'accumulate': False,
             'squash_constant': 0.5}


def get_config(variant: str = ''):
  config = common.base_config()
  config.shorter_run = common.smoke_run('two_digit_transfer.py:smoke')
  config.dataset = 'mnist'
  # Which of ``runs`` to train, in order.
  config.models = ('two_digit_baseline', 'two_digit_capsnet',
                   'two_digit_capsnet_blog_routing')
  config.model = ''  # set per run by the experiment
  # The convolution widths of the shared trunk of both models.
  config.model_options.trunk_widths = (64, 64, 128, 128)
  # Per model: its registry name, num_epochs over the training split (or
  # num_train_steps when > 0) and model options.
  config.runs = ml_collections.ConfigDict({
      'two_digit_baseline': {
          'model': 'two_digit_baseline', 'num_epochs': 20,
          'num_train_steps': 0, 'model_options': {'hidden_width': 128}},
      'two_digit_capsnet': {
          'model': 'two_digit_capsnet', 'num_epochs': 10,
          'num_train_steps': 0,
          'model_options': dict(_CAPSULES, normalize_agreement=True)},
      'two_digit_capsnet_blog_routing': {
          'model': 'two_digit_capsnet', 'num_epochs': 10,
          'num_train_steps': 0,
          'model_options': dict(_CAPSULES, normalize_agreement=False)},
  })
  config.reconstruction_weight = 0.0
  config.max_shift = 0
  config.batch_size = 128
  config.num_train_steps = 0  # set per run from runs.<name>
  config.learning_rate = 1e-3
  config.lr_decay_rate = 1.0
  config.adam_epsilon = 1e-7
  config.select_on_validation = False
  config.log_every_steps = 50
  config.eval_every_steps = 430  # about an epoch of 55,000 digits
  config.checkpoint_every_steps = 430
  pairs = dict(type='two_digit_transfer', num_pairs=0, seed=0,
               confidence_threshold=0.5)
  config.evals.pairs = dict(pairs, layout='stacked')
  config.evals.side_by_side = dict(pairs, layout='side_by_side')
  # Pairs drawn in each model's figure.
  config.figure_pairs = 8
  for part in filter(None, variant.split(',')):
    if part == 'smoke':
      config.model_options.trunk_widths = (4, 4, 8, 8)
      config.runs.two_digit_baseline.model_options.hidden_width = 8
      for name in ('two_digit_capsnet', 'two_digit_capsnet_blog_routing'):
        config.runs[name].model_options.capsule_dim = 4
      for run in config.runs.values():
        run.num_train_steps = 20
      config.validation_size = 500
      config.batch_size = 32
      config.log_every_steps = 10
      config.eval_every_steps = 20
      config.checkpoint_every_steps = 20
      config.eval_batch_size = 100
      config.evals.pairs.num_pairs = 200
      config.evals.side_by_side.num_pairs = 200
    else:
      raise ValueError(f'unknown variant {part!r} of two_digit_transfer; '
                       f'known: smoke.')
  return config
