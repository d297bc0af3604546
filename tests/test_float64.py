"""float64 means float64: with jax_enable_x64 and float64 parameters and
inputs, every model's train step (its trainer's own loss and the gradient
of that loss) holds no float32, bfloat16 or float16 value anywhere in its
jaxpr, sub-jaxprs (jit, custom VJPs, loops, branches) included.

The step is traced, not compiled: make_jaxpr of the trainer's
``train_step``, with its ``preprocess`` (uint8 pixels to float32, the data
path) handing the float64 images through unchanged and
``state.gradient_step`` reduced to the loss and its gradient (the
optimiser update is optax's).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.interpreters import partial_eval as pe

from capsjax import kernels
from capsjax import layers
from capsjax import losses
from capsjax import nn
from capsjax.kernels.conv import onednn
from capsjax.training import matrix_capsules
from capsjax.training import runs
from capsjax.training import state as state_lib
from experiments.configs import baseline_cnn_mnist
from experiments.configs import capsnet_mnist
from experiments.configs import matrix_capsnet_mnist
from experiments.configs import two_digit_transfer
from tests.conftest import unit_tier_keeps

NARROW = ('float32', 'bfloat16', 'float16')


def _config(case):
  """The smoke config of a model family, at small widths."""
  if case == 'capsnet':
    return capsnet_mnist.get_config('smoke')
  if case == 'capsnet_official':
    config = capsnet_mnist.get_config('smoke')
    config.model_options.form = 'official'
    config.loss_form = 'official'
    return config
  if case == 'baseline_cnn':
    return baseline_cnn_mnist.get_config('smoke')
  if case.startswith('matrix_capsnet'):
    # ':authors' routes with the released code's options (its own E-step,
    # lambda schedule and activation), the half L2 and the mean spread loss.
    variant = 'smoke,authors' if case.endswith('authors') else 'smoke'
    config = matrix_capsnet_mnist.get_config(variant)
    config.model_options.update(A=8, B=4, C=4, D=4)
    return config
  config = two_digit_transfer.get_config('smoke')
  config.model = case
  config.model_options.update(config.runs[case].model_options.to_dict())
  return config


def _gradient_only(graphdef, state, optimizer, loss_fn, dtype=None):
  """``state.gradient_step`` without the optimiser: (loss, grads)."""
  del optimizer
  assert dtype is None

  def loss_of_params(params):
    model = nnx.merge(graphdef, params, state.model_state, copy=True)
    return loss_fn(model)

  (loss, _), grads = jax.value_and_grad(loss_of_params, has_aux=True)(
      state.params)
  return loss, grads


def _train_step_jaxpr(config, monkeypatch):
  """The jaxpr of ``config``'s float64 train step (loss and gradient) and
  its outputs' dtypes; jax_enable_x64 must be on."""
  trainer = runs.family(config)
  # Abstract: the step is traced, so only shapes and dtypes matter (building
  # and casting the parameters compiled a program per op and shape).
  model = nnx.eval_shape(lambda: state_lib.create_model(config, seed=0))
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  params = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float64), params)
  state = state_lib.TrainState(
      step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
      opt_state=None, nonfinite_step=jnp.full((), -1, jnp.int32))
  shape = config.model_options.get('input_shape', (28, 28, 1))
  images = jnp.zeros((2, *shape), jnp.float64)
  labels = jnp.array([1, 2], jnp.int32)
  monkeypatch.setattr(trainer, 'preprocess', lambda config, images, key: images)
  monkeypatch.setattr(state_lib, 'gradient_step', _gradient_only)
  steps = trainer.steps_for(config, state_lib.make_optimizer(config))
  step = functools.partial(steps.train_step, graphdef)
  closed = jax.make_jaxpr(step)(state, images, labels, jax.random.key(0))
  return closed, jax.eval_shape(step, state, images, labels,
                                jax.random.key(0))


def _loss_and_grad_only(jaxpr):
  """``jaxpr`` without what its outputs (the loss and the gradients) do not
  depend on: the train step's metrics (its accuracy, a mean of booleans,
  is float32 whatever the parameters' dtype)."""
  return pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0]


