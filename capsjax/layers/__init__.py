"""Flax NNX capsule layers: they own parameters and call the pure functions.

- ``common``: convolution, batch normalisation, Su's convolutional trunk,
  checks and initialisers;
- ``vector``: primary, dense and shared capsules with dynamic routing;
- ``efficient``: Efficient-CapsNet's primary capsules and self-attention
  routing;
- ``matrix``: matrix capsules with EM routing;
- ``self_routing``: self-routing capsules and their no-routing control.

Shape legend: B the batch, H x W a grid (H' x W' after a kernel), C or Cin /
Cout channels or capsule types, I input capsules, O output capsules, Din /
Dout vector-capsule dimensions, P the side of a pose matrix (4), K a kernel
size. Every module's docstring gives its input and output shapes.

Argument names, one per idea: ``in_features`` / ``out_features`` the
channels of a convolution, ``in_caps`` / ``out_caps`` the capsules of a
dense capsule layer, ``in_types`` / ``out_types`` the capsule types at each
position of a convolutional capsule layer, ``in_dim`` / ``out_dim`` a vector
capsule's length, ``pose_size`` P, ``transform_std`` the std of the capsule
transforms.

Initialisation (see each layer):
- Convolutions: Flax's default, lecun normal kernels and zero biases
  (``kernel_init=nn.glorot_uniform`` is Keras' default, for Su's models;
  the initialisers are in ``capsjax.nn``).
- Vector capsules (Sabour et al. 2017): the official code
  (Sarasra/models, research/capsules) draws capsule transforms from TF's
  truncated normal with stddev 0.1 and sets the routing bias to 0.1;
  DenseCapsules does the same. The official CapsNet's other initialisers
  (``OFFICIAL_*``; ``models.CapsNet(form='official')`` uses them): every
  kernel std 0.1 (the first convolution's 0.05), every bias 0.1.
  SharedCapsules follows Su's Keras layer (glorot uniform over
  [Din, O*Dout], no bias).
- Matrix capsules (Hinton et al. 2018): the paper prints no initialisation.
  The plain default ``transform_std=None`` draws each 4x4 transform from a
  normal with std 1/sqrt(P) (a P x P product sums P terms, so this keeps the
  pose entries' scale) and sets beta_u = beta_a = 0. The authors' released
  code (google-research ``capsule_em``) uses std 0.3 with beta_a = beta_u =
  0.5 in conv capsule layers and std 0.01 with beta_a = 1.0, beta_u = 2.0 in
  the class layer: ``AUTHORS_CONV_INIT`` / ``AUTHORS_CLASS_INIT`` hold those
  keyword arguments, and ``models.create_model('matrix_capsnet',
  init='authors')`` selects them.
"""

from capsjax.layers.common import AUTHORS_CLASS_INIT
from capsjax.layers.common import AUTHORS_CONV1_INIT
from capsjax.layers.common import AUTHORS_CONV_INIT
from capsjax.layers.common import FORMS
from capsjax.layers.common import OFFICIAL_BIAS_INIT
from capsjax.layers.common import OFFICIAL_CONV1_STD
from capsjax.layers.common import OFFICIAL_WEIGHT_STD
from capsjax.layers.common import BatchNorm
from capsjax.layers.common import Conv2D
from capsjax.layers.common import SuTrunk
from capsjax.layers.common import check_positive_int
from capsjax.layers.efficient import DepthwisePrimaryCapsules
from capsjax.layers.efficient import SelfAttentionCapsules
from capsjax.layers.matrix import ClassCapsules
from capsjax.layers.matrix import ConvCapsules
from capsjax.layers.matrix import MatrixPrimaryCapsules
from capsjax.layers.self_routing import COUPLINGS
from capsjax.layers.self_routing import SelfRoutingCapsules
from capsjax.layers.self_routing import authors_transform_init
from capsjax.layers.vector import DenseCapsules
from capsjax.layers.vector import PrimaryCapsules
from capsjax.layers.vector import SharedCapsules

__all__ = (
    'AUTHORS_CLASS_INIT',
    'AUTHORS_CONV1_INIT',
    'AUTHORS_CONV_INIT',
    'COUPLINGS',
    'FORMS',
    'OFFICIAL_BIAS_INIT',
    'OFFICIAL_CONV1_STD',
    'OFFICIAL_WEIGHT_STD',
    'BatchNorm',
    'ClassCapsules',
    'Conv2D',
    'ConvCapsules',
    'DenseCapsules',
    'DepthwisePrimaryCapsules',
    'MatrixPrimaryCapsules',
    'PrimaryCapsules',
    'SelfAttentionCapsules',
    'SelfRoutingCapsules',
    'SharedCapsules',
    'SuTrunk',
    'authors_transform_init',
    'check_positive_int',
)
