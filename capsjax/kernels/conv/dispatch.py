"""Which convolution kernel XLA:CPU runs, and the lowering conv2d picks there.

jaxlib 0.10's XLA:CPU hands every convolution large enough (a 3x3
64 -> 64 one on 26x26 is; 8x8x8 is not) to a YNNPACK fusion, which runs
several times slower than XLA's Eigen convolution on the capsule models'
layers, forward and backward (BENCHMARKS.md, the CPU convolution kernels).

``prefer_eigen_convolutions`` turns the YNNPACK convolution fusion off
through XLA_FLAGS (``-individual_convolution``, which keeps YNNPACK's
other fusions). XLA reads XLA_FLAGS once, when JAX starts its backend, so
it must be called before that: the experiments' launcher, the benchmarks
and the tests call it first; a notebook calls
``capsjax.prefer_eigen_convolutions()`` before its first JAX computation
(``import capsjax`` changes nothing in the process). Afterwards
``ynn_convolutions`` asks the compiler what it actually does, and
``capsjax.kernels.conv2d`` picks its CPU lowering from the answer
(``cpu_conv_impl``), or oneDNN's convolution (``implementation='native'``)
where ``capsjax.kernels.conv.onednn`` is installed: faster than any of XLA's.
"""

from __future__ import annotations

import functools
import importlib.util
import mmap
import os

from capsjax import _jax_private

YNN_FUSION_FLAG = 'xla_cpu_experimental_ynn_fusion_type'
NO_YNN_CONVOLUTIONS = f'--{YNN_FUSION_FLAG}=-individual_convolution'
# The oldest jaxlib measured with the flag; an XLA that does not know a
# flag in XLA_FLAGS aborts the process, so older ones are left alone.
_MIN_JAXLIB = (0, 10)

_result: str | None = None


@functools.cache
def _jaxlib_version() -> tuple[int, ...]:
  import jaxlib  # pylint: disable=g-import-not-at-top
  parts = []
  for part in jaxlib.__version__.split('.')[:2]:
    digits = ''.join(c for c in part if c.isdigit())
    parts.append(int(digits or 0))
  return tuple(parts)


