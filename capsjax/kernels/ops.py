"""The operations with more than one implementation, each choosing one.

Each function takes ``implementation`` (``implementations``: None, the
fastest that can take the case; or 'xla', 'native', 'pallas' where the
operation has it) and computes what its definition in ``capsjax.routing``
(or XLA's convolution) computes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from capsjax.kernels import em_cpu
from capsjax.kernels import implementations
from capsjax.kernels.conv import lowerings
from capsjax.routing import dynamic
from capsjax.routing import em
from capsjax.routing import matrix_capsules


def _pallas_dynamic():
  """``pallas_dynamic``, imported on first use: Pallas and its Triton
  backend load only where implementation='pallas' asks for them."""
  from capsjax.kernels import pallas_dynamic
  return pallas_dynamic


def _pallas_em():
  """``pallas_em``, imported on first use (as ``_pallas_dynamic``)."""
  from capsjax.kernels import pallas_em
  return pallas_em


def dynamic_routing(
    votes: ArrayLike,
    num_iterations: int = 3,
    *,
    accumulate: bool = True,
    leaky: bool = False,
    squash_constant: float = 1.0,
    bias: ArrayLike | None = None,
    normalize_agreement: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
  """``capsjax.routing.dynamic_routing`` by the chosen implementation.

  Every argument but ``implementation`` is that function's.

  Args:
    implementation: None or 'xla' (XLA, the default), or 'pallas' (fused
      Pallas kernels, ``pallas_dynamic``: Triton on GPUs, interpreted
      elsewhere; first-order gradients only).
  Returns:
    (outputs [..., O, D], coupling [..., I, O]), as
    ``capsjax.routing.dynamic_routing``.
  """
  chosen = implementations.choose('dynamic_routing', implementation,
                                  {'pallas': lambda: ''})
  route = (_pallas_dynamic().dynamic_routing if chosen == 'pallas'
           else dynamic.dynamic_routing)
  return route(votes, num_iterations, accumulate=accumulate, leaky=leaky,
               squash_constant=squash_constant, bias=bias,
               normalize_agreement=normalize_agreement)


def conv_capsule_routing(
    poses: ArrayLike, activations: ArrayLike, weights: ArrayLike,
    beta_u: ArrayLike, beta_a: ArrayLike, *, stride: int,
    em_routing: em.EMRouting | None = None, votes_dtype=None,
    remat_iterations: bool = False, window_chunk: int | None = None,
    implementation: str | None = None, **fields
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``capsjax.routing.matrix_capsules.conv_capsule_routing`` by the chosen
  implementation.

  Every argument but ``implementation`` is that function's.

  Args:
    implementation: 'native' routes the windows with the fused CPU kernel
      (``em_cpu.route_windows``: votes and routing window by window in the
      core's cache, forward and backward), 'pallas' with the Pallas kernel
      (``pallas_em.route_windows``: window by window on chip, interpreted
      on a CPU), 'xla' through XLA in ``window_chunk`` chunks; None picks
      the CPU kernel where it can route the windows (``em_cpu.unsupported``
      says why not) and ``window_chunk`` is None, else XLA (never
      'pallas'). ``window_chunk`` applies to XLA only.
  Returns:
    (poses [B, H', W', Cout, P, P], activations [B, H', W', Cout],
    assignments [B, H', W', I, Cout]).
  """
  em_routing = em.with_overrides(em_routing, **fields)
  pose_side = jnp.shape(weights)[-1]
  dtype = votes_dtype or jnp.asarray(poses).dtype
  coupled = em_routing.released or em_routing.normalize_across_positions

  def native_why_not() -> str:
    if implementation is None and window_chunk is not None:
      return 'window_chunk is set (it chunks the XLA routing)'
    return em_cpu.unsupported(pose_side, dtype, normalizer=coupled,
                              released=em_routing.released,
                              remat_iterations=remat_iterations)

  chosen = implementations.choose(
      'conv_capsule_routing', implementation,
      {'native': native_why_not,
       'pallas': lambda: _pallas_em().unsupported(
           pose_side, normalizer=coupled, released=em_routing.released,
           remat_iterations=remat_iterations)})
  route_windows = (em_cpu.route_windows if chosen == 'native'
                   else _pallas_em().route_windows if chosen == 'pallas'
                   else None)
  return matrix_capsules.conv_capsule_routing(
      poses, activations, weights, beta_u, beta_a, stride=stride,
      em_routing=em_routing, votes_dtype=votes_dtype,
      remat_iterations=remat_iterations, window_chunk=window_chunk,
      route_windows=route_windows)


def conv2d(x: ArrayLike, kernel: ArrayLike, stride: int = 1,
           padding: str = 'VALID', implementation: str | None = None
           ) -> jax.Array:
  """2-D convolution, NHWC, by the chosen implementation.

  Args:
    x: [B, H, W, C].
    kernel: [Kh, Kw, C, F].
    stride: the same stride along both axes.
    padding: 'VALID' or 'SAME' (XLA's convention).
    implementation: 'native' (oneDNN's convolution, the ``onednn`` extra,
      on the CPU: float32, or bfloat16), 'xla' (XLA's, by the lowering
      ``conv.dispatch.cpu_conv_impl`` picks on the CPU; direct elsewhere);
      None: 'native' where oneDNN is available and, for bfloat16, the CPU
      has bfloat16 instructions (``onednn.bf16_status``), else 'xla'.
  Returns:
    [B, H', W', F].
  """
  x, kernel = jnp.asarray(x), jnp.asarray(kernel)
  lowerings.check_conv2d(x, kernel, padding)
  chosen = implementations.choose(
      'conv2d', implementation,
      {'native': lambda: lowerings.onednn_why_not(
          x, kernel, stride, padding, for_speed=implementation is None)})
  lowering = lowerings.default_lowering(x, kernel, stride, padding,
                                        native=chosen == 'native')
  return lowerings.conv2d(x, kernel, stride, padding, lowering)
