"""Benchmarks: ``python -m benchmarks.NAME``.

They time what the experiments run: XLA:CPU's Eigen convolutions rather than
YNNPACK's (``capsjax.prefer_eigen_convolutions``), set here, before any of
them can start JAX's backend.
"""

from capsjax.kernels.conv import dispatch

dispatch.prefer_eigen_convolutions()
