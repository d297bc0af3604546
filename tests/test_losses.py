"""Tests for capsjax.losses against hand-computed numbers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capsjax import losses

LENGTHS = np.array([[0.95, 0.5, 0.05], [0.2, 0.8, 0.15]], np.float32)
ONE_HOT = np.array([[1, 0, 0], [0, 1, 0]], np.float32)


def test_margin_loss_hand_computed():
  # Example 0: class 0 present with 0.95 > 0.9 -> 0; class 1 absent:
  # 0.5 (0.5 - 0.1)^2 = 0.08; class 2 absent with 0.05 < 0.1 -> 0.
  # Example 1: 0.5 (0.2 - 0.1)^2 + (0.9 - 0.8)^2 + 0.5 (0.15 - 0.1)^2.
  expected = [0.08, 0.005 + 0.01 + 0.00125]
  out = jax.jit(losses.margin_loss)(LENGTHS, ONE_HOT)
  np.testing.assert_allclose(out, expected, rtol=1e-5)


def test_margin_loss_su_weight_and_several_labels():
  # Su's binary loss (his capsule post): negative weight 0.25.
  np.testing.assert_allclose(
      losses.margin_loss(LENGTHS, ONE_HOT, negative_weight=0.25),
      [0.04, 0.0025 + 0.01 + 0.000625], rtol=1e-5)
  # MultiMNIST: two present classes.
  two = np.array([[1, 1, 0]], np.float32)
  np.testing.assert_allclose(
      losses.margin_loss(LENGTHS[:1], two), [0.4**2], rtol=1e-5)
  # Other margins.
  np.testing.assert_allclose(
      losses.margin_loss(LENGTHS[:1], ONE_HOT[:1], positive_margin=1.0,
                         negative_margin=0.0),
      [0.05**2 + 0.5 * (0.5**2 + 0.05**2)], rtol=1e-5)


def test_margin_loss_gradient():
  # d/d|v_0| of (0.9 - |v_0|)^2 at 0.5 is -0.8; d/d|v_1| of 0.5 (|v_1| - 0.1)^2
  # at 0.3 is 0.2; |v_2| = 0.05 is below the negative margin: 0.
  grad = jax.grad(lambda x: jnp.sum(losses.margin_loss(x, ONE_HOT[:1])))(
      np.array([[0.5, 0.3, 0.05]], np.float32))
  np.testing.assert_allclose(grad, [[-0.8, 0.2, 0.0]], rtol=1e-5, atol=1e-7)


def test_reconstruction_loss_hand_computed():
  reconstructions = np.array([[0.1, 0.2], [0.3, 0.4]], np.float32)
  images = np.array([[0.0, 0.5], [0.3, 0.0]], np.float32)
  np.testing.assert_allclose(
      jax.jit(losses.reconstruction_loss)(reconstructions, images),
      [0.01 + 0.09, 0.16], rtol=1e-5)
  # Images as [B, H, W, 1] against flat reconstructions [B, H*W].
  np.testing.assert_allclose(
      losses.reconstruction_loss(reconstructions, images.reshape(2, 1, 2, 1)),
      [0.1, 0.16], rtol=1e-5)


def test_spread_loss_hand_computed():
  activations = np.array([[0.8, 0.3, 0.7], [0.1, 0.2, 0.9]], np.float32)
  labels = np.array([0, 2])
  # m = 0.2: example 0: max(0, 0.2 - 0.5)^2 + max(0, 0.2 - 0.1)^2 = 0.01;
  # example 1: gaps 0.8 and 0.7 exceed the margin: 0.
  np.testing.assert_allclose(
      jax.jit(losses.spread_loss)(activations, labels, 0.2), [0.01, 0.0],
      rtol=1e-5, atol=1e-8)
  # m = 0.9: (0.9 - 0.5)^2 + (0.9 - 0.1)^2 and (0.9 - 0.8)^2 + (0.9 - 0.7)^2.
  np.testing.assert_allclose(
      losses.spread_loss(activations, labels, jnp.float32(0.9)),
      [0.16 + 0.64, 0.01 + 0.04], rtol=1e-5)
  # The target class itself never contributes.
  np.testing.assert_allclose(
      losses.spread_loss(np.zeros((1, 3)), np.array([1]), 0.5), [0.5],
      rtol=1e-6)


@pytest.mark.parametrize('step,expected', [
    (0, 0.2 + 0.79 / (1 + math.exp(4))),
    (200_000, 0.2 + 0.79 * 0.5),
    (250_000, 0.2 + 0.79 / (1 + math.exp(-1))),
    (10_000_000, 0.2 + 0.79 / (1 + math.exp(-10))),  # min(10, 196) = 10
])
def test_spread_loss_margin_authors(step, expected):
  np.testing.assert_allclose(losses.spread_loss_margin(step), expected,
                             rtol=1e-6)


@pytest.mark.parametrize('step,expected', [
    (0, 0.2), (25_000, 0.55), (50_000, 0.9), (100_000, 0.9)])
def test_spread_loss_margin_linear(step, expected):
  np.testing.assert_allclose(
      losses.spread_loss_margin(step, schedule='linear'), expected, rtol=1e-6)
  np.testing.assert_allclose(
      losses.spread_loss_margin(step / 5, schedule='linear',
                                total_steps=10_000, start=0.1, end=0.5),
      0.1 + 0.4 * (expected - 0.2) / 0.7, rtol=1e-6)


def test_spread_loss_margin_rejects_unknown_schedule():
  with pytest.raises(ValueError, match='schedule'):
    losses.spread_loss_margin(0, schedule='cosine')


def test_cross_entropy_hand_computed():
  logits = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], np.float32)
  labels = np.array([2, 1])
  expected = [math.log(1 + math.exp(-1) + math.exp(-2)), math.log(3.0)]
  np.testing.assert_allclose(jax.jit(losses.cross_entropy_loss)(logits,
                                                                labels),
                             expected, rtol=1e-6)
