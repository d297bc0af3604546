"""Dynamic routing as fused Pallas kernels: Triton on GPUs, interpreted on CPUs.

``routing.dynamic_routing`` in XLA materialises the [..., I, O] logits and
re-reads the votes in many separate fusions. This module computes the same
routing (Sabour et al. 2017, Procedure 1, with every option of
``routing.dynamic_routing``) with one pass over the votes per iteration and a
state of [O, D] per example, because the logits never need storing: with
b = 0 at the start and b += <u_hat_i, target_t>, the logits of iteration t are

    b_ti = <u_hat_i, A_t>,  A_t [O, D] = sum_{k<t} target_k (accumulate)
                                       or target_{t-1}  (accumulate=False),

where target = squash(s), or s / |s| with ``normalize_agreement``. So each
iteration streams the votes in blocks of input capsules, computing
b = <u_hat, A>, c = softmax_O(b) and s += sum_i c u_hat; then
v = squash(s [+ bias]) and A is updated. The last pass also writes the
coupling c [I, O].

The gradient (``jax.custom_vjp``) is a reverse sweep: from the saved s_t
([T, O, D] per example) the kernel recomputes every A_t, then for t = T-1..1
one pass over the votes recomputes c_t and accumulates

    dA_t = sum_i db_ti u_hat_i,   db_ti = c_ti * (dc_ti - <c_ti, dc_ti>_O),
    dc_ti = <u_hat_i, ds_t> (+ the coupling's cotangent at t = T-1),

whose total (plus dA_{t+1} when accumulating) is the cotangent of target_{t-1},
hence of s_{t-1}. A final pass writes

    d u_hat_i = sum_t (c_ti ds_t + db_ti A_t).

The bias's cotangent is sum_t ds_t. The reverse sweep is first-order only
(no Hessians: route with implementation='xla' for those).

Every kernel is one program per example (the flattened leading dims), the
input capsules in blocks of ``block_inputs``, O and D padded to powers of two
inside the kernel (Triton's block shapes must be powers of two) by masked
loads and stores: no padded copy of the votes is made. Compute is float32
(float64 for float64 votes); bfloat16 votes are read as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.typing import ArrayLike

from capsjax import routing

# Input capsules per block: a [16, 16, 16] float32 tile of the paper's
# DigitCaps votes (O = 10 and D = 16 padded to 16) is 32 registers per
# thread of 4 warps; the backward pass's last sweep holds a few such tiles
# (the votes, their cotangent, products). Triton 3.8's build for sm_80
# takes 125 registers a thread forward and 149 backward, no spills (ptxas
# -v; sm_90a: 123 and 148). Compile statistics only (routing_kernels.py
# --ptxas), not tuned on a GPU yet (--block_inputs sweeps it).
DEFAULT_BLOCK_INPUTS = 16
NUM_WARPS = 4
# Triton software-pipelines the loop over input blocks: the next block's
# load is issued while the current one is reduced.
NUM_STAGES = 2


def _next_power_of_2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static description of one routing problem (hashable: a custom_vjp
  non-differentiable argument)."""
  num_in: int
  num_out: int
  dim: int
  num_iterations: int
  accumulate: bool
  leaky: bool
  squash_constant: float
  normalize_agreement: bool
  block_inputs: int
  interpret: bool

  @property
  def out_pad(self) -> int:
    return _next_power_of_2(self.num_out)

  @property
  def dim_pad(self) -> int:
    return _next_power_of_2(self.dim)

  @property
  def num_blocks(self) -> int:
    return pl.cdiv(self.num_in, self.block_inputs)


# ----------------------------------------------------------------------------
# Per-block math, traced inside the kernels. u: [BI, Op, Dp] one block of
# votes (zero where padded), A, s: [Op, Dp], c, b: [BI, Op].


