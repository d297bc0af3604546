"""Large bfloat16 matrix products through oneDNN on the CPU.

XLA:CPU's bfloat16 products of large matrices run slower than its float32
ones (the baseline CNN's first dense layer, [B, 100352] @ [100352, 328]),
while oneDNN's bfloat16 matmul runs faster than either on a CPU with
bfloat16 instructions. ``dot_general`` is ``lax.dot_general`` that sends
such products to oneDNN (``matmul``: ``onednn.matmul`` with its
gradients), for a dense layer's ``dot_general``
(``nnx.Linear(..., dot_general=conv.dot_general)``) and for the votes of
a capsule layer whose transform every input shares
(``votes.shared_vector_votes``: Su's capsule model, [B*I, 128] @ [128,
160], whose bfloat16 votes XLA computed in float32).
Smaller products stay XLA's (``ONEDNN_MIN_MACS``): XLA's bfloat16 products
of the other capsule models' shapes (the CapsNet decoder) run about as fast
as its float32 ones. ``sum_rows_float32`` is the bias gradients' sum.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from capsjax.kernels import implementations
from capsjax.kernels.conv import onednn

# Products of at least this many multiply-adds go to oneDNN. The baseline
# CNN's first dense layer (2.6e8 at batch 8; its 33M weights make it
# memory-bound) ran several times faster by oneDNN than as XLA's bfloat16
# product; the CapsNet decoder's largest (5.1e7 at batch 64) ran faster as
# XLA's.
ONEDNN_MIN_MACS = 2**26


def _is_dense(lhs: jax.Array, rhs: jax.Array, dimension_numbers) -> bool:
  """Whether the product is a dense layer's: lhs [..., K] with rhs [K, N],
  no batch axes."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  return (rhs.ndim == 2 and lhs.ndim >= 1 and not lhs_batch and
          not rhs_batch and tuple(lhs_contract) == (lhs.ndim - 1,) and
          tuple(rhs_contract) == (0,))


def _onednn_bfloat16(dtype) -> bool:
  """Whether ``dtype`` is bfloat16, on the CPU, where oneDNN computes
  bfloat16 (``onednn.bf16_status``)."""
  return (jnp.dtype(dtype) == jnp.bfloat16 and
          jax.default_backend() == 'cpu' and
          not implementations.forced_xla() and onednn.computes(jnp.bfloat16))


def uses_onednn(lhs_shape, rhs_shape, dtype) -> bool:
  """Whether ``dot_general`` computes a dense product of lhs [..., K] and
  rhs [K, N] in ``dtype`` by oneDNN: bfloat16, where oneDNN computes
  bfloat16 (``onednn.bf16_status``), on the CPU, and large."""
  macs = math.prod(lhs_shape) * rhs_shape[-1]
  return macs >= ONEDNN_MIN_MACS and _onednn_bfloat16(dtype)


@jax.custom_vjp
def matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """x [M, K] @ kernel [K, N] by oneDNN, both float32 or both bfloat16, in
  their dtype (summed in float32). Differentiable: the input gradient is
  oneDNN's cotangent @ kernel^T, the kernel gradient x^T @ cotangent summed
  in float32 and rounded once to the kernel's dtype."""
  return onednn.matmul(x, kernel)


def _matmul_forward(x, kernel):
  return matmul(x, kernel), (x, kernel)


def _matmul_backward(residuals, cotangent):
  x, kernel = residuals
  cotangent = cotangent.astype(x.dtype)
  return (onednn.matmul(cotangent, kernel, transpose_b=True),
          onednn.matmul(x, cotangent, transpose_a=True,
                        out_dtype=jnp.float32).astype(kernel.dtype))


matmul.defvjp(_matmul_forward, _matmul_backward)


def sum_rows_float32(x: jax.Array) -> jax.Array:
  """x [..., F] summed over every axis but the last, in float32: [F].

  A bfloat16 x on a CPU where oneDNN computes bfloat16 is summed by
  oneDNN's matmul of a row of ones with x [N, F] (float32 accumulation and
  result), which reads x once as it is. XLA's float32 sum of a bfloat16
  array instead fused the conversion into the array's producer, wrote a
  float32 copy of it (twice the bytes) and converted that back for the
  array's other consumers. With oneDNN's sums (and its votes product) Su's
  capsule model's bfloat16 step ran 1.11x faster at batch 128, the paper
  CapsNet's 1.08x (BENCHMARKS.md).
  """
  if _onednn_bfloat16(x.dtype):
    rows = x.reshape(-1, x.shape[-1])
    ones = jnp.ones((1, rows.shape[0]), x.dtype)
    return onednn.matmul(ones, rows, out_dtype=jnp.float32)[0]
  return jnp.sum(x.astype(jnp.float32), axis=tuple(range(x.ndim - 1)))


def dot_general(lhs, rhs, dimension_numbers, precision=None,
                preferred_element_type=None, **kwargs) -> jax.Array:
  """``jax.lax.dot_general``, except that a large bfloat16 dense product
  (lhs [..., K], rhs [K, N]; ``uses_onednn``) is oneDNN's ``matmul``."""
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  if (lhs.dtype == rhs.dtype and preferred_element_type in (None, lhs.dtype)
      and _is_dense(lhs, rhs, dimension_numbers) and
      uses_onednn(lhs.shape, rhs.shape, lhs.dtype) and
      kwargs.get('out_sharding') is None):
    k, n = rhs.shape
    out = matmul(lhs.reshape(-1, k), rhs)
    return out.reshape(lhs.shape[:-1] + (n,))
  return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                             preferred_element_type=preferred_element_type,
                             **kwargs)
