"""How capsjax's operations run: one implementation chosen per case.

- ``implementations``: every implementation, what each can take, and the
  choice (the keyword ``implementation``: None, 'xla', 'native',
  'pallas');
- ``ops``: the operations that have more than one (dynamic routing, the
  conv capsule layers' EM routing, convolutions), each choosing;
- ``em_cpu``: the fused EM window kernel for the CPU (C++ in ``csrc/``);
- ``pallas_dynamic``, ``pallas_em``: Pallas kernels of dynamic routing and
  of EM window routing (Triton on GPUs);
- ``conv``: XLA's lowerings of a convolution and oneDNN's convolutions
  (C++ in ``conv/csrc/``);
- ``native``: builds the C++ sources with the machine's compiler, cached.

What each routing computes is ``capsjax.routing``.
"""

from capsjax.kernels.implementations import NAMES
from capsjax.kernels.implementations import OPS
from capsjax.kernels.ops import conv2d
from capsjax.kernels.ops import conv_capsule_routing
from capsjax.kernels.ops import dynamic_routing

__all__ = (
    'NAMES',
    'OPS',
    'conv2d',
    'conv_capsule_routing',
    'dynamic_routing',
)
