"""Convolution backends: the lowerings ``capsjax.kernels.conv2d`` chooses from.

- ``lowerings``: XLA lowerings of a convolution (patches,
  narrow, taps, space-to-depth, direct) with their custom gradients;
- ``dispatch``: which lowering a CPU convolution takes, and XLA:CPU's
  YNNPACK setting (``prefer_eigen_convolutions``);
- ``onednn``: oneDNN's convolutions and matrix product through XLA's FFI
  (the ``onednn`` extra), built from ``csrc/`` on first use;
- ``products``: ``dot_general``, which sends large bfloat16 dense products
  to oneDNN (for dense layers' ``dot_general``).
The capsule layers (``capsjax.layers``) only call ``capsjax.kernels.conv2d``.
"""

import jax

from capsjax.kernels.conv import onednn
from capsjax.kernels.conv import products
from capsjax.kernels.conv.lowerings import LOWERINGS
from capsjax.kernels.conv.lowerings import eigen_conv
from capsjax.kernels.conv.lowerings import narrow_conv
from capsjax.kernels.conv.lowerings import onednn_input_grad_conv
from capsjax.kernels.conv.lowerings import patches_conv
from capsjax.kernels.conv.lowerings import space_to_depth_conv
from capsjax.kernels.conv.lowerings import taps_conv
from capsjax.kernels.conv.products import dot_general


def backend() -> str:
  """Which convolutions this process runs, in words: 'oneDNN' or 'XLA', and
  why not oneDNN on the CPU, for float32 and for bfloat16, and the
  instruction set of oneDNN's kernels (for the run's header, summary and
  benchmark rows), e.g. 'oneDNN (float32 by avx512_core_bf16 kernels;
  bfloat16 by oneDNN (avx512_core_bf16); XLA for other dtypes)'."""
  platform = jax.default_backend()
  if platform != 'cpu':
    return f'XLA ({platform})'
  if not onednn.available():
    return f'XLA (oneDNN {onednn.status()})'
  _, bf16 = onednn.bf16_status()
  return (f'oneDNN (float32 by {onednn.cpu_isa()} kernels; bfloat16 by '
          f'{bf16}; XLA for other dtypes)')


__all__ = (
    'LOWERINGS',
    'backend',
    'dot_general',
    'eigen_conv',
    'narrow_conv',
    'onednn_input_grad_conv',
    'patches_conv',
    'products',
    'space_to_depth_conv',
    'taps_conv',
)