def jaxlib_knows_flag(flag: str) -> bool:
  """Whether jaxlib's XLA has the flag ``flag`` (its name without the
  dashes; an XLA that meets an unknown flag in XLA_FLAGS aborts the
  process): its name in the library, found by a memory-mapped search,
  ~10 ms from the page cache."""
  spec = importlib.util.find_spec('jaxlib')
  for folder in (spec.submodule_search_locations or []) if spec else []:
    library = os.path.join(folder, 'libjax_common.so')
    if os.path.exists(library):
      with open(library, 'rb') as f, mmap.mmap(
          f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(flag.encode()) >= 0
  return False


def backend_started() -> bool:
  """Whether JAX has created its backends (and so read XLA_FLAGS)."""
  return _jax_private.backends_started()


def prefer_eigen_convolutions() -> str:
  """Ask XLA:CPU for its Eigen convolutions instead of YNNPACK's; returns
  what was done, in words.

  Idempotent. Leaves XLA_FLAGS alone when it already names the YNNPACK
  fusion types (the user's choice: naming any in
  ``--xla_cpu_experimental_ynn_fusion_type`` keeps YNNPACK's
  convolutions), when the backend has started (too late to matter), or
  with jaxlib older than 0.10.
  """
  global _result
  if _result is not None:
    return _result
  flags = os.environ.get('XLA_FLAGS', '')
  if YNN_FUSION_FLAG in flags:
    _result = 'not applied: XLA_FLAGS already sets the YNNPACK fusion types'
  elif backend_started():
    _result = 'not applied: the JAX backend had already started'
  elif (_jaxlib_version() < _MIN_JAXLIB
        or not jaxlib_knows_flag(YNN_FUSION_FLAG)):
    _result = ('not applied: this jaxlib (older than 0.10, or without the '
               'flag) is left alone')
  else:
    os.environ['XLA_FLAGS'] = f'{flags} {NO_YNN_CONVOLUTIONS}'.strip()
    _result = f'applied (XLA_FLAGS {NO_YNN_CONVOLUTIONS})'
  return _result


@functools.cache
def ynn_convolutions() -> bool:
  """Whether this process's XLA:CPU compiles a 3x3 64 -> 64 convolution
  into a YNNPACK fusion (compiles one, once, and reads the HLO)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def conv(x, kernel):
    return jax.lax.conv_general_dilated(
        x, kernel, (1, 1), 'VALID', dimension_numbers=('NHWC', 'HWIO', 'NHWC'))

  compiled = jax.jit(conv).lower(
      jax.ShapeDtypeStruct((1, 26, 26, 64), jnp.float32),
      jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.float32)).compile()
  return 'ynn_fusion' in compiled.as_text()


# Below this many input channels (after the space-to-depth regrouping of a
# strided convolution) the Eigen convolution runs far from peak and one
# product over patches is faster: the 9x9 1 -> 256 first layer of the paper
# CapsNet at batch 64 trains in 83 ms as patches and 167 ms direct; at 64
# channels and more direct wins (Su's 3x3 64 -> 64: 72 against 138 ms).
# With the patches channel-major (lowerings.narrow_conv) that layer's forward
# and gradients at batch 128 take 59-61 ms against 103-116 as patches.
NARROW_BELOW_CHANNELS = 16
# The input gradient of a direct convolution is a convolution over the
# whole (padded) input: input positions / output positions times the
# forward's work. At 2.8 (PrimaryCaps: 10x10 regrouped input, 6x6 output)
# the paper CapsNet trains at 0.65 of PyTorch's speed direct, 0.78 as
# patches and 1.04 as taps (batch 64). Stride 1 has its own threshold:
TAPS_ABOVE_INPUT_RATIO = 2.0
# Stride 1: XLA's input gradient is a convolution over the cotangent padded
# by Kh-1, Kw-1, so it multiplies the padding's zeros too: input / output
# positions times the needed work. Above 1.4 (Su's 3x3 layers on 12x12 and
# 10x10: 1.44 and 1.56) taps train faster, alone at batch 128 32.8 against
# 38.0 ms and 45.4 against 48.9 (PyTorch 31.6, 39.7); at 1.17 (Su's 26x26
# layer) slower, 110.6 against 101.7; and at 1.31 (the baseline CNN's 5x5
# SAME layers of 256 channels: 25 taps) the whole step took 6.0 s against
# 4.3 s (BENCHMARKS.md).
STRIDE1_TAPS_ABOVE_INPUT_RATIO = 1.4
# Below this many input channels the taps' Kh*Kw products and in-place adds
# are many small kernels whose fixed costs dominate: the CI's 8-channel
# CapsNet took 15.9 s for its attacks with PrimaryCaps as taps against 1.1
# s as patches. The paper CapsNet's PrimaryCaps has 256.
TAPS_MIN_CHANNELS = 64


# oneDNN's convolutions (capsjax.kernels.conv.onednn, where installed) beat XLA's
# lowerings on the convolutions of the shipped models, forward and both
# gradients at batch 64 and 128 (BENCHMARKS.md): 0.17-0.74 of
# XLA's time on the images' narrow first layers, 0.40-0.41 on the smoke
# CapsNet's PrimaryCaps, 0.80-0.83 on the baseline CNN's 5x5 SAME layers;
# Su's 3x3 layers trained 1.19-1.23x as fast as PyTorch with them against
# 0.93-1.00. The exception is a strided convolution whose XLA
# choice is taps, the paper CapsNet's PrimaryCaps: 1.01-1.10 of the taps'
# time. XLA's forward and kernel gradient with oneDNN's input gradient
# took 0.96 of it at batch 128 and 1.03 at 64.
def cpu_conv_impl(in_channels: int, stride: int, in_positions: int,
                  out_positions: int, onednn: bool = False,
                  bfloat16: bool = False) -> str:
  """conv2d's lowering on the CPU backend.

  Args:
    in_channels: input channels of the convolution.
    stride: its stride.
    in_positions: H * W of its (padded) input.
    out_positions: H' * W' of its output.
    onednn: whether ``capsjax.kernels.conv.onednn`` is available and computes this
      convolution (float32, or bfloat16 on a CPU with bfloat16
      instructions; a non-empty batch).
    bfloat16: whether its operands are bfloat16.
  Returns:
    With oneDNN: 'onednn', except in float32 'onednn_input_grad' where
    XLA's choice would be strided taps (XLA's float32 forward and kernel
    gradient are the faster there: the comment above; its bfloat16
    convolutions are slower than its float32 ones, oneDNN's faster).
    Without: 'patches' where XLA:CPU's
    convolutions are YNNPACK's (their backward passes are slow); 'narrow'
    where the regrouped input is narrow; where the input gradient as a
    convolution would cover many more positions than the output, 'taps'
    (64 input channels and more; at stride 1 from 1.4 times the output's
    positions, strided from 2 times) or 'patches'; else 'space_to_depth'
    (a direct convolution after the regrouping; for stride 1 the direct
    convolution itself).
  """
  xla = _xla_conv_impl(in_channels, stride, in_positions, out_positions)
  if not onednn:
    return xla
  if xla == 'taps' and stride > 1 and not bfloat16:
    return 'onednn_input_grad'
  return 'onednn'


def _xla_conv_impl(in_channels: int, stride: int, in_positions: int,
                   out_positions: int) -> str:
  """cpu_conv_impl's choice among XLA's lowerings."""
  if ynn_convolutions() or _jaxlib_version() < _MIN_JAXLIB:
    return 'patches'
  if stride * stride * in_channels < NARROW_BELOW_CHANNELS:
    return 'narrow'
  wide = in_channels >= TAPS_MIN_CHANNELS
  if (stride == 1 and wide and
      in_positions > STRIDE1_TAPS_ABOVE_INPUT_RATIO * out_positions):
    return 'taps'
  if in_positions > TAPS_ABOVE_INPUT_RATIO * stride * stride * out_positions:
    return 'taps' if wide and stride > 1 else 'patches'
  return 'space_to_depth'