def _masks(cfg: _Config, block) -> tuple[jax.Array, jax.Array]:
  """(votes mask [BI, Op, Dp], coupling mask [BI, Op]) of input block
  ``block``: the real input capsules, outputs and dimensions."""
  rows = block * cfg.block_inputs + jnp.arange(cfg.block_inputs)
  rows_valid = rows < cfg.num_in
  outs_valid = jnp.arange(cfg.out_pad) < cfg.num_out
  dims_valid = jnp.arange(cfg.dim_pad) < cfg.dim
  coupling_mask = rows_valid[:, None] & outs_valid[None, :]
  return coupling_mask[:, :, None] & dims_valid[None, None, :], coupling_mask


def _block_index(cfg: _Config, block):
  return (pl.ds(block * cfg.block_inputs, cfg.block_inputs),
          pl.ds(0, cfg.out_pad))


def _load_votes(cfg: _Config, votes_ref, block, dtype) -> jax.Array:
  """Votes of input block ``block``: [BI, Op, Dp] in the compute dtype."""
  votes_mask, _ = _masks(cfg, block)
  rows, outs = _block_index(cfg, block)
  u = plt.load(votes_ref.at[rows, outs, pl.ds(0, cfg.dim_pad)],
               mask=votes_mask, other=0)
  return u.astype(dtype)


def _load_small(cfg: _Config, ref, dtype) -> jax.Array:
  """A per-example [O, D] array (bias) padded to [Op, Dp] with zeros."""
  mask = ((jnp.arange(cfg.out_pad) < cfg.num_out)[:, None]
          & (jnp.arange(cfg.dim_pad) < cfg.dim)[None, :])
  return plt.load(ref.at[pl.ds(0, cfg.out_pad), pl.ds(0, cfg.dim_pad)],
                  mask=mask, other=0).astype(dtype)


def _coupling(cfg: _Config, u: jax.Array, base: jax.Array | None
              ) -> jax.Array:
  """c = softmax over the real outputs of b = <u, A> ([BI, Op]; 0 on padded
  outputs). ``base`` None is A_0 = 0: the uniform coupling."""
  outs_valid = (jnp.arange(cfg.out_pad) < cfg.num_out)[None, :]
  if base is None:
    uniform = 1.0 / (cfg.num_out + int(cfg.leaky))
    shape = (cfg.block_inputs, cfg.out_pad)
    return jnp.where(outs_valid, jnp.full(shape, uniform, u.dtype), 0.0)
  logits = jnp.sum(u * base[None], axis=-1)
  logits = jnp.where(outs_valid, logits, -jnp.inf)
  peak = jnp.max(logits, axis=-1, keepdims=True)
  if cfg.leaky:  # the orphan logit 0 joins the softmax
    peak = jnp.maximum(peak, 0.0)
  weights = jnp.where(outs_valid, jnp.exp(logits - peak), 0.0)
  total = jnp.sum(weights, axis=-1, keepdims=True)
  if cfg.leaky:
    total = total + jnp.exp(-peak)
  return weights / total


def _logit_cotangent(u: jax.Array, coupling: jax.Array, s_ct: jax.Array,
                     coupling_ct: jax.Array | None) -> jax.Array:
  """db = c * (dc - <c, dc>_O), dc = <u, ds> (+ the coupling's cotangent).

  The leaky softmax has the same Jacobian c_o (delta_oo' - c_o'): its extra
  logit is a constant.
  """
  c_ct = jnp.sum(u * s_ct[None], axis=-1)
  if coupling_ct is not None:
    c_ct = c_ct + coupling_ct
  return coupling * (c_ct - jnp.sum(coupling * c_ct, axis=-1, keepdims=True))


def _targets(cfg: _Config, s: jax.Array) -> jax.Array:
  """The vector the votes agree with: squash(s), or s / |s|."""
  if cfg.normalize_agreement:
    return s / routing.safe_norm(s, axis=-1, keepdims=True)
  return routing.squash(s, constant=cfg.squash_constant)


