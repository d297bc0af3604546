"""EM routing of convolutional capsule windows as one fused CPU kernel.

``matrix_capsules.conv_capsule_routing`` routes every K x K window of child
capsules on its own (unless an E-step normaliser couples the windows). On a
CPU the fastest way to do that is one window at a time, its votes computed
from the window's poses and kept in the core's cache through every pass of
every iteration, forward and backward: ``csrc/em_routing.cc``, an XLA FFI
call compiled on first use with the machine's C++ compiler (about 3 s, once
per source, jaxlib version and CPU, into ``$CAPSJAX_CACHE_DIR``, else
``~/.cache/capsjax``). Its gradient is a second call that recomputes each
window's forward pass and applies the hand-derived reverse of every step;
the tests check both against a float64 NumPy reference and against
``jax.grad`` of ``routing.em_routing``.

It computes what ``routing.em_routing(votes.matrix_votes(poses, w), ...)``
computes for one window, with the options that route windows on their own:
both activation forms, ``normalize_cost``, ``center_momentum`` and any
``variance_epsilon``, for 4 x 4 poses in float32 or float64 (bfloat16 poses
and transforms, as in mixed precision, are multiplied and routed in
float32: the votes are never stored, so there is no memory to save by
rounding them). It is first-order differentiable (no Hessians: route with
``implementation='xla'`` for those). Without a compiler conv capsule
layers route through XLA; ``status()`` says why.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from capsjax import routing
from capsjax.kernels import native

_SOURCE = pathlib.Path(__file__).parent / 'csrc' / 'em_routing.cc'
_TARGETS = ('EmConvRoutingForward', 'EmConvRoutingBackward')
POSE_SIDE = 4


def _cpu_key() -> str:
  """What ``-march=native`` compiles for: the CPU's model and flags."""
  try:
    lines = pathlib.Path('/proc/cpuinfo').read_text().splitlines()
  except OSError:
    return os.uname().machine
  wanted = ('model name', 'flags')
  return '\n'.join(sorted({line for line in lines
                           if line.split(':')[0].strip() in wanted}))


@functools.cache
def _load() -> tuple[bool, str]:
  """(whether the kernel is registered, why or why not), once per process."""
  try:
    march = native.arch()
    library = native.build(_SOURCE, 'capsjax_em_routing_',
                           ['-O3', f'-march={march}', '-ffp-contract=fast',
                            '-fno-math-errno'],
                           [_cpu_key()] if march == 'native' else [])
    lib = ctypes.CDLL(str(library))
    for name in _TARGETS:
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)),
                                  platform='cpu')
  except (OSError, RuntimeError, AttributeError) as error:
    return False, f'not available: {error}'
  return True, (f'in use (conv capsule routing on the CPU; built for '
                f'-march={march})')


def available() -> bool:
  """Whether the fused kernel is built, loaded and registered."""
  return _load()[0]


def status() -> str:
  """What this process does with the fused EM kernel, in words."""
  return _load()[1]


def unsupported(pose_side: int, dtype, *, normalizer: bool, released: bool,
                remat_iterations: bool) -> str:
  """Why the kernel cannot route these windows ('' when it can)."""
  if jax.default_backend() != 'cpu':
    return f'it runs on the CPU only (backend: {jax.default_backend()})'
  if jax.device_count() > 1:
    return (f'it routes on one device (this process has '
            f'{jax.device_count()})')
  if pose_side != POSE_SIDE:
    return f'it takes 4 x 4 poses, not {pose_side} x {pose_side}'
  if jnp.dtype(dtype) not in (jnp.float32, jnp.float64, jnp.bfloat16):
    return (f'it routes float32, float64 or bfloat16 poses, not '
            f'{jnp.dtype(dtype)}')
  if normalizer or released:
    return ('an E-step normaliser across windows (released or '
            'normalize_across_positions) couples the windows')
  if remat_iterations:
    return 'remat_iterations applies to the XLA routing only'
  if not available():
    return f'the kernel is {status()}'
  return ''