def _sub_jaxprs(value):
  """The jaxprs inside one equation parameter (a jaxpr, a closed jaxpr, or
  a tuple or list of them: cond's branches)."""
  if isinstance(value, jax.extend.core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jax.extend.core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _sub_jaxprs(item)


def narrow_values(jaxpr, where='') -> list[str]:
  """'primitive: dtype' for every float32, bfloat16 or float16 value that
  ``jaxpr`` (recursively) reads or writes, and 'primitive: oneDNN' for every
  oneDNN call."""
  found = []
  for var in (*jaxpr.constvars, *jaxpr.invars):
    if str(var.aval.dtype) in NARROW:
      found.append(f'{where or "top"} input: {var.aval.str_short()}')
  for eqn in jaxpr.eqns:
    name = f'{where}/{eqn.primitive.name}' if where else eqn.primitive.name
    for var in (*eqn.invars, *eqn.outvars):
      dtype = getattr(getattr(var, 'aval', None), 'dtype', None)
      if dtype is not None and str(dtype) in NARROW:
        found.append(f'{name}: {var.aval.str_short()}')
    if 'onednn' in str(eqn.params.get('target_name', '')).lower():
      found.append(f'{name}: oneDNN ({eqn.params["target_name"]})')
    for param in eqn.params.values():
      for sub in _sub_jaxprs(param):
        found.extend(narrow_values(sub, name))
  return found


CASES = ['capsnet', 'capsnet_official', 'baseline_cnn', 'matrix_capsnet',
         'matrix_capsnet_authors', 'two_digit_capsnet', 'two_digit_baseline']


@pytest.mark.parametrize('case', unit_tier_keeps(CASES, 'capsnet',
                                                 'matrix_capsnet'))
def test_float64_train_step_has_no_narrower_value(case, monkeypatch):
  config = _config(case)
  with jax.enable_x64(True):
    closed, (loss, grads) = _train_step_jaxpr(config, monkeypatch)
  assert loss.dtype == jnp.float64
  assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {
      jnp.dtype(jnp.float64)}
  found = narrow_values(_loss_and_grad_only(closed.jaxpr))
  # One line per primitive and dtype: a loop body repeats them.
  assert not found, f'{case}: ' + '; '.join(sorted(set(found))[:40])


def test_the_check_sees_float32_inside_sub_jaxprs():
  """A float32 value in a scan body, a cond branch and a custom VJP is
  found and named; a float64 one is not."""

  @jax.custom_vjp
  def narrowing(x):
    return x.astype(jnp.float32).astype(jnp.float64)

  narrowing.defvjp(lambda x: (narrowing(x), None), lambda _, g: (g,))

  def body(carry, x):
    y = jax.lax.cond(x > 0, lambda v: v.astype(jnp.float32).sum(),
                     lambda v: jnp.float32(0), carry)
    return carry, y

  with jax.enable_x64(True):
    x = jnp.ones(3, jnp.float64)
    scanned = jax.make_jaxpr(lambda x: jax.lax.scan(body, x, x))(x)
    custom = jax.make_jaxpr(jax.jit(jax.grad(lambda x: narrowing(x).sum())))(
        x)
    clean = jax.make_jaxpr(jax.jit(jax.grad(lambda x: jnp.sum(x * x))))(x)
  assert 'scan/cond/convert_element_type: float32[3]' in narrow_values(
      scanned.jaxpr)
  assert any(line.startswith('jit/custom_vjp') and
             line.endswith('convert_element_type: float32[3]')
             for line in narrow_values(custom.jaxpr)), narrow_values(
                 custom.jaxpr)
  assert not narrow_values(clean.jaxpr)


def test_float64_convolutions_are_xla():
  """conv2d's CPU dispatch sends float64 to XLA (oneDNN computes float32
  and bfloat16 only); the check above would name a oneDNN call."""
  rng = np.random.default_rng(2)
  x, kernel = rng.standard_normal((2, 12, 12, 8)), rng.standard_normal(
      (3, 3, 8, 16))

  def grads_jaxpr(x, kernel):
    return jax.make_jaxpr(jax.grad(
        lambda x, k: jnp.sum(kernels.conv2d(x, k, 2)), argnums=(0, 1)))(
            x, kernel).jaxpr

  with jax.enable_x64(True):
    assert not narrow_values(grads_jaxpr(jnp.asarray(x), jnp.asarray(kernel)))
  if onednn.available():
    found = narrow_values(grads_jaxpr(jnp.asarray(x, jnp.float32),
                                      jnp.asarray(kernel, jnp.float32)))
    assert any('oneDNN' in line for line in found), found


# ----------------------------------------------------------------------------
# The pieces that used to round float64 to float32.


def test_bias_gradient_is_summed_in_float64():
  rng = np.random.default_rng(0)
  dy = rng.standard_normal((16, 9, 9, 5)) * np.exp(rng.uniform(
      -8, 8, (16, 9, 9, 5)))
  expected = dy.sum((0, 1, 2))
  with jax.enable_x64(True):
    for y_dtype, bias_dtype in ((jnp.float64, jnp.float64),
                                (jnp.float64, jnp.float32)):
      y = jnp.zeros(dy.shape, y_dtype)
      bias = jnp.zeros((5,), bias_dtype)
      # The forward pass and its vjp in one compiled program.
      _, dbias = jax.jit(lambda y, bias, dy: jax.vjp(nn.add_bias, y, bias)[1](
          dy))(y, bias, jnp.asarray(dy, y_dtype))
      assert dbias.dtype == bias_dtype
      np.testing.assert_allclose(
          dbias, expected,
          rtol=1e-13 if bias_dtype == jnp.float64 else 2.0**-24)
    # The convolution layer's bias: float64 params, float64 gradient.
    graphdef, params = nnx.split(nnx.jit(
        lambda: layers.Conv2D(3, 5, 3, rngs=nnx.Rngs(0)))())
    params = jax.tree.map(lambda p: p.astype(jnp.float64), params)
    x = jnp.asarray(rng.standard_normal((16, 11, 11, 3)))
    grads = jax.jit(jax.grad(lambda p: jnp.sum(
        nnx.merge(graphdef, p)(x) * dy)))(params)
  assert grads['bias'][...].dtype == jnp.float64
  np.testing.assert_allclose(grads['bias'][...], expected, rtol=1e-13)


def test_losses_and_penalty_keep_float64():
  rng = np.random.default_rng(1)
  scores = rng.uniform(size=(4, 5))
  labels = np.array([0, 3, 4, 1])
  with jax.enable_x64(True):
    # One compiled program, not one per op and shape; the dtypes alone are
    # read abstractly.
    @jax.jit
    def float64_losses(scores, labels):
      margin = losses.spread_loss_margin(jnp.int32(123_456))
      return (margin,
              losses.spread_loss_margin(7, schedule='linear', total_steps=9),
              losses.spread_loss(scores, labels, margin),
              losses.cross_entropy_loss(scores, labels),
              matrix_capsules.l2_penalty({'w': jnp.asarray(scores),
                                          'b': jnp.ones(3)}))

    margin, linear, spread, entropy, penalty = float64_losses(scores, labels)
    assert margin.dtype == jnp.float64
    np.testing.assert_allclose(
        margin, 0.2 + 0.79 / (1 + np.exp(-(123_456 / 50_000 - 4))),
        rtol=1e-15)
    np.testing.assert_allclose(linear, 0.2 + 0.7 * 7 / 9, rtol=1e-15)
    # float32 scores keep a float32 loss, whatever the margin's dtype.
    assert jax.eval_shape(losses.spread_loss, scores.astype(np.float32),
                          labels, margin).dtype == jnp.float32
    assert jax.eval_shape(lambda: losses.spread_loss_margin(
        5, dtype=jnp.float32)).dtype == jnp.float32
  assert spread.dtype == entropy.dtype == penalty.dtype == jnp.float64
  gaps = np.maximum(0.0, float(margin) - (
      scores[np.arange(4), labels][:, None] - scores))**2
  gaps[np.arange(4), labels] = 0.0
  np.testing.assert_allclose(spread, gaps.sum(-1), rtol=1e-14)
  shifted = scores - scores.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  np.testing.assert_allclose(entropy, -log_probs[np.arange(4), labels],
                             rtol=1e-14)
  np.testing.assert_allclose(penalty, np.sum(scores**2), rtol=1e-14)
  # Without x64 the margin is float32, as float32 training computes it.
  assert jax.eval_shape(losses.spread_loss_margin, 5).dtype == jnp.float32


def test_attack_gradients_and_two_digit_reconstructions_keep_float64():
  """The attacks' input gradient of float64 images is float64 (and exact for
  a quadratic loss); the two-digit reconstructions of a float64 CapsNet are
  float64, float32 ones float32 as before."""
  from capsjax import adversarial
  from capsjax.training import vector_capsules
  with jax.enable_x64(True):
    images = jnp.asarray(np.linspace(0, 1, 2 * 3 * 3).reshape(2, 3, 3, 1),
                         jnp.float64)
    # Each computation below in one compiled program, not one per op.
    grad = jax.jit(functools.partial(
        adversarial.input_gradient,
        lambda x, y: jnp.sum(x ** 2, axis=(1, 2, 3)) * y))(
            images, jnp.asarray([1.0, 2.0], jnp.float64))
    assert grad.dtype == jnp.float64
    np.testing.assert_allclose(
        grad, 2 * np.asarray(images) * np.array([1, 2])[:, None, None, None],
        rtol=1e-15)
    from experiments.configs import capsnet_multimnist
    config = capsnet_multimnist.get_config('smoke')
    create = nnx.jit(lambda: state_lib.create_model(config))
    cast = jax.jit(lambda params, dtype: jax.tree.map(
        lambda p: p.astype(dtype), params), static_argnums=1)
    for dtype in (jnp.float64, jnp.float32):
      model = create()
      params = nnx.state(model, nnx.Param)
      nnx.update(model, cast(params, dtype))
      pairs = jnp.zeros((2, 36, 36, 1), dtype)
      outputs = nnx.jit(lambda m, x, y: vector_capsules.two_digit_outputs(
          m, x, y, train=False))(model, pairs, jnp.asarray([[0, 1], [2, 3]]))
      assert outputs['digit_reconstructions'].dtype == dtype
