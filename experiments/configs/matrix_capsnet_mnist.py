"""Matrix capsules with EM routing (Hinton et al. 2018) on MNIST.

  python -m experiments.train --workdir=/tmp/em_mnist \\
      --config=experiments/configs/matrix_capsnet_mnist.py

Variants: smoke (a small model, A=32, B=4, C=D=8, two EM iterations, on the
central 24x24; the CI test's), fashion
(Fashion-MNIST), small (A=64, B=8, C=D=16, the 68K model), paper (the
paper's routing options instead of capsjax's; see em_defaults), authors
(the released code's routing options and training protocol; see
authors_routing and authors_protocol).
"""

import ml_collections
from ml_collections.config_dict import placeholder

from experiments.configs import common


def em_routing_overrides() -> ml_collections.ConfigDict:
  """A field of routing.EMRouting for each key, None (the preset's value)
  until set; typed, so that the command line can set them. A per-iteration
  inverse temperature is a tuple set in a config file."""
  return ml_collections.ConfigDict({
      'num_iterations': placeholder(int),
      'inverse_temperature': placeholder(float),
      'variance_epsilon': placeholder(float),
      'normalize_cost': placeholder(bool),
      'center_momentum': placeholder(float),
      'activation_form': placeholder(str),
      'released': placeholder(bool),
      'mass_epsilon': placeholder(float),
      'normalize_across_positions': placeholder(bool),
      'true_stride': placeholder(bool),
  })

def em_defaults(config):
  """The EM-model training defaults (the authors' optimiser and loss)."""
  config.model = 'matrix_capsnet'
  config.batch_size = 64
  config.learning_rate = 3e-3
  config.lr_decay_steps = 20_000
  config.lr_decay_rate = 0.96
  # The classification loss: 'spread' (Hinton et al. 2018, eq. 3).
  config.loss = 'spread'
  # 'authors': m = 0.2 + 0.79 sigmoid(min(10, step / margin_steps - 4));
  # 'linear': 0.2 -> 0.9 over margin_steps.
  config.margin_schedule = 'authors'
  # The authors' curve with its 50,000-step scale reaches 0.9 only after
  # about 300,000 steps; scaled to the configured training (it follows
  # --config.num_train_steps), it ends at 0.896: m(6 * scale) = 0.2 + 0.79
  # sigmoid(2).
  config.margin_steps = config.get_ref('num_train_steps') // 6
  # The L2 penalty's weight on every kernel and transform (the released
  # code's 2e-7; l2_form says which sum).
  config.weight_decay = 2e-7
  # How the spread loss reduces over the classes (losses.spread_loss):
  # 'sum' (the paper's eq. 3) or 'mean' (the released code's mean over the
  # classes: the sum / K, 1/10 on MNIST, 1/5 on smallNORB).
  config.spread_class_reduction = 'sum'
  # The L2 penalty times weight_decay (training.matrix_capsules.l2_penalty):
  # 'sum' of the squared weights, or 'half' of it (the released code's
  # tf.nn.l2_loss).
  config.l2_form = 'sum'
  # > 0: clip each gradient element to [-grad_clip, grad_clip] before Adam
  # (the released code: 200); 0: no clipping.
  config.grad_clip = 0.0
  # smallNORB: both images of each stereo pair as two channels (False: the
  # first only).
  config.stereo = True
  # smallNORB: '' the standard split; 'azimuth' or 'elevation' the
  # paper's novel-viewpoint experiments.
  config.viewpoint_split = ''
  config.model_options.coordinate_addition = True
  # What coordinate addition adds: 'grid', (h + 0.5) / H of the class
  # layer's grid, or 'authors', each position's receptive-field centre in
  # input pixels, centred and divided by 100 (the released code; the
  # paper's "scaled coordinate of the centre of the receptive field").
  # 'authors' on the smoke model: 95.98% mean validation accuracy over 2
  # seeds against 95.69% (results/em_mnist_routing_options).
  config.model_options.coordinate_form = 'authors'
  # The released code's primary capsules and coordinate order
  # (authors_routing sets them; models.MatrixCapsNet documents them).
  config.model_options.primary_form = 'paper'
  # The routing of every EM layer: a preset of routing.EM_ROUTING_PRESETS
  # ('paper', 'authors', 'released', 'capsjax'; docs/em_routing_options.md)
  # and the fields to change in it (each None: the preset's), e.g.
  # --config.model_options.em_routing_overrides.num_iterations=3. capsjax's
  # set (results/em_mnist_routing_options): the paper's lambda schedule
  # (0.01 (1 - 0.95^(t+1))) leaves every activation near sigmoid(0) at our
  # cost scale, so nothing learns; cost normalisation with lambda = 1 keeps
  # about half the capsules of every layer active at initialisation, and 3
  # iterations collapsed (training accuracy stuck at 10%) where 2 learned.
  # The rest is the paper's procedure with capsjax's variance floor (the
  # paper prints none); its conv-capsule E-step normalises each child's
  # assignments within each K x K window (normalize_across_positions, the
  # released code's form, gave 95.88% against 95.98% with the authors'
  # coordinates). The variants 'paper' and 'authors' name other presets.
  config.model_options.em_routing = 'capsjax'
  config.model_options.em_routing_overrides = em_routing_overrides()
  # How the convolution and the conv capsules' routing run
  # (capsjax.kernels): None (the fastest available: the fused CPU kernel
  # where it applies, else XLA), 'xla', 'native' or 'pallas'; a run may
  # resume with another.
  config.model_options.implementation = placeholder(str)
  # > 0: ConvCaps1's own number of iterations.
  config.model_options.caps1_iterations = 0
  # Transforms of std 1 keep the poses from shrinking to the variance floor
  # layer by layer (with capsjax's routing).
  config.model_options.transform_std = 1.0
  config.model_options.init = 'paper'
  # The class layer's lambda is this times the other layers' (released
  # code: 0.25).
  config.model_options.class_lambda_scale = 1.0
  return config


