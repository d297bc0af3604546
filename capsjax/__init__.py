"""capsjax: capsule networks in JAX/Flax (dynamic routing and EM routing).

What each routing computes is ``capsjax.routing``; how it runs (XLA, the
CPU's native kernels, Pallas) is ``capsjax.kernels``, chosen by the keyword
``implementation`` (None: the fastest available). ``dynamic_routing``,
``conv_capsule_routing`` and ``conv2d`` here take it.

``import capsjax`` changes nothing in the process. One setting is an
explicit call, to make before JAX's first computation (the experiments,
benchmarks and tests make it): ``capsjax.prefer_eigen_convolutions()``
adds ``--xla_cpu_experimental_ynn_fusion_type=-individual_convolution`` to
``XLA_FLAGS``, so that XLA:CPU runs its Eigen convolutions rather than
YNNPACK's (whose forward passes ran 2.3-4.8x slower here;
``capsjax.kernels.conv.dispatch``). YNNPACK fusion types already named in
``XLA_FLAGS`` leave it alone; it returns what it did, in words.
"""

from capsjax.kernels import conv2d
from capsjax.kernels import conv_capsule_routing
from capsjax.kernels import dynamic_routing
from capsjax.kernels.conv.dispatch import prefer_eigen_convolutions
from capsjax.losses import cross_entropy_loss
from capsjax.losses import margin_loss
from capsjax.losses import reconstruction_loss
from capsjax.losses import spread_loss
from capsjax.losses import spread_loss_margin
from capsjax.routing import coupling_coefficients
from capsjax.routing import em_routing
from capsjax.routing import inverse_temperature_schedule
from capsjax.routing import safe_norm
from capsjax.routing import squash
from capsjax.routing.attention import efficient_squash
from capsjax.routing.attention import inverted_dot_product_routing
from capsjax.routing.attention import self_attention_routing
from capsjax.routing.self_routing import self_routing
from capsjax.routing.self_routing import uniform_routing
from capsjax.routing.votes import conv_capsule_patches
from capsjax.routing.votes import conv_parent_normalizer
from capsjax.routing.votes import coordinate_addition
from capsjax.routing.votes import matrix_votes
from capsjax.routing.votes import shared_vector_votes
from capsjax.routing.votes import vector_votes

__version__ = '0.1.0'

__all__ = (
    'conv2d',
    'conv_capsule_patches',
    'conv_capsule_routing',
    'conv_parent_normalizer',
    'coordinate_addition',
    'coupling_coefficients',
    'cross_entropy_loss',
    'dynamic_routing',
    'efficient_squash',
    'em_routing',
    'inverse_temperature_schedule',
    'inverted_dot_product_routing',
    'margin_loss',
    'prefer_eigen_convolutions',
    'matrix_votes',
    'reconstruction_loss',
    'safe_norm',
    'self_attention_routing',
    'self_routing',
    'shared_vector_votes',
    'spread_loss',
    'spread_loss_margin',
    'squash',
    'uniform_routing',
    'vector_votes',
)