def _next_base(cfg: _Config, base: jax.Array | None, s: jax.Array
               ) -> jax.Array:
  """A_{t+1} from A_t and s_t."""
  target = _targets(cfg, s)
  if cfg.accumulate and base is not None:
    return base + target
  return target


def _squash(cfg: _Config, s: jax.Array) -> jax.Array:
  return routing.squash(s, constant=cfg.squash_constant)


# ----------------------------------------------------------------------------
# Forward kernel: one program per example.


def _forward_kernel(cfg: _Config, has_bias: bool, *refs) -> None:
  """votes [I, O, D] (, bias [O, D]) -> outputs [Op, Dp], coupling [I, O],
  sums [T, Op, Dp] (s_t after the bias: the backward pass's residuals)."""
  if has_bias:
    votes_ref, bias_ref, outputs_ref, coupling_ref, sums_ref = refs
  else:
    votes_ref, outputs_ref, coupling_ref, sums_ref = refs
  dtype = sums_ref.dtype
  tile = (cfg.block_inputs, cfg.out_pad, cfg.dim_pad)
  bias = (_load_small(cfg, bias_ref, dtype) if has_bias
          else jnp.zeros(tile[1:], dtype))
  base = None  # A_0 = 0
  for t in range(cfg.num_iterations):
    last = t == cfg.num_iterations - 1

    def block_sum(block, partial_sums, base=base, last=last):
      u = _load_votes(cfg, votes_ref, block, dtype)
      coupling = _coupling(cfg, u, base)
      if last:
        _, coupling_mask = _masks(cfg, block)
        plt.store(coupling_ref.at[_block_index(cfg, block)],
                  coupling.astype(coupling_ref.dtype), mask=coupling_mask)
      return partial_sums + coupling[:, :, None] * u

    # A [BI, Op, Dp] partial sum, reduced over its rows once after the pass:
    # the loop's body stays elementwise (a sum over the rows of every block
    # would cross threads).
    partial_sums = jax.lax.fori_loop(0, cfg.num_blocks, block_sum,
                                     jnp.zeros(tile, dtype))
    s = jnp.sum(partial_sums, axis=0) + bias
    sums_ref[t] = s
    if not last:
      base = _next_base(cfg, base, s)
  outputs_ref[...] = _squash(cfg, s).astype(outputs_ref.dtype)


def _call(cfg: _Config, kernel, inputs, out_shapes):
  """pallas_call over the examples (axis 0 of every input and output), each
  block the example's whole array (its axis 0 squeezed)."""
  def block_spec(shape):
    rest = len(shape) - 1
    return pl.BlockSpec((None,) + tuple(shape[1:]),
                        lambda n: (n,) + (0,) * rest)

  return pl.pallas_call(
      kernel,
      grid=(inputs[0].shape[0],),
      in_specs=[block_spec(x.shape) for x in inputs],
      out_specs=[block_spec(o.shape) for o in out_shapes],
      out_shape=out_shapes,
      compiler_params=plt.CompilerParams(num_warps=NUM_WARPS,
                                         num_stages=NUM_STAGES),
      interpret=cfg.interpret,
  )(*inputs)


def _forward(cfg: _Config, votes: jax.Array, bias: jax.Array | None):
  """votes [N, I, O, D], bias [N, O, D] or None -> (outputs [N, Op, Dp],
  coupling [N, I, O], sums [N, T, Op, Dp]) in the compute dtype."""
  dtype = jnp.promote_types(votes.dtype, jnp.float32)
  n = votes.shape[0]
  small = (cfg.out_pad, cfg.dim_pad)
  out_shapes = [
      jax.ShapeDtypeStruct((n,) + small, dtype),
      jax.ShapeDtypeStruct((n, cfg.num_in, cfg.num_out), dtype),
      jax.ShapeDtypeStruct((n, cfg.num_iterations) + small, dtype)]
  inputs = [votes] if bias is None else [votes, bias]
  kernel = functools.partial(_forward_kernel, cfg, bias is not None)
  return _call(cfg, kernel, inputs, out_shapes)


