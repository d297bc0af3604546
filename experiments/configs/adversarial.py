"""White-box FGSM and BIM against trained models (Hinton et al. 2018, sec. 6).

  python -m experiments.adversarial --workdir=/tmp/adversarial \\
      --models=/tmp/capsnet,/tmp/cnn,/tmp/em \\
      --config=experiments/configs/adversarial.py

Keys:
  epsilons       L-infinity budgets, pixels in [0, 1].
  attacks        'fgsm' and/or 'bim'.
  bim_step_size  BIM's step (pixels in [0, 1]); bim_steps its iterations.
                 The defaults, 20 steps of 0.02, reach 0.4 > the largest
                 epsilon, so BIM can use the whole ball.
  loss           the loss the attacker climbs: 'family' (each model's own
                 training loss: margin loss for CapsNet, cross-entropy for the
                 CNN, spread loss at its final margin for EM models) or
                 'cross_entropy' (softmax cross-entropy over logits or the
                 log-odds of the class scores, for every model).
  num_examples   attack the first N test images (0: all 10,000).
  batch_size     images per attack batch.
  data_dir       dataset directory of the attacks and of the models it
                 trains ('' : each run's own, then the usual search).
  train          training configs by name, trained into WORKDIR/train/<name>
                 before the attack (empty: attack --models only).

Variants: small (attacks 50 images at 3 epsilons with 3 BIM steps: the
reproduction suite's smoke size), smoke (small, on a tiny CapsNet and
baseline CNN it trains for 10 steps itself: CI runs it); smoke,em adds a tiny EM
model to the ones it trains (a minute more of XLA compilation).
"""

import ml_collections

from experiments.configs import baseline_cnn_mnist
from experiments.configs import capsnet_mnist
from experiments.configs import matrix_capsnet_mnist


def _tiny(config, **model_options):
  """A training config cut to a few steps: the attack, not accuracy, counts."""
  config.num_train_steps = 10
  config.batch_size = 16
  config.validation_size = 100
  config.eval_every_steps = 10
  config.checkpoint_every_steps = 10
  config.log_every_steps = 5
  config.model_options.update(model_options)
  return config


def get_config(variant: str = ''):
  config = ml_collections.ConfigDict()
  # L-infinity budgets of the attacks, in pixel units of [0, 1].
  config.epsilons = (0.0, 0.05, 0.1, 0.2, 0.3)
  # Which attacks: 'fgsm' (one step) and 'bim' (iterated).
  config.attacks = ('fgsm', 'bim')
  # BIM's step, in pixel units.
  config.bim_step_size = 0.02
  # BIM's number of steps.
  config.bim_steps = 20
  # The loss the attacks ascend: 'family' (each model's own training loss)
  # or 'cross_entropy' (on its class scores).
  config.loss = 'family'
  # Test images attacked.
  config.num_examples = 1000
  config.batch_size = 100
  config.data_dir = ''
  # Models to train first when no --models are given (name -> config).
  config.train = ml_collections.ConfigDict()
  for part in filter(None, variant.split(',')):
    if part in ('smoke', 'small'):
      config.epsilons = (0.0, 0.1, 0.3)
      config.bim_steps = 3
      config.bim_step_size = 0.1
      config.num_examples = 50
      config.batch_size = 50
    if part == 'smoke':
      config.train.capsnet = _tiny(
          capsnet_mnist.get_config('smoke'), conv1_channels=8,
          primary_types=4, decoder_widths=(16, 32))
      config.train.baseline_cnn = _tiny(
          baseline_cnn_mnist.get_config('smoke'), conv_channels=(8, 8, 4),
          fc_widths=(16, 8))
    elif part == 'small':
      pass
    elif part == 'em':
      # Adds a tiny EM model to what is trained (its XLA compilation alone
      # takes about a minute on a CPU, so CI's smoke leaves it out).
      # Whole 28x28 digits (no centre crop), so that every model is
      # attacked on the same pixels.
      em = matrix_capsnet_mnist.get_config('smoke')
      em.center_crop = 0
      config.train.matrix_capsnet = _tiny(em, A=8, B=4, C=4, D=4,
                                          input_shape=(28, 28, 1))
    else:
      raise ValueError(f'unknown variant {part!r} of adversarial; known: '
                       f'smoke, small, em.')
  return config
