"""Defaults shared by every experiment config (the single source of them)."""

import ml_collections


def base_config() -> ml_collections.ConfigDict:
  """Keys every training run reads; each experiment config overrides some."""
  config = ml_collections.ConfigDict()
  # The data: 'mnist', 'fashion_mnist', 'smallnorb', 'cifar10', 'svhn',
  # 'multimnist' or 'own_images' (capsjax.data.load_dataset).
  config.dataset = 'mnist'
  # Directory holding the dataset's files; '' searches $CAPSJAX_DATA_DIR, then
  # ../shared/data/<dataset>, then TFDS.
  config.data_dir = ''
  # Images held out of the end of the training split to select the model on.
  config.validation_size = 5000
  # The model's registry name (capsjax.models.list_models()), or a model
  # class of yours as 'module:Class' (docs/own_model.md).
  config.model = 'capsnet'
  # Keyword options of that model (capsjax.models.model_options(name)).
  config.model_options = ml_collections.ConfigDict()
  # How the CapsNet margin loss reduces over the classes (losses.margin_loss):
  # 'text' sums them (the paper's text), 'official' takes half their mean
  # (the official code: 1/20 of the sum for 10 classes).
  config.loss_form = 'text'
  # Seeds the parameters, the batch order and the augmentation.
  config.seed = 0
  # Training images per step (split over the devices).
  config.batch_size = 128
  # Images per evaluation batch (no effect on the numbers).
  config.eval_batch_size = 500
  # Training steps in all (a rerun with more continues).
  config.num_train_steps = 10_000
  # Adam's learning rate at step 0.
  config.learning_rate = 1e-3
  # The rate is multiplied by lr_decay_rate every lr_decay_steps steps,
  # continuously (tf.train.exponential_decay).
  config.lr_decay_steps = 2000
  # See lr_decay_steps.
  config.lr_decay_rate = 0.96
  # True: the decay in whole periods (floor(step / lr_decay_steps), a decay
  # per epoch as Keras' LearningRateScheduler).
  config.lr_staircase = False
  # The rate never falls below this (0: no floor).
  config.min_learning_rate = 0.0
  # Adam's epsilon: optax's 1e-8 (TF's and Keras' is 1e-7).
  config.adam_epsilon = 1e-8
  # 'paper': Adam's Algorithm 1 (optax, PyTorch), epsilon added to
  # sqrt(v_hat); 'tensorflow': TF's and Keras' Adam, epsilon added to sqrt(v)
  # before the bias correction (31.6x larger in effect at the first step).
  config.adam_form = 'paper'
  # Training images are shifted by up to this many pixels in each
  # direction, zero-padded (the papers' MNIST augmentation; 0: none).
  config.max_shift = 2
  # The dynamic-routing family's other training augmentation:
  # 'efficient_capsnet' (Efficient-CapsNet's rotation, shift, squeeze and
  # erase, data.efficient_capsnet_augment) or '' (none).
  config.augment = ''
  # Steps between metric lines (metrics.jsonl, TensorBoard, the bar).
  config.log_every_steps = 100
  # Steps between validations (the model is selected on them).
  config.eval_every_steps = 1000
  # Steps between checkpoints (see also checkpoint_every_seconds).
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
  return config


def smoke_run(config_spec: str, what: str = 'runs a reduced model end to '
              'end in a few minutes') -> str:
  """The ``shorter_run`` hint: ``config_spec`` is FILE:VARIANTS in configs/."""
  return f'--config=experiments/configs/{config_spec} {what}.'


def short_schedule(config) -> None:
  """The :smoke training schedule of the section-7 CapsNet configs: 200
  steps of batch 32 at a higher, faster-decaying learning rate, a 280 s
  guard, an evaluation and a checkpoint every 100 steps."""
  config.batch_size = 32
  config.num_train_steps = 200
  config.learning_rate = 2e-3
  config.lr_decay_steps = 100
  config.lr_decay_rate = 0.8
  config.max_train_seconds = 280
  config.eval_every_steps = 100
  config.checkpoint_every_steps = 100
  config.log_every_steps = 20
