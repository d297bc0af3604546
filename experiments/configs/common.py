"""Defaults shared by every experiment config (the single source of them)."""

import ml_collections


def base_config() -> ml_collections.ConfigDict:
  """Keys every training run reads; each experiment config overrides some."""
  config = ml_collections.ConfigDict()
  config.dataset = 'mnist'
  # Directory holding the dataset's files; '' searches $CAPSJAX_DATA_DIR, then
  # ../shared/data/<dataset>, then TFDS.
  config.data_dir = ''
  config.validation_size = 5000
  config.model = 'capsnet'
  config.model_options = ml_collections.ConfigDict()
  # How the CapsNet margin loss reduces over the classes (losses.margin_loss):
  # 'text' sums them (the paper's text), 'official' takes half their mean
  # (the official code: 1/20 of the sum for 10 classes).
  config.loss_form = 'text'
  config.seed = 0
  config.batch_size = 128
  config.eval_batch_size = 500
  config.num_train_steps = 10_000
  config.learning_rate = 1e-3
  config.lr_decay_steps = 2000
  config.lr_decay_rate = 0.96
  # Adam's epsilon: optax's 1e-8 (TF's and Keras' is 1e-7).
  config.adam_epsilon = 1e-8
  config.max_shift = 2
  config.log_every_steps = 100
  config.eval_every_steps = 1000
  config.checkpoint_every_steps = 1000
  # Also save a checkpoint after this many seconds since the last one (0:
  # by steps only), so that a stop loses at most this much training.
  config.checkpoint_every_seconds = 600.0
  # Said with the time estimate when a run is long: a command that shows
  # the same thing sooner (usually the config's :smoke variant).
  config.shorter_run = ''
  # Test the state of the best validation accuracy (True) or the last one
  # (False: validation is then only watched, as in Su's protocol).
  config.select_on_validation = True
  # Stop early after this many seconds of training steps (compilation,
  # evaluation and checkpoints not counted; 0: no limit).
  config.max_train_seconds = 0.0
  # Number of local devices for data parallelism (0: all of them; must be 0
  # with --distributed, whose mesh spans every process's devices).
  config.num_devices = 0
  # 'bfloat16': mixed precision (bfloat16 layers on a copy of the float32
  # master weights; routing statistics, loss and update stay float32).
  config.compute_dtype = 'float32'
  # Evaluations of the selected model after the test set (name -> dict(type=
  # an evaluator of capsjax.evaluators, its options)), into summary['evals'].
  config.evals = ml_collections.ConfigDict()
  # A test hook: the training batch of this step is replaced by NaN images
  # (-1: off), to check that a poisoned batch stops the run cleanly.
  config.debug_poison_step = -1
  return config


def smoke_run(config_spec: str, what: str = 'runs a reduced model end to '
              'end in a few minutes') -> str:
  """The ``shorter_run`` hint: ``config_spec`` is FILE:VARIANTS in configs/."""
  return f'--config=experiments/configs/{config_spec} {what}.'
