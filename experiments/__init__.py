"""The experiments: ``python -m experiments.NAME`` (thin: flags -> config ->
train -> report).

Every experiment runs XLA:CPU's Eigen convolutions rather than YNNPACK's
(``capsjax.prefer_eigen_convolutions``), set here, before any of them can
start JAX's backend.
"""

from capsjax.conv import dispatch

dispatch.prefer_eigen_convolutions()
