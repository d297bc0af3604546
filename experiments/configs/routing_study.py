"""Does routing matter? Every routing on one backbone (docs/routing_study.md).

  python -m experiments.routing_study --workdir=/scratch/routing_study
  python -m experiments.routing_study --workdir=/tmp/routing_study_smoke \\
      --config=experiments/configs/routing_study.py:smoke

The study trains ``routing_study_net`` (capsjax/study.py: Su's stem, primary
capsules and one capsule head, transforms shared across positions) with
each of ``heads``, ``num_seeds`` seeds each (0, 1, ...), on each of
``datasets``: one run per (dataset, seed, head), each in its own directory
and resumable, then measures each head's cost. Every run is this config
with its head, seed and dataset, so one of them alone is

  python -m experiments.train --workdir=/tmp/routing_su \\
      --config=experiments/configs/routing_study.py \\
      --config.model_options.head=su --config.seed=1

The protocol, the same for every head: batch 64, Adam at 1e-3 decaying
exponentially to 1e-4 at the last step, shifts of up to 2 pixels (no
other augmentation: no rotation, shear or scale), the last 5,000 training
images held out, the model selected on them (a validation every 500
steps), the test set read once by that model. Then the tests of
``evals``: the MNIST test digits placed at random on 40x40 canvases,
untransformed (``translated``: what the larger canvas alone costs a model
trained on 28x28), the same digits affine-transformed on 40x40 canvases
(``affine``), Su's stacked pairs of test digits, 56x28, top-2 against both
labels (``pairs``), and BIM at epsilon 0.1 (``bim``: 10 steps of 0.02 on
the first 1,000 test images, softmax cross-entropy on the log-odds of the
class scores for every head).

Keys beyond ``common.base_config``:
  heads       the capsule heads (capsjax.study.HEADS), in the order run.
  num_seeds   random seeds per head and dataset: 0 .. num_seeds - 1.
  datasets    'mnist' (every test) and 'fashion_mnist' (test error and
              BIM: the canvas, affine and pair tests are MNIST digits).
  cost_steps  timed train steps of each head's cost measurement
              (experiments.benchmark at this batch size, after 3 untimed).

Variants: smoke (a tiny stem, 2 heads, 1 seed, 20 steps, small tests: a
few minutes on a 2-core CPU; CI), fashion_mnist (a run on Fashion-MNIST,
its tests those that apply; the study adds it for its Fashion-MNIST runs).
"""

import ml_collections

from experiments.configs import common

HEADS = ('dynamic_1', 'dynamic_3', 'su', 'em', 'self_attention',
         'inverted_dot_product', 'self_routing', 'uniform')
BIM_EPSILON = 0.1


def _smoke(config: ml_collections.ConfigDict) -> None:
  config.heads = ('dynamic_3', 'uniform')
  config.num_seeds = 1
  config.datasets = ('mnist',)
  config.cost_steps = 3
  config.model_options.stem_widths = (8, 8, 16, 16)
  config.model_options.primary_types = 4
  config.model_options.capsule_dim = 8
  config.batch_size = 32
  config.num_train_steps = 20
  config.validation_size = 500
  config.eval_batch_size = 250
  config.log_every_steps = 10
  config.eval_every_steps = 20
  config.checkpoint_every_steps = 10
  config.evals.translated.size = 250
  config.evals.affine.size = 250
  config.evals.pairs.num_pairs = 250
  config.evals.bim.num_examples = 50
  config.evals.bim.bim_steps = 3


def _fashion_mnist(config: ml_collections.ConfigDict) -> None:
  config.dataset = 'fashion_mnist'
  # Tests on MNIST digits.
  del config.evals['translated']
  del config.evals['affine']
  del config.evals['pairs']


def get_config(variant: str = ''):
  config = common.base_config()
  config.shorter_run = common.smoke_run('routing_study.py:smoke')
  # The study's runs: every head, seed and dataset.
  config.heads = HEADS
  # Random seeds per head and data set: 0 .. num_seeds - 1.
  config.num_seeds = 3
  # 'mnist' (every test) and 'fashion_mnist' (test error and BIM).
  config.datasets = ('mnist', 'fashion_mnist')
  # Timed train steps of each head's cost measurement.
  config.cost_steps = 30
  config.dataset = 'mnist'
  config.model = 'routing_study_net'
  # The capsule head (capsjax.study.HEADS); the study sets it per run.
  config.model_options.head = 'dynamic_3'
  config.model_options.stem_widths = (32, 32, 64, 64)
  config.model_options.primary_types = 8
  config.model_options.capsule_dim = 16
  config.loss_form = 'text'
  config.reconstruction_weight = 0.0
  config.batch_size = 64
  config.num_train_steps = 4000
  config.learning_rate = 1e-3
  # 1e-3 * 0.1^(step / num_train_steps): 1e-4 at the last step, however
  # many steps a run is given.
  config.lr_decay_steps = config.get_ref('num_train_steps')
  config.lr_decay_rate = 0.1
  config.max_shift = 2
  config.validation_size = 5000
  config.log_every_steps = 100
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  config.evals.translated = dict(type='affine', source='translated_mnist',
                                 size=10_000, seed=0)
  config.evals.affine = dict(type='affine', source='affine_mnist',
                             size=10_000, seed=0)
  config.evals.pairs = dict(type='two_digit_transfer', num_pairs=0, seed=0,
                            layout='stacked')
  config.evals.bim = dict(type='adversarial', attacks=('bim',),
                          epsilons=(BIM_EPSILON,), loss='cross_entropy',
                          bim_step_size=0.02, bim_steps=10,
                          num_examples=1000, batch_size=100)
  for part in filter(None, variant.split(',')):
    if part == 'smoke':
      _smoke(config)
    elif part == 'fashion_mnist':
      _fashion_mnist(config)
    else:
      raise ValueError(f'unknown variant {part!r} of routing_study; known: '
                       f'smoke, fashion_mnist.')
  return config