def paper_routing(config):
  """The paper's routing options (the preset 'paper': 3 iterations, its
  lambda schedule) and transforms of the default std."""
  config.model_options.em_routing = 'paper'
  config.model_options.transform_std = None
  return config


def authors_routing(config):
  """The released code's model and routing (google-research capsule_em).

  The routing preset 'released' (``routing.RELEASED_EM``: the paper's 3
  iterations and lambda schedule plus the released code's options) and
  the model options (``models.MatrixCapsNet`` documents them): its
  activation logit lambda (-mass (sum_h log var_h + 16 beta_u (log 2 pi +
  1)) - 5000 beta_a), final lambda / 4 in the class layer, mu = 0.9 new +
  0.1 old, the variance floor 0.0005, the mass padded by 1e-5 (class) /
  1e-7 (conv) and used in the mean, variance and logit, its conv E-step
  normaliser (each (child, parent type) over the windows covering the
  child, windows indexed as if the stride were 1), the primary activations
  sigmoid(logit - 1) without biases, the coordinates with the column on
  vote entry 0, and its TF truncated-normal initialisation (std 0.3 / 0.01,
  beta 0.5 / 1.0, 2.0, Conv1 0.05 with bias 0.1).
  """
  paper_routing(config)
  config.model_options.em_routing = 'released'
  config.model_options.class_lambda_scale = 0.25
  config.model_options.init = 'authors'
  config.model_options.primary_form = 'released'
  config.model_options.coordinate_form = 'released'
  return config


def authors_protocol(config):
  """The released code's training protocol (top-level keys only).

  Its flags' defaults and losses (experiment.py, model.py, layers.py,
  utils.py): Adam's learning rate 0.01 (decayed 0.96 per 20,000 steps, as
  em_defaults), every gradient element clipped to +-200, the margin
  0.2 + 0.79 sigmoid(min(10, step / 50,000 - 4)) on its own 50,000-step
  scale (0.24 at step 50,000, 0.9 near step 300,000), the spread loss
  averaged over the classes and the L2 penalty as tf.nn.l2_loss (half the
  sum of squares), weight 2e-7 on the same weights. Its max_steps is
  2,000,000 (set by the smallNORB config, not here).
  """
  config.learning_rate = 1e-2
  config.grad_clip = 200.0
  config.margin_schedule = 'authors'
  config.margin_steps = 50_000
  config.spread_class_reduction = 'mean'
  config.l2_form = 'half'
  return config


def get_config(variant: str = ''):
  config = em_defaults(common.base_config())
  config.shorter_run = common.smoke_run('matrix_capsnet_mnist.py:smoke')
  config.dataset = 'mnist'
  config.max_shift = 2
  config.model_options.input_shape = (28, 28, 1)
  # > 0: train and evaluate on the central window of this size (then
  # input_shape must be (center_crop, center_crop, 1)).
  config.center_crop = 0
  config.model_options.num_classes = 10
  config.num_train_steps = 50_000
  for part in filter(None, variant.split(',')):
    if part == 'smoke':
      # The CI test's model (tests/test_training_matrix_capsules.py): two EM
      # iterations in every layer (capsjax's routing: the E-step runs), 1500
      # steps of batch 32 in 70-73 s of training on an idle 2-core CPU (4
      # host devices): 96.52% test accuracy (96.98% validation), seed 1
      # 96.46% (96.84%); 96.81% at the current code (results/em_mnist_smoke).
      # 1035 steps gave 95.16% test (seed 1 94.91%, under the claim); with
      # the schedule unchanged the margin ends at 0.9 by step 825 and the
      # learning rate keeps decaying. So that CI's slower machine (its speed
      # varied 1.7x within an hour here) stays inside the 280 s guard:
      # - the central 24x24 of each digit: ConvCaps1 routes 4x4 windows
      #   instead of 5x5, ConvCaps2 2x2 instead of 3x3;
      # - B=4 primary types: ConvCaps1's routing is most of a step.
      # (One iteration, an M-step-only model, reached 96.50% in 690 steps at
      # 1.8-1.9x the images per second.) No shifts: they cost 6
      # points of validation accuracy at step 200 of such short runs.
      config.model_options.A = 32
      config.model_options.B = 4
      config.model_options.C = 8
      config.model_options.D = 8
      config.model_options.input_shape = (24, 24, 1)
      config.center_crop = 24
      config.num_train_steps = 1500
      # A guard for slower machines: stop (and evaluate) after 280 s of
      # training steps.
      config.max_train_seconds = 280.0
      config.max_shift = 0
      config.batch_size = 32
      config.learning_rate = 1e-2
      config.lr_decay_steps = 172
      config.lr_decay_rate = 0.85
      config.margin_schedule = 'linear'
      config.margin_steps = 825
      config.eval_every_steps = 345
      config.checkpoint_every_steps = 345
      config.log_every_steps = 50
    elif part == 'small':
      config.model_options.A = 64
      config.model_options.B = 8
      config.model_options.C = 16
      config.model_options.D = 16
    elif part == 'paper':
      paper_routing(config)
    elif part == 'authors':
      authors_routing(config)
      authors_protocol(config)
    elif part == 'fashion':
      config.dataset = 'fashion_mnist'
      config.shorter_run = common.smoke_run('matrix_capsnet_mnist.py:smoke,'
                                            'fashion')
    else:
      raise ValueError(f'unknown variant {part!r} of matrix_capsnet_mnist; '
                       f'known: smoke, small, paper, authors, fashion.')
  return config
