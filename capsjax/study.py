"""The routing study's model: one convolutional stem and primary capsules,
one capsule head per routing, every head's transforms shared across
positions, so that the same trained model reads any image size.

    model = create_model('routing_study_net', rngs=nnx.Rngs(0), head='su')
    out = model(images)  # [B, H, W, 1], any H, W >= 14: out['class_scores']

Shape legend: B the batch, H x W the image, h x w the stem's grid, C its
channels, T the primary capsule types, N = h * w * T the primary capsules
(the children), K the classes (the parents), Din = 16 a primary capsule's
numbers, D the class capsule dimension (``capsule_dim``; 16 for the 4x4
EM poses).

The backbone is Su's (``models.TwoDigitCapsNet``): his trunk, conv 3x3
ReLU x2, 2x2 average pool, conv 3x3 ReLU x2 (VALID; 28x28 -> 8x8, 40x40 ->
14x14, 56x28 -> 22x8), its kernels He-normal (Su's glorot uniform shrinks
the features about twofold a layer at these widths, and the squashed
primary capsules then start near length 0.01, where the squash has no
slope). Then the primary capsules, a 1x1 convolution to T types of 16
numbers at every position (children ordered row, column, type), which the
heads read as their papers do:
- vector heads ('dynamic_1', 'dynamic_3', 'su', 'self_attention',
  'inverted_dot_product'): squashed 16-D vectors (``layers.PrimaryCapsules``
  with a 1x1 kernel), Sabour et al.'s primary capsules;
- pose heads ('em', 'self_routing', 'uniform'): a 4x4 pose (flattened to
  16-D for the other two) plus an activation, sigmoid of a second 1x1
  convolution of T channels (``layers.MatrixPrimaryCapsules``).

Each head's votes use transforms shared across positions (the parameters do
not depend on N): the vector heads and the control one W_j [Din, D] per
class shared by every child, as Su's ``layers.SharedCapsules``, glorot
uniform as his (self-attention alone starts smaller, at its authors' scale:
``SelfAttentionHead``); the EM head Hinton et al.'s class capsules
(``layers.ClassCapsules``: one 4x4 W per primary type and class, shared
across positions, with coordinate addition of the grid's (h + 0.5) / H).
Per-child routing parameters (self-attention's log priors, self-routing's
routing networks) are kept per primary type and shared across positions.

The heads (``HEADS``) and their class scores, in the way each paper reads
them:
- 'dynamic_1', 'dynamic_3': dynamic routing (Sabour et al. 2017), 1 and 3
  iterations; scores the class capsules' lengths.
- 'su': Su's later routing (3 iterations, accumulate=False, squash
  constant 0.5, agreement with s / |s|); lengths.
- 'em': EM routing (Hinton et al. 2018) with the project's EM configs'
  options (``routing.CAPSJAX_EM``: 2 iterations, normalised cost, lambda =
  1; transforms of std 1; docs/em_routing_options.md); scores the class
  activations.
- 'self_attention': Efficient-CapsNet's self-attention routing (Mazzia et
  al. 2021) with learned log priors; lengths (of its own squash).
- 'inverted_dot_product': inverted dot-product attention routing (Tsai et
  al. 2020), 2 passes, LayerNorm with learned scale and offset; the authors
  read each class pose by one linear map to a logit, shared by the
  classes: the score here is its sigmoid, in [0, 1] as every other head's
  (its log-odds, which the attacks read, are that logit).
- 'self_routing': self-routing (Hahn et al. 2019); scores the class
  activations a_j (they sum to 1 over the classes). As the authors' class
  layer (``pose_out=False``) it makes no class poses, so it has no vote
  transforms (no score would train them): its parameters are the routing
  networks.
- 'uniform': the no-routing control, ``self_routing.uniform_routing``, the
  library's self-routing layer with couplings='uniform': votes by the
  shared transforms, every coupling 1/K, no routing networks; each class
  pose the activation-weighted mean of its votes. Its activations are 1/K
  whatever the input, so it scores the lengths of its squashed class
  poses.

Parameters (``count_params``, defaults: stem (32, 32, 64, 64), 8 primary
types, D = 16, one input channel, 10 classes; any image size): stem 64,992;
primary capsules 8,320 (+ 520 for the activations of the pose heads);
heads 'dynamic_1', 'dynamic_3', 'su' 2,560 (total 75,872);
'self_attention' 2,640 (75,952); 'inverted_dot_product' 2,609 (75,921);
'em' 1,300 (75,132); 'self_routing' 1,360 (75,192); 'uniform' 2,560
(76,392). The largest is 1.7% above the smallest.

Returns {'class_scores': [B, K] in [0, 1], 'coupling': [B, N, K] the
couplings (EM: the assignments) that made them, and but for
'self_routing' 'capsules': [B, K, D] the class poses}.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from capsjax import flops
from capsjax import layers
from capsjax import nn
from capsjax import routing
from capsjax.kernels import implementations
from capsjax.kernels.conv import dot_general as conv_dot_general
from capsjax.routing import attention as attention_routing
from capsjax.routing import self_routing as self_routing_lib
from capsjax.routing import votes as votes_lib

HEADS = ('dynamic_1', 'dynamic_3', 'su', 'em', 'self_attention',
         'inverted_dot_product', 'self_routing', 'uniform')
# The no-routing control every other head is compared with.
CONTROL_HEAD = 'uniform'
# The heads whose primary capsules are poses with activations.
POSE_HEADS = ('em', 'self_routing', 'uniform')
# What each head's class score is, in words (the study's table says it).
SCORES = {
    'dynamic_1': 'capsule length', 'dynamic_3': 'capsule length',
    'su': 'capsule length', 'em': 'class activation',
    'self_attention': 'capsule length',
    'inverted_dot_product': 'sigmoid of a linear read-out of the pose',
    'self_routing': 'class activation',
    'uniform': 'length of the squashed pose (activations are 1/K)'}
PRIMARY_DIM = 16  # a primary capsule's numbers: a 16-D vector or a 4x4 pose
POSE_SIZE = 4
# Dynamic routing per head: (iterations, accumulate, squash constant,
# agreement with s / |s|).
_DYNAMIC = {'dynamic_1': (1, True, 1.0, False),
            'dynamic_3': (3, True, 1.0, False),
            'su': (3, False, 0.5, True)}
INVERTED_ITERATIONS = 2  # the authors' README's num_routing
EM_ROUTING = routing.CAPSJAX_EM
EM_TRANSFORM_STD = 1.0  # the EM configs' (docs/em_routing_options.md)
# The trunk's receptive field: every output position sees 14x14 pixels.
MIN_IMAGE_SIDE = 14
# The images the study trains on (MNIST): the self-attention head's
# initialisation counts their children.
REFERENCE_SIDE = 28


def check_head(head: str) -> None:
  if head not in HEADS:
    raise ValueError(f'head must be one of {HEADS}, got {head!r}.')


def shared_transform_init(key: jax.Array, out_caps: int, in_dim: int,
                          out_dim: int) -> jax.Array:
  """[O, Din, Dout] transforms, Su's Keras layer's glorot uniform over
  [Din, O * Dout] (``layers.SharedCapsules``' own initialisation)."""
  limit = math.sqrt(6.0 / (in_dim + out_caps * out_dim))
  return jax.random.uniform(
      key, (out_caps * in_dim * out_dim,), jnp.float32, -limit,
      limit).reshape(out_caps, in_dim, out_dim)


def per_position(params: jax.Array, num_positions: int) -> jax.Array:
  """Per-type parameters [T, ...] repeated for every position: [h*w*T, ...],
  children ordered (row, column, type) as the primary capsules are."""
  return jnp.tile(params, (num_positions,) + (1,) * (params.ndim - 1))


def _grid(side: int) -> tuple[int, int, int, int]:
  """The four convolutions' output sides of an input side."""
  first = side - 2
  second = first - 2
  third = second // 2 - 2
  return first, second, third, third - 2


def forward_flops(head: str, height: int = 28, width: int = 28, *,
                  stem_widths: Sequence[int] = (32, 32, 64, 64),
                  input_channels: int = 1, primary_types: int = 8,
                  num_classes: int = 10, capsule_dim: int = 16) -> int:
  """One H x W image's forward FLOPs (2 a multiply-add): the stem's four
  3x3 convolutions, the primary capsules' 1x1 convolution(s), the votes
  (the EM head's 4x4 matrix products; the self-routing head has none) and
  ``routing_cost``'s routing. Biases, ReLUs, the pooling and the squash of
  the primary capsules are left out (under 1% here)."""
  check_head(head)
  sizes = (input_channels,) + tuple(stem_widths)
  flops_count = 0
  for (rows, cols), c_in, c_out in zip(
      zip(_grid(height), _grid(width), strict=True), sizes[:-1], sizes[1:],
      strict=True):
    flops_count += 2 * 9 * c_in * c_out * rows * cols
  positions = _grid(height)[-1] * _grid(width)[-1]
  per_type = PRIMARY_DIM + (1 if head in POSE_HEADS else 0)
  flops_count += 2 * sizes[-1] * primary_types * per_type * positions
  children = positions * primary_types
  if head == 'em':
    flops_count += 2 * children * num_classes * POSE_SIZE ** 3
  elif head != 'self_routing':
    flops_count += 2 * children * num_classes * PRIMARY_DIM * capsule_dim
  return flops_count + int(routing_cost(head, children, num_classes,
                                        capsule_dim).flops)


def num_children(height: int, width: int, primary_types: int = 8) -> int:
  """N, the primary capsules of an H x W image: the stem's grid x T."""
  return _grid(height)[-1] * _grid(width)[-1] * primary_types


def _lengths(capsules: jax.Array) -> jax.Array:
  """[..., D] -> float32 [...] (scores near 1 must not tie in bfloat16)."""
  capsules = capsules.astype(jnp.promote_types(capsules.dtype, jnp.float32))
  return routing.safe_norm(capsules, axis=-1)


# ----------------------------------------------------------------------------
# The backbone.


def _stem(in_channels: int, widths, *, implementation: str | None,
          rngs: nnx.Rngs) -> layers.SuTrunk:
  """Su's trunk (``layers.SuTrunk``), its kernels He-normal (module
  docstring), the biases zeros: [B, H, W, Cin] -> [B, (H-4)//2 - 4,
  (W-4)//2 - 4, widths[-1]], H, W >= 14."""
  if (isinstance(widths, int) or not isinstance(widths, Sequence)
      or len(widths) != 4):
    raise ValueError(f'stem_widths must be 4 positive ints, got {widths!r}.')
  return layers.SuTrunk(in_channels, tuple(widths), kernel_init=nn.he_normal,
                        implementation=implementation, rngs=rngs)


# ----------------------------------------------------------------------------
# The heads: (primary capsules) -> (class capsules [B, K, D], scores [B, K],
# coupling [B, N, K]).


class DynamicHead(nnx.Module):
  """'dynamic_1', 'dynamic_3', 'su': ``layers.SharedCapsules`` (no bias)."""

  def __init__(self, head: str, num_classes: int, capsule_dim: int, *,
               implementation: str | None, rngs: nnx.Rngs):
    iterations, accumulate, constant, normalize = _DYNAMIC[head]
    self.capsules = layers.SharedCapsules(
        PRIMARY_DIM, num_classes, capsule_dim, iterations,
        accumulate=accumulate, squash_constant=constant,
        normalize_agreement=normalize, implementation=implementation,
        rngs=rngs)

  def __call__(self, primary: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """primary: [B, N, Din] squashed vectors."""
    capsules, coupling = self.capsules(primary)
    return capsules, _lengths(capsules), coupling


class _SharedVotes(nnx.Module):
  """One W_j [Din, D] per class shared by every child (``SharedCapsules``'
  votes and initialisation)."""

  def _init_votes(self, num_classes: int, out_dim: int, rngs: nnx.Rngs
                  ) -> None:
    self.weights = nnx.Param(shared_transform_init(
        rngs.params(), num_classes, PRIMARY_DIM, out_dim))

  def votes(self, children: jax.Array) -> jax.Array:
    """[B, N, Din] -> [B, N, K, D]."""
    return votes_lib.shared_vector_votes(children, self.weights[...],
                                         dot_general=conv_dot_general)


class SelfAttentionHead(_SharedVotes):
  """Self-attention routing with learned log priors [T, K] (the authors'
  B, zeros) shared across positions.

  Its transforms start as the authors' code starts its dense ones,
  he_normal over [N, K, Din, D] (fan-in N * K * Din), with N the children
  of a 28x28 image: Su's scale (the other heads') saturates its squash,
  1 - exp(-|s|), whose gradient vanishes exponentially (docs/routing_study.md).
  """

  def __init__(self, num_types: int, num_classes: int, capsule_dim: int, *,
               rngs: nnx.Rngs):
    dense = (num_children(REFERENCE_SIDE, REFERENCE_SIDE, num_types),
             num_classes, PRIMARY_DIM, capsule_dim)
    # One child's slice of the authors' draw.
    self.weights = nnx.Param(nn.he_normal(rngs.params(), dense)[0])
    self.log_priors = nnx.Param(jnp.zeros((num_types, num_classes),
                                          jnp.float32))

  def __call__(self, primary: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """primary: [B, N, Din] squashed vectors."""
    num_positions = primary.shape[1] // self.log_priors.shape[0]
    capsules, coupling = attention_routing.self_attention_routing(
        self.votes(primary), per_position(self.log_priors[...],
                                          num_positions))
    return capsules, _lengths(capsules), coupling


class InvertedDotProductHead(_SharedVotes):
  """Inverted dot-product routing; LayerNorm scale [D] (ones) and offset
  [D] (zeros); the read-out w [D] (lecun normal) and b (zero): score_j =
  sigmoid(<p_j, w> + b)."""

  def __init__(self, num_classes: int, capsule_dim: int, *, rngs: nnx.Rngs):
    self._init_votes(num_classes, capsule_dim, rngs)
    self.scale = nnx.Param(jnp.ones((capsule_dim,), jnp.float32))
    self.offset = nnx.Param(jnp.zeros((capsule_dim,), jnp.float32))
    self.readout = nnx.Param(nn.lecun_normal(rngs.params(), (capsule_dim, 1)))
    self.readout_bias = nnx.Param(jnp.zeros((1,), jnp.float32))

  def __call__(self, primary: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """primary: [B, N, Din] squashed vectors."""
    poses, coupling = attention_routing.inverted_dot_product_routing(
        self.votes(primary), INVERTED_ITERATIONS, scale=self.scale[...],
        offset=self.offset[...])
    wide = poses.astype(jnp.promote_types(poses.dtype, jnp.float32))
    logits = nn.dense(wide, self.readout[...].astype(wide.dtype),
                      self.readout_bias[...].astype(wide.dtype))[..., 0]
    return poses, jax.nn.sigmoid(logits), coupling


class EMHead(nnx.Module):
  """``layers.ClassCapsules``: EM routing, W [T, K, 4, 4], coordinate
  addition."""

  def __init__(self, num_types: int, num_classes: int, *, rngs: nnx.Rngs):
    self.capsules = layers.ClassCapsules(
        num_types, num_classes, pose_size=POSE_SIZE, coordinate_addition=True,
        em_routing=EM_ROUTING, transform_std=EM_TRANSFORM_STD, rngs=rngs)

  def __call__(self, poses: jax.Array, activations: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """poses [B, h, w, T, 4, 4], activations [B, h, w, T]."""
    class_poses, scores, assignments = self.capsules.route(poses, activations)
    return (class_poses.reshape(class_poses.shape[:2] + (-1,)), scores,
            assignments)


class SelfRoutingHead(nnx.Module):
  """Self-routing: routing networks W^route [T, Din, K] and b^route [T, K]
  (zeros, as the authors start them, so the couplings start uniform),
  shared across positions; the class activations are the scores. As the
  authors' class layer (``pose_out=False``) it makes no class poses: its
  votes have no width, and so no vote transforms, which no score would
  train."""

  def __init__(self, num_types: int, num_classes: int, *, rngs: nnx.Rngs):
    del rngs  # zeros
    self.route_weights = nnx.Param(jnp.zeros(
        (num_types, PRIMARY_DIM, num_classes), jnp.float32))
    self.route_bias = nnx.Param(jnp.zeros((num_types, num_classes),
                                          jnp.float32))

  def __call__(self, poses: jax.Array, activations: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """poses [B, h, w, T, 4, 4], activations [B, h, w, T]."""
    children, child_activations = _children(poses, activations)
    num_positions = children.shape[1] // self.route_bias.shape[0]
    logits = self_routing_lib.self_routing_logits(
        children, per_position(self.route_weights[...], num_positions),
        per_position(self.route_bias[...], num_positions))
    no_poses = jnp.zeros(logits.shape + (0,), children.dtype)
    class_poses, class_activations, coupling = self_routing_lib.self_routing(
        no_poses, child_activations, logits)
    return class_poses, class_activations, coupling


class UniformHead(_SharedVotes):
  """The no-routing control: ``self_routing.uniform_routing`` of the
  votes, every coupling 1/K; the class poses are the activation-weighted
  means of their votes, and the lengths of the squashed poses the scores
  (the class activations are 1/K whatever the input)."""

  def __init__(self, num_classes: int, capsule_dim: int, *, rngs: nnx.Rngs):
    self._init_votes(num_classes, capsule_dim, rngs)

  def __call__(self, poses: jax.Array, activations: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """poses [B, h, w, T, 4, 4], activations [B, h, w, T]."""
    children, child_activations = _children(poses, activations)
    class_poses, _, coupling = self_routing_lib.uniform_routing(
        self.votes(children), child_activations)
    return class_poses, _lengths(routing.squash(class_poses)), coupling


def _children(poses: jax.Array, activations: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
  """Primary poses [B, h, w, T, 4, 4] and activations [B, h, w, T] as
  children: ([B, N, 16], [B, N]), ordered (row, column, type)."""
  batch = poses.shape[0]
  return (poses.reshape(batch, -1, PRIMARY_DIM),
          activations.reshape(batch, -1))


def _make_head(head: str, num_types: int, num_classes: int, capsule_dim: int,
               implementation: str | None, rngs: nnx.Rngs) -> nnx.Module:
  if head in _DYNAMIC:
    return DynamicHead(head, num_classes, capsule_dim, rngs=rngs,
                       implementation=implementations.for_op(
                           implementation, 'dynamic_routing'))
  if head == 'em':
    return EMHead(num_types, num_classes, rngs=rngs)
  if head == 'self_attention':
    return SelfAttentionHead(num_types, num_classes, capsule_dim, rngs=rngs)
  if head == 'inverted_dot_product':
    return InvertedDotProductHead(num_classes, capsule_dim, rngs=rngs)
  if head == 'self_routing':
    return SelfRoutingHead(num_types, num_classes, rngs=rngs)
  return UniformHead(num_classes, capsule_dim, rngs=rngs)


# ----------------------------------------------------------------------------
# The model.


def _checked_images(images: ArrayLike, channels: int, dtype) -> jax.Array:
  """[B, H, W, C] images of the parameters' dtype, H, W >= 14, or a
  ValueError in the words of the other models' checks."""
  images = jnp.asarray(images)
  if images.ndim != 4 or images.shape[-1] != channels:
    raise ValueError(f'images must be [B, H, W, {channels}], got shape '
                     f'{images.shape}.')
  if min(images.shape[1:3]) < MIN_IMAGE_SIDE:
    raise ValueError(f'images must be at least {MIN_IMAGE_SIDE}x'
                     f'{MIN_IMAGE_SIDE} for this stem, got {images.shape}.')
  if images.dtype != dtype:
    hint = ('' if jnp.issubdtype(images.dtype, jnp.floating) else
            '; capsjax.data.to_float converts uint8')
    raise ValueError(
        f'images must be {jnp.dtype(dtype).name} (the dtype of the model\'s '
        f'parameters), pixels in [0, 1], got {images.dtype}{hint}.')
  return images


class RoutingStudyNet(nnx.Module):
  """The routing study's model (module docstring): Su's stem, primary
  capsules, the capsule head ``head`` (one of ``HEADS``).

  Options: ``stem_widths`` the four convolutions' channels,
  ``primary_types`` T, ``capsule_dim`` D of the vector heads' and the
  control's class capsules (EM's are 4x4), ``implementation`` how the
  convolutions and dynamic routing run (``capsjax.kernels``). Any input
  size H, W >= 14 with the same parameters.
  """

  FAMILY: ClassVar[str] = 'capsnet'

  def __init__(self, *, head: str = 'dynamic_3', input_channels: int = 1,
               num_classes: int = 10,
               stem_widths: Sequence[int] = (32, 32, 64, 64),
               primary_types: int = 8, capsule_dim: int = 16,
               implementation: str | None = None, rngs: nnx.Rngs):
    check_head(head)
    for name, value in (('input_channels', input_channels),
                        ('num_classes', num_classes),
                        ('primary_types', primary_types),
                        ('capsule_dim', capsule_dim)):
      layers.check_positive_int(name, value)
    implementations.check(implementation)
    conv = implementations.for_op(implementation, 'conv2d')
    self.head_name, self.input_channels = head, input_channels
    self.stem = _stem(input_channels, stem_widths, implementation=conv,
                      rngs=rngs)
    width = tuple(stem_widths)[-1]
    if head in POSE_HEADS:
      self.primary = layers.MatrixPrimaryCapsules(width, primary_types,
                                                  POSE_SIZE, rngs=rngs)
    else:
      self.primary = layers.PrimaryCapsules(
          width, primary_types, PRIMARY_DIM, kernel_size=1, stride=1,
          implementation=conv, rngs=rngs)
    self.head = _make_head(head, primary_types, num_classes, capsule_dim,
                           implementation, rngs)

  def __call__(self, images: ArrayLike, labels: ArrayLike | None = None, *,
               train: bool = False) -> dict[str, jax.Array]:
    del labels, train  # No decoder, no dropout, no batch statistics.
    x = self.stem(_checked_images(images, self.input_channels,
                                  self.stem.convs[0].kernel.dtype))
    if self.head_name in POSE_HEADS:
      capsules, scores, coupling = self.head(*self.primary(x))
    else:
      capsules, scores, coupling = self.head(self.primary(x))
    out = {'class_scores': scores, 'coupling': coupling}
    if capsules.shape[-1]:  # the self-routing head makes no poses
      out['capsules'] = capsules
    return out


# ----------------------------------------------------------------------------
# Cost.


def routing_cost(head: str, num_children: int, num_classes: int = 10,
                 capsule_dim: int = 16, *, backward: bool = False
                 ) -> flops.Cost:
  """``capsjax.flops``' count of one image's routing in ``head``: votes
  [1, N, K, D] (EM: D = 16, the 4x4 poses), N = ``num_children``. Counts
  the routing only, not the votes nor the stem; Su's normalised agreement
  is priced as dynamic routing's, the self-routing head's votes of no width
  as one number each."""
  check_head(head)
  dim = POSE_SIZE * POSE_SIZE if head == 'em' else capsule_dim
  shape = (1, num_children, num_classes, dim)
  if head in _DYNAMIC:
    iterations, accumulate, _, _ = _DYNAMIC[head]
    return flops.dynamic_routing_cost(shape, iterations, accumulate=accumulate,
                                      backward=backward)
  if head == 'em':
    return flops.em_routing_cost(shape, EM_ROUTING.num_iterations,
                                 backward=backward)
  if head == 'self_attention':
    return flops.self_attention_routing_cost(shape, log_priors=True,
                                             backward=backward)
  if head == 'inverted_dot_product':
    return flops.inverted_dot_product_routing_cost(
        shape, INVERTED_ITERATIONS, affine=True, backward=backward)
  if head == 'self_routing':  # no poses: one number per vote, priced
    shape = shape[:-1] + (1,)
  return flops.self_routing_cost(shape, in_dim=PRIMARY_DIM,
                                 uniform=head == CONTROL_HEAD,
                                 backward=backward)


__all__ = (
    'CONTROL_HEAD',
    'HEADS',
    'POSE_HEADS',
    'SCORES',
    'RoutingStudyNet',
    'check_head',
    'forward_flops',
    'num_children',
    'routing_cost',
)
