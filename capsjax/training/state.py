"""The train state, the optimiser, and one gradient step, shared by both families.

A family (``dynamic``, ``em``) writes its loss and calls ``gradient_step``
inside its own jitted train step; ``FamilySteps`` is what it hands ``fit``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from capsjax import data as data_lib
from capsjax import families
from capsjax import models
from capsjax.training.defaults import fill_defaults


class TrainState(NamedTuple):
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any  # nnx.State of nnx.Param
  model_state: Any  # nnx.State of everything else (dropout RNG counters)
  opt_state: Any
  # First step whose loss or gradient was non-finite (-1: none). Such a step
  # is not applied, so params stay the last good ones.
  nonfinite_step: jax.Array


# ----------------------------------------------------------------------------
# Optimiser.


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """lr * decay_rate^(step / decay_steps), as tf.train.exponential_decay;
  with ``config.lr_staircase`` the exponent is floor(step / decay_steps)
  (a decay per epoch, as Keras' LearningRateScheduler), and never below
  ``config.min_learning_rate`` (0: no floor)."""
  fill_defaults(config)
  return optax.exponential_decay(
      init_value=config.learning_rate,
      transition_steps=config.lr_decay_steps,
      decay_rate=config.lr_decay_rate,
      staircase=config.lr_staircase,
      end_value=config.min_learning_rate or None)


ADAM_FORMS = ('paper', 'tensorflow')


def scale_by_tensorflow_adam(b1: float = 0.9, b2: float = 0.999,
                             eps: float = 1e-8
                             ) -> optax.GradientTransformation:
  """Adam as TensorFlow's ApplyAdam kernel (tf.train.AdamOptimizer, Keras'
  Adam) computes it: m and v as the paper's, then at step t (from 1)

      update = sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)

  the paper's section-2 reordering with epsilon-hat: the bias correction
  scales the step, and eps is added to sqrt(v) before it, where Algorithm
  1 (optax.scale_by_adam, PyTorch) adds it to sqrt(v_hat). It equals
  Algorithm 1 with eps / sqrt(1 - b2^t): 31.6 eps at the first step, within
  1.07 eps after 2,000 (b2 = 0.999). Its state is optax's ScaleByAdamState,
  so checkpoints of either form have the same tree.
  """

  def init(params):
    return optax.ScaleByAdamState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(jnp.zeros_like, params),
        nu=jax.tree.map(jnp.zeros_like, params))

  def update(updates, state, params=None):
    del params
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g),
                      state.nu, updates)
    count = optax.safe_int32_increment(state.count)
    # float64 under jax_enable_x64, else float32 (TF: the variables' dtype).
    t = count.astype(jax.dtypes.canonicalize_dtype(jnp.float64))
    alpha = jnp.sqrt(1 - b2**t) / (1 - b1**t)
    updates = jax.tree.map(
        lambda m, v: (alpha * m / (jnp.sqrt(v) + eps)).astype(m.dtype), mu, nu)
    return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(init, update)


def make_optimizer(config: ml_collections.ConfigDict
                   ) -> optax.GradientTransformation:
  """Adam at ``learning_rate_schedule(config)`` with ``config.adam_epsilon``,
  in ``config.adam_form``: 'paper' (Algorithm 1, optax.adam) or
  'tensorflow' (``scale_by_tensorflow_adam``, the authors' codes')."""
  schedule = learning_rate_schedule(config)  # fills the config's defaults
  if config.adam_form == 'paper':
    return optax.adam(schedule, eps=config.adam_epsilon)
  if config.adam_form == 'tensorflow':
    return optax.chain(scale_by_tensorflow_adam(eps=config.adam_epsilon),
                       optax.scale_by_learning_rate(schedule))
  raise ValueError(f'config.adam_form must be one of {ADAM_FORMS}, got '
                   f'{config.adam_form!r}.')


# ----------------------------------------------------------------------------
# Model and state.


# Workdirs of earlier capsjax name the implementation by these keys and
# values; they read as ``implementation``.
EARLIER_IMPLEMENTATION_KEYS = ('routing_impl', 'conv_impl')
_EARLIER_IMPLEMENTATIONS = {'kernel': 'native', 'onednn': 'native',
                            'onednn_input_grad': 'native'}


def model_options(config: ml_collections.ConfigDict) -> dict[str, Any]:
  options = config.model_options.to_dict()
  earlier = {options.pop(key) for key in EARLIER_IMPLEMENTATION_KEYS
             if key in options} - {None}
  if earlier and options.get('implementation') is None:
    names = {_EARLIER_IMPLEMENTATIONS.get(name, name) for name in earlier}
    options['implementation'] = names.pop() if len(names) == 1 else None
  return {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}


def create_model(config: ml_collections.ConfigDict, seed: int | None = None
                 ) -> nnx.Module:
  seed = config.seed if seed is None else seed
  return models.create_model(
      config.model, rngs=nnx.Rngs(params=seed, dropout=seed + 1),
      **model_options(config))


def check_model(config: ml_collections.ConfigDict,
                input_shape: tuple[int, ...], num_classes: int | None
                ) -> None:
  """ValueError, one line, unless ``config.model`` builds from its options
  and, called as the train step calls it (a batch of 2 images of
  ``input_shape`` [H, W, C], int labels, ``train=True``), returns what its
  family's losses read (``Family.check_outputs``; ``num_classes`` K of the
  data when known). From shapes alone: nothing is computed."""
  family = families.of(config.model)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: create_model(config)))
  images = jax.ShapeDtypeStruct((2, *input_shape), jnp.float32)
  labels = jax.ShapeDtypeStruct((2,), jnp.int32)
  outputs = jax.eval_shape(
      lambda s, x, y: nnx.merge(graphdef, s)(x, y, train=True), abstract,
      images, labels)
  family.check_outputs(outputs, images.shape, num_classes, repr(config.model))


def init_train_state(model: nnx.Module,
                     optimizer: optax.GradientTransformation
                     ) -> tuple[nnx.GraphDef, TrainState]:
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  state = TrainState(
      step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
      opt_state=optimizer.init(params),
      nonfinite_step=jnp.full((), -1, jnp.int32))
  return graphdef, state


def apply_gradients(state: TrainState, grads, model_state,
                    optimizer: optax.GradientTransformation,
                    loss: jax.Array) -> tuple[TrainState, jax.Array]:
  """One optimiser update, skipped (state kept) if loss or gradient is not finite.

  Returns the new state and the global gradient norm.
  """
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree.map(  # noqa: E731
      lambda n, o: jnp.where(finite, n, o), new, old)
  nonfinite_step = jnp.where(
      (state.nonfinite_step < 0) & ~finite, state.step,
      state.nonfinite_step)
  new_state = TrainState(
      step=state.step + 1,
      params=keep(params, state.params),
      model_state=keep(model_state, state.model_state),
      opt_state=keep(opt_state, state.opt_state),
      nonfinite_step=nonfinite_step)
  return new_state, grad_norm


COMPUTE_DTYPES = {'float32': None, 'bfloat16': jnp.bfloat16}


def compute_dtype(config: ml_collections.ConfigDict):
  """``config.compute_dtype`` as a dtype (None: float32, nothing cast)."""
  name = fill_defaults(config).compute_dtype
  if name not in COMPUTE_DTYPES:
    raise ValueError(f'config.compute_dtype must be one of '
                     f'{sorted(COMPUTE_DTYPES)}, got {name!r}.')
  return COMPUTE_DTYPES[name]


def cast_floating(tree, dtype):
  """``tree`` with its floating leaves cast to ``dtype`` (None: unchanged)."""
  if dtype is None:
    return tree
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
      else x, tree)


def forward(model: nnx.Module, images: jax.Array, dtype, *args, **kwargs
            ) -> dict[str, jax.Array]:
  """``model(images, ...)`` in the compute ``dtype``; outputs as float32."""
  outputs = model(cast_floating(images, dtype), *args, **kwargs)
  return outputs if dtype is None else cast_floating(outputs, jnp.float32)


def gradient_step(graphdef: nnx.GraphDef, state: TrainState,
                  optimizer: optax.GradientTransformation,
                  loss_fn: Callable[[nnx.Module], tuple[jax.Array, dict]],
                  dtype=None) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimiser step on ``loss_fn(model) -> (scalar loss, metrics)``.

  Mixed precision: with ``dtype`` (e.g. bfloat16) the model runs on a copy of
  the float32 master parameters cast to it; the gradients and the update stay
  float32. The model's non-parameter state (dropout RNG counters) advances.
  """

  def loss_of_params(params):
    # copy=True: fresh Variables of this trace, or dropout could not advance
    # its RNG counter here (flax TraceContextError).
    model = nnx.merge(graphdef, cast_floating(params, dtype),
                      state.model_state, copy=True)
    loss, metrics = loss_fn(model)
    _, _, model_state = nnx.split(model, nnx.Param, ...)
    return (loss.astype(jnp.promote_types(loss.dtype, jnp.float32)),
            (metrics, model_state))

  (loss, (metrics, model_state)), grads = jax.value_and_grad(
      loss_of_params, has_aux=True)(state.params)
  state, grad_norm = apply_gradients(state, grads, model_state, optimizer,
                                     loss)
  return state, metrics | {'loss': loss, 'grad_norm': grad_norm}