def _attributes(em_routing: routing.EMRouting
                ) -> tuple[tuple[str, np.generic], ...]:
  """The kernel's FFI attributes of ``em_routing`` (hashable: a static
  argument of the custom VJP)."""
  return (('iterations', np.int64(em_routing.num_iterations)),
          ('authors_form', np.int64(em_routing.activation_form == 'authors')),
          ('normalize_cost', np.int64(bool(em_routing.normalize_cost))),
          ('center_momentum', np.float64(em_routing.center_momentum)),
          ('variance_epsilon', np.float64(em_routing.variance_epsilon)),
          ('mass_epsilon', np.float64(routing.MASS_EPSILON)),
          ('cost_std_epsilon', np.float64(routing.COST_STD_EPSILON)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _route(poses, activations, weights, beta_u, beta_a, lambdas, attributes):
  num, num_in = activations.shape
  num_out = weights.shape[1]
  dtype = poses.dtype
  shapes = (jax.ShapeDtypeStruct((num, num_out, POSE_SIDE**2), dtype),
            jax.ShapeDtypeStruct((num, num_out), dtype),
            jax.ShapeDtypeStruct((num, num_in, num_out), dtype))
  return jax.ffi.ffi_call('EmConvRoutingForward', shapes,
                          vmap_method='sequential')(
      poses, activations, weights, beta_u, beta_a, lambdas, **dict(attributes))


def _route_forward(poses, activations, weights, beta_u, beta_a, lambdas,
                   attributes):
  return (_route(poses, activations, weights, beta_u, beta_a, lambdas,
                 attributes),
          (poses, activations, weights, beta_u, beta_a, lambdas))


def _route_backward(attributes, residuals, cotangents):
  poses = residuals[0]
  cotangents = tuple(jnp.asarray(c, poses.dtype) for c in cotangents)
  shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in residuals)
  return jax.ffi.ffi_call('EmConvRoutingBackward', shapes,
                          vmap_method='sequential')(
      *residuals, *cotangents, **dict(attributes))


_route.defvjp(_route_forward, _route_backward)


def check_window_shapes(kernel: str, poses: jax.Array,
                        activations: jax.Array, weights: jax.Array) -> None:
  """ValueError, naming ``kernel``, unless poses are [N, I, 4, 4],
  activations [N, I] and weights [I, O, 4, 4] (the window kernels' inputs,
  this one's and ``pallas_em``'s)."""
  if (poses.ndim != 4 or poses.shape[2:] != (POSE_SIDE, POSE_SIDE)
      or activations.shape != poses.shape[:2] or weights.ndim != 4
      or weights.shape[0] != poses.shape[1]
      or weights.shape[2:] != (POSE_SIDE, POSE_SIDE)):
    raise ValueError(
        f'{kernel}: poses [N, I, 4, 4] = {poses.shape}, activations [N, I] = '
        f'{activations.shape} and weights [I, O, 4, 4] = {weights.shape} do '
        f'not match.')


def route_windows(poses, activations, weights, beta_u, beta_a,
                  num_iterations: int | None = None, *,
                  em_routing: routing.EMRouting | None = None, **fields
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """EM routing of N independent windows, their votes V_io = M_i W_io.

  Computes ``routing.em_routing(votes.matrix_votes(poses, weights),
  activations, beta_u, beta_a, em_routing=em_routing)``.

  Args:
    poses: [N, I, 4, 4] each window's child poses M_i.
    activations: [N, I] their activations.
    weights: [I, O, 4, 4] transforms W_io, shared by the windows.
    beta_u, beta_a: broadcastable to [O].
    num_iterations, em_routing, fields: the routing, as
      ``routing.em_routing``'s ``num_iterations``, ``options`` and
      ``fields`` (``released`` and the conv-only fields are not the
      kernel's: ``unsupported`` says so).
  Returns:
    (poses [N, O, 16], activations [N, O], assignments [N, I, O]), float64
    for float64 inputs, else float32 (bfloat16 poses are routed in
    float32).
  """
  if not available():
    raise RuntimeError(f'EM routing kernel: {status()}')
  em_routing = routing.with_overrides(em_routing, num_iterations, **fields)
  if em_routing.released or em_routing.normalize_across_positions:
    raise ValueError('EM routing kernel: it routes each window on its own, '
                     'without the released path or normalize_across_positions.')
  poses, activations = jnp.asarray(poses), jnp.asarray(activations)
  weights = jnp.asarray(weights)
  check_window_shapes('EM routing kernel', poses, activations, weights)
  dtype = jnp.promote_types(poses.dtype, jnp.float32)
  num_out = weights.shape[1]
  cast = lambda x: jnp.broadcast_to(jnp.asarray(x, dtype), (num_out,))  # noqa: E731
  lambdas = routing.inverse_temperatures(em_routing.inverse_temperature,
                                          em_routing.num_iterations, dtype)
  return _route(poses.astype(dtype), activations.astype(dtype),
                weights.astype(dtype), cast(beta_u), cast(beta_a), lambdas,
                _attributes(em_routing))