# ----------------------------------------------------------------------------
# Backward kernel: one program per example.


def _bases(cfg: _Config, sums: list[jax.Array]) -> list[jax.Array | None]:
  """[A_0 = None (zero), A_1, .., A_{T-1}] from the saved s_t."""
  bases = [None]
  for s in sums[:-1]:
    bases.append(_next_base(cfg, bases[-1], s))
  return bases


def _base_cotangent(cfg: _Config, votes_ref, coupling_ct_ref, base, s_ct,
                    dtype) -> jax.Array:
  """dA_t = sum_i db_ti u_i, one pass over the votes ([Op, Dp]).
  ``coupling_ct_ref``: the coupling's cotangent where t = T-1, else None."""
  def block_sum(block, partial_sums):
    u = _load_votes(cfg, votes_ref, block, dtype)
    coupling = _coupling(cfg, u, base)
    coupling_ct = None
    if coupling_ct_ref is not None:
      _, coupling_mask = _masks(cfg, block)
      coupling_ct = plt.load(coupling_ct_ref.at[_block_index(cfg, block)],
                             mask=coupling_mask, other=0).astype(dtype)
    logit_ct = _logit_cotangent(u, coupling, s_ct, coupling_ct)
    return partial_sums + logit_ct[:, :, None] * u

  # Reduced over the block's rows after the pass, as in the forward kernel.
  tile = (cfg.block_inputs, cfg.out_pad, cfg.dim_pad)
  return jnp.sum(jax.lax.fori_loop(0, cfg.num_blocks, block_sum,
                                   jnp.zeros(tile, dtype)), axis=0)


def _write_votes_cotangent(cfg: _Config, votes_ref, coupling_ct_ref,
                           votes_ct_ref, bases, s_cts, dtype) -> None:
  """d u_i = sum_t (c_ti ds_t + db_ti A_t), one pass over the votes."""
  last = cfg.num_iterations - 1

  def block_write(block, carry):
    u = _load_votes(cfg, votes_ref, block, dtype)
    votes_mask, coupling_mask = _masks(cfg, block)
    u_ct = jnp.zeros_like(u)
    for t, (base, s_ct) in enumerate(zip(bases, s_cts, strict=True)):
      coupling = _coupling(cfg, u, base)
      u_ct = u_ct + coupling[:, :, None] * s_ct[None]
      if base is None:  # A_0 = 0: its logits' cotangent meets a zero
        continue
      coupling_ct = None
      if t == last and coupling_ct_ref is not None:
        coupling_ct = plt.load(coupling_ct_ref.at[_block_index(cfg, block)],
                               mask=coupling_mask, other=0).astype(dtype)
      logit_ct = _logit_cotangent(u, coupling, s_ct, coupling_ct)
      u_ct = u_ct + logit_ct[:, :, None] * base[None]
    rows, outs = _block_index(cfg, block)
    plt.store(votes_ct_ref.at[rows, outs, pl.ds(0, cfg.dim_pad)],
              u_ct.astype(votes_ct_ref.dtype), mask=votes_mask)
    return carry

  jax.lax.fori_loop(0, cfg.num_blocks, block_write, 0)