def digit_inputs(images: jax.Array, key: jax.Array | None, max_shift: int,
                 center_crop: int = 0) -> jax.Array:
  """uint8 [B, H, W, C] -> float32 in [0, 1], on device.

  With a key (training) each image is shifted by up to ``max_shift`` pixels
  with zero padding, the only augmentation of Sabour et al. ``center_crop``
  > 0 then keeps the central window of that size, in training and
  evaluation alike (MNIST digits are scaled to fit 20x20 and centred on
  the 28x28 frame).
  """
  images = data_lib.to_float(images)
  if key is not None and max_shift:
    images = data_lib.random_shift(key, images, max_shift)
  if center_crop:
    images = data_lib.center_crop(images, center_crop)
  return images


def count_params(params) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


class FamilySteps(NamedTuple):
  """What a model family gives ``fit``.

  train_step(graphdef, state, images_uint8, labels, key) -> (state, metrics)
    with metrics a dict of scalars incl. 'loss' and 'accuracy'; fit jits it
    with the graphdef bound and the state donated.
  eval_step(graphdef, params, model_state, images_uint8, labels, mask)
    -> {'correct', 'loss', 'count'} sums.
  eval_inputs(images_uint8) -> what the model reads at evaluation (for the
    evaluators: attacks and figures perturb or draw these).
  train_batch(train_images, train_labels, indices [batch_size], mesh)
    -> the (images, labels) train_step receives; None: the examples at
    ``indices`` of the training split, sharded over ``mesh`` (the batch
    order of ``fit``). ``whole_split``: the whole training split, for steps
    that draw their batch from the key (MultiMNIST pairs generated on
    device); the batch still depends only on (seed, step).
  """
  train_step: Callable
  eval_step: Callable
  eval_inputs: Callable
  train_batch: Callable | None = None


def whole_split(images: jax.Array, labels: jax.Array, indices: np.ndarray,
                mesh) -> tuple[jax.Array, jax.Array]:
  """``FamilySteps.train_batch`` of steps that draw their own batch: the
  whole training split, as placed on the device."""
  del indices, mesh
  return images, labels
