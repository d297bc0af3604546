"""The routing math: what each routing computes, as pure JAX functions.

- ``common``: the squash, a safe norm and the input checks they share;
- ``dynamic``: dynamic routing (Sabour et al. 2017) and Su's variants;
- ``em``: EM routing (Hinton et al. 2018), its steps and its options
  (``EMRouting``: the paper's, the authors' and the released code's forms);
- ``attention``: Efficient-CapsNet's self-attention routing and inverted
  dot-product attention routing;
- ``matrix_capsules``: EM routing of matrix-capsule layers (conv capsule
  windows, chunked; class capsules with coordinate addition);
- ``self_routing``: self-routing (Hahn et al. 2019) and uniform routing,
  its no-routing control;
- ``votes``: vote transforms, conv-capsule patches, coordinate addition.

Everything here is how XLA computes it. How a routing runs on a given
CPU or GPU (fused C++ kernels, Pallas kernels) is ``capsjax.kernels``,
which chooses an implementation by its ``implementation`` keyword.
"""

from capsjax.routing import attention
from capsjax.routing import matrix_capsules
from capsjax.routing import self_routing
from capsjax.routing import votes
from capsjax.routing.common import NORM_EPSILON
from capsjax.routing.common import UNROLL_ITERATIONS
from capsjax.routing.common import as_float32
from capsjax.routing.common import check_iterations
from capsjax.routing.common import floating_array
from capsjax.routing.common import safe_norm
from capsjax.routing.common import squash
from capsjax.routing.dynamic import DynamicRoutingState
from capsjax.routing.dynamic import coupling_coefficients
from capsjax.routing.dynamic import dynamic_routing
from capsjax.routing.em import AUTHORS_EM
from capsjax.routing.em import CAPSJAX_EM
from capsjax.routing.em import COST_STD_EPSILON
from capsjax.routing.em import EM_ROUTING_PRESETS
from capsjax.routing.em import FINAL_INVERSE_TEMPERATURE
from capsjax.routing.em import MASS_EPSILON
from capsjax.routing.em import PAPER_EM
from capsjax.routing.em import RELEASED_CLASS_MASS_EPSILON
from capsjax.routing.em import RELEASED_CONV_MASS_EPSILON
from capsjax.routing.em import RELEASED_EM
from capsjax.routing.em import VARIANCE_FLOOR
from capsjax.routing.em import EMRouting
from capsjax.routing.em import EMRoutingState
from capsjax.routing.em import Normalizer
from capsjax.routing.em import em_e_step
from capsjax.routing.em import em_m_step
from capsjax.routing.em import em_routing
from capsjax.routing.em import em_routing_preset
from capsjax.routing.em import em_routing_with
from capsjax.routing.em import inverse_temperature_schedule
from capsjax.routing.em import inverse_temperatures
from capsjax.routing.em import with_overrides

__all__ = (
    'AUTHORS_EM',
    'CAPSJAX_EM',
    'COST_STD_EPSILON',
    'EM_ROUTING_PRESETS',
    'FINAL_INVERSE_TEMPERATURE',
    'MASS_EPSILON',
    'NORM_EPSILON',
    'PAPER_EM',
    'RELEASED_CLASS_MASS_EPSILON',
    'RELEASED_CONV_MASS_EPSILON',
    'RELEASED_EM',
    'UNROLL_ITERATIONS',
    'VARIANCE_FLOOR',
    'DynamicRoutingState',
    'EMRouting',
    'EMRoutingState',
    'Normalizer',
    'as_float32',
    'attention',
    'check_iterations',
    'coupling_coefficients',
    'dynamic_routing',
    'em_e_step',
    'em_m_step',
    'em_routing',
    'em_routing_preset',
    'em_routing_with',
    'floating_array',
    'inverse_temperature_schedule',
    'inverse_temperatures',
    'matrix_capsules',
    'safe_norm',
    'self_routing',
    'squash',
    'votes',
    'with_overrides',
)