def _backward_kernel(cfg: _Config, has_coupling_ct: bool, *refs) -> None:
  """votes [I, O, D], sums [T, Op, Dp], outputs_ct [Op, Dp] (, coupling_ct
  [I, O]) -> votes_ct [I, O, D], sums_ct [Op, Dp] = sum_t ds_t."""
  if has_coupling_ct:
    votes_ref, sums_ref, outputs_ct_ref, coupling_ct_ref = refs[:4]
  else:
    (votes_ref, sums_ref, outputs_ct_ref), coupling_ct_ref = refs[:3], None
  votes_ct_ref, sums_ct_ref = refs[-2:]
  dtype = sums_ref.dtype
  num_iterations = cfg.num_iterations
  sums = [sums_ref[t] for t in range(num_iterations)]
  bases = _bases(cfg, sums)
  s_cts = [None] * num_iterations
  _, squash_vjp = jax.vjp(functools.partial(_squash, cfg), sums[-1])
  (s_cts[-1],) = squash_vjp(outputs_ct_ref[...].astype(dtype))
  later_base_ct = None  # dA_{t+1} (accumulate: A_{t+1} = A_t + target_t)
  for t in range(num_iterations - 1, 0, -1):
    base_ct = _base_cotangent(
        cfg, votes_ref, coupling_ct_ref if t == num_iterations - 1 else None,
        bases[t], s_cts[t], dtype)
    if cfg.accumulate and later_base_ct is not None:
      base_ct = base_ct + later_base_ct
    # A_t = [A_{t-1} +] target(s_{t-1}).
    _, target_vjp = jax.vjp(functools.partial(_targets, cfg), sums[t - 1])
    (s_cts[t - 1],) = target_vjp(base_ct)
    later_base_ct = base_ct
  _write_votes_cotangent(cfg, votes_ref, coupling_ct_ref, votes_ct_ref, bases,
                         s_cts, dtype)
  sums_ct_ref[...] = sum(s_cts[1:], s_cts[0])


def _backward(cfg: _Config, votes, sums, outputs_ct, coupling_ct):
  """-> (votes_ct [N, I, O, D] in the votes' dtype, sums_ct [N, Op, Dp])."""
  inputs = [votes, sums, outputs_ct]
  if coupling_ct is not None:
    inputs.append(coupling_ct)
  out_shapes = [jax.ShapeDtypeStruct(votes.shape, votes.dtype),
                jax.ShapeDtypeStruct(outputs_ct.shape, sums.dtype)]
  kernel = functools.partial(_backward_kernel, cfg, coupling_ct is not None)
  return _call(cfg, kernel, inputs, out_shapes)


# ----------------------------------------------------------------------------
# custom_vjp and the public entry.


def _pad_small(cfg: _Config, x: jax.Array) -> jax.Array:
  """[N, O, D] -> [N, Op, Dp] with zeros (small arrays only)."""
  return jnp.pad(x, ((0, 0), (0, cfg.out_pad - cfg.num_out),
                     (0, cfg.dim_pad - cfg.dim)))


def _unpad_small(cfg: _Config, x: jax.Array) -> jax.Array:
  return x[:, :cfg.num_out, :cfg.dim]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _route(cfg: _Config, votes: jax.Array, bias: jax.Array | None):
  outputs, coupling, _ = _forward(cfg, votes, bias)
  return _unpad_small(cfg, outputs), coupling


def _route_forward(cfg: _Config, votes, bias):
  # symbolic_zeros=True wraps the primals: (value, perturbed).
  votes = votes.value
  bias = None if bias is None else bias.value
  outputs, coupling, sums = _forward(cfg, votes, bias)
  return (_unpad_small(cfg, outputs), coupling), (votes, sums, bias is None)


def _route_backward(cfg: _Config, residuals, cotangents):
  votes, sums, no_bias = residuals
  outputs_ct, coupling_ct = cotangents
  n = votes.shape[0]
  if isinstance(outputs_ct, jax.custom_derivatives.SymbolicZero):
    outputs_ct = jnp.zeros((n, cfg.num_out, cfg.dim), sums.dtype)
  # A coupling nobody differentiates is not read (no [N, I, O] of zeros).
  if isinstance(coupling_ct, jax.custom_derivatives.SymbolicZero):
    coupling_ct = None
  votes_ct, sums_ct = _backward(cfg, votes, sums,
                                _pad_small(cfg, outputs_ct), coupling_ct)
  return votes_ct, None if no_bias else _unpad_small(cfg, sums_ct)


