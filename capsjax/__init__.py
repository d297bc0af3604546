"""capsjax: capsule networks in JAX/Flax (dynamic routing and EM routing).

``import capsjax`` changes nothing in the process. One setting is an
explicit call, to make before JAX's first computation (the experiments,
benchmarks and tests make it): ``capsjax.prefer_eigen_convolutions()``
adds ``--xla_cpu_experimental_ynn_fusion_type=-individual_convolution`` to
``XLA_FLAGS``, so that XLA:CPU runs its Eigen convolutions rather than
YNNPACK's (whose forward passes ran 2.3-4.8x slower here;
``capsjax.conv.dispatch``).
``CAPSJAX_YNN_CONVOLUTIONS=1`` in the environment, or YNNPACK fusion types
already named in ``XLA_FLAGS``, leave ``XLA_FLAGS`` alone; it returns what
it did, in words (tests/test_cpu_convolutions.py).
"""

from capsjax.attention_routing import efficient_squash
from capsjax.attention_routing import inverted_dot_product_routing
from capsjax.attention_routing import self_attention_routing
from capsjax.conv.dispatch import prefer_eigen_convolutions
from capsjax.losses import cross_entropy_loss
from capsjax.losses import margin_loss
from capsjax.losses import reconstruction_loss
from capsjax.losses import spread_loss
from capsjax.losses import spread_loss_margin
from capsjax.routing import coupling_coefficients
from capsjax.routing import dynamic_routing
from capsjax.routing import em_routing
from capsjax.routing import inverse_temperature_schedule
from capsjax.routing import safe_norm
from capsjax.routing import squash
from capsjax.votes import conv_capsule_patches
from capsjax.votes import conv_parent_normalizer
from capsjax.votes import coordinate_addition
from capsjax.votes import matrix_votes
from capsjax.votes import shared_vector_votes
from capsjax.votes import vector_votes

__version__ = '0.1.0'

__all__ = (
    'conv_capsule_patches',
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
    'shared_vector_votes',
    'spread_loss',
    'spread_loss_margin',
    'squash',
    'vector_votes',
)