_route.defvjp(_route_forward, _route_backward, symbolic_zeros=True)


def interpret_mode(interpret: bool | None) -> bool:
  """Whether the Pallas kernels run in Pallas' interpreter: as asked, else
  everywhere but on a GPU, where they compile. Without a GPU that is
  hundreds of times slower than XLA (30 s a CapsNet smoke step on a CPU),
  so an implicit choice says so once."""
  if interpret is not None:
    return bool(interpret)
  if jax.default_backend() == 'gpu':
    return False
  warnings.warn(
      "implementation='pallas' without a GPU runs the Pallas kernels "
      "in Pallas' interpreter, hundreds of times slower than XLA (it is for "
      "tests): on a CPU use the default (implementation=None).",
      stacklevel=3)
  return True


def dynamic_routing(
    votes: ArrayLike,
    num_iterations: int = 3,
    *,
    accumulate: bool = True,
    leaky: bool = False,
    squash_constant: float = 1.0,
    bias: ArrayLike | None = None,
    normalize_agreement: bool = False,
    interpret: bool | None = None,
    block_inputs: int = DEFAULT_BLOCK_INPUTS,
) -> tuple[jax.Array, jax.Array]:
  """``routing.dynamic_routing`` as fused Pallas kernels (forward and VJP).

  Same arguments, options and results as ``routing.dynamic_routing`` (see
  there and this module's docstring), plus:

  Args:
    votes: [..., I, O, D] predictions u_hat_j|i, any leading batch dims
      (flattened: one kernel program per example). float32, bfloat16 (read
      as is, routed in float32) or float64 (routed in float64).
    bias: optional, broadcastable to [..., O, D].
    interpret: run the kernels in Pallas' interpreter (None: on every
      backend but a GPU, so the function runs everywhere; compiled through
      Triton on GPUs).
    block_inputs: input capsules per block of a pass over the votes, a power
      of two (the tail block of an I that is not a multiple is masked).
  Returns:
    (outputs [..., O, D] in the votes' dtype, coupling [..., I, O] in the
    compute dtype). Both are differentiable (first order), the coupling too.
  """
  routing.check_iterations(num_iterations)
  votes = jnp.asarray(votes)
  if votes.ndim < 3:
    raise ValueError(
        f'votes must be [..., in_caps, out_caps, dim], got shape {votes.shape}.')
  if block_inputs < 1 or block_inputs != _next_power_of_2(block_inputs):
    raise ValueError(
        f'block_inputs must be a power of two, got {block_inputs!r}.')
  interpret = interpret_mode(interpret)
  batch_shape, (num_in, num_out, dim) = votes.shape[:-3], votes.shape[-3:]
  if math.prod(batch_shape) == 0:  # no example: a grid of no programs
    return routing.dynamic_routing(
        votes, num_iterations, accumulate=accumulate, leaky=leaky,
        squash_constant=squash_constant, bias=bias,
        normalize_agreement=normalize_agreement)
  cfg = _Config(num_in, num_out, dim, num_iterations, bool(accumulate),
                bool(leaky), float(squash_constant), bool(normalize_agreement),
                int(block_inputs), interpret)
  flat_votes = votes.reshape((-1, num_in, num_out, dim))
  flat_bias = None
  if bias is not None:
    compute_dtype = jnp.promote_types(votes.dtype, jnp.float32)
    flat_bias = jnp.broadcast_to(
        jnp.asarray(bias, compute_dtype), batch_shape + (num_out, dim)
    ).reshape((-1, num_out, dim))
  outputs, coupling = _route(cfg, flat_votes, flat_bias)
  return (outputs.reshape(batch_shape + (num_out, dim)).astype(votes.dtype),
          coupling.reshape(batch_shape + (num_in, num_out)))
