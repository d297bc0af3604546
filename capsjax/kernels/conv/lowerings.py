"""XLA lowerings of a 2-D convolution and ``conv2d``, which picks one.

XLA:CPU's own convolutions (and its strided backward pass) are slow for
some of the capsule models' layers; each lowering here computes the same
convolution and gradients differently (tests/test_layers.py checks every
one against a float64 direct convolution). ``default_lowering`` picks one
by ``dispatch.cpu_conv_impl`` on the CPU, oneDNN's
(``capsjax.kernels.conv.onednn``) where the implementation is 'native';
on other backends XLA's direct convolution.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from capsjax.kernels.conv import dispatch
from capsjax.kernels.conv import onednn
from capsjax.routing import votes as votes_lib

LOWERINGS = ('patches', 'narrow', 'taps', 'space_to_depth', 'direct',
              'onednn', 'onednn_input_grad')


# ----------------------------------------------------------------------------
# Convolution: a strided VALID convolution as space-to-depth + stride 1,
# because XLA:CPU's backward pass of a strided convolution is slow (the
# paper CapsNet's PrimaryCaps, measured: BENCHMARKS.md).


def _conv_padding(size: int, kernel_size: int, stride: int, padding: str
                  ) -> tuple[int, int]:
  """(low, high) zero padding of one spatial axis, as XLA's 'SAME'/'VALID'."""
  if padding == 'VALID':
    return 0, 0
  out = -(-size // stride)
  total = max((out - 1) * stride + kernel_size - size, 0)
  return total // 2, total - total // 2


def _lax_conv(x: jax.Array, kernel: jax.Array, stride: int = 1,
              padding: str = 'VALID') -> jax.Array:
  """XLA's convolution, NHWC inputs and HWIO kernels."""
  return jax.lax.conv_general_dilated(
      x, kernel, (stride, stride), padding,
      dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


def _space_to_depth(x: jax.Array, kernel: jax.Array, stride: int
                    ) -> tuple[jax.Array, jax.Array]:
  """Input and kernel of the stride-1 VALID convolution that equals the
  VALID convolution of ``x`` and ``kernel`` with ``stride``.

  The input [B, H, W, C] is regrouped into s x s blocks, [B, H/s, W/s, s*s*C],
  and the kernel [K, K, C, F] into [ceil(K/s), ceil(K/s), s*s*C, F] with zero
  taps past K (rows beyond the input that the regrouping pads in only meet
  zero taps).
  """
  batch, height, width, channels = x.shape
  k_h, k_w, _, features = kernel.shape
  s = stride
  out_h = votes_lib.output_size(height, k_h, s)
  out_w = votes_lib.output_size(width, k_w, s)
  q_h, q_w = -(-k_h // s), -(-k_w // s)
  kernel = jnp.pad(kernel, ((0, q_h * s - k_h), (0, q_w * s - k_w), (0, 0),
                            (0, 0)))
  kernel = kernel.reshape(q_h, s, q_w, s, channels, features)
  kernel = kernel.transpose(0, 2, 1, 3, 4, 5).reshape(q_h, q_w,
                                                      s * s * channels, features)
  rows, cols = (out_h + q_h - 1) * s, (out_w + q_w - 1) * s
  x = x[:, :rows, :cols]
  x = jnp.pad(x, ((0, 0), (0, rows - x.shape[1]), (0, cols - x.shape[2]),
                  (0, 0)))
  x = x.reshape(batch, rows // s, s, cols // s, s, channels)
  x = x.transpose(0, 1, 3, 2, 4, 5).reshape(batch, rows // s, cols // s,
                                            s * s * channels)
  return x, kernel


def space_to_depth_conv(x: ArrayLike, kernel: ArrayLike, stride: int
                        ) -> jax.Array:
  """VALID convolution with ``stride``, computed as a stride-1 convolution
  of the space-to-depth regrouped input and kernel.

  Args:
    x: [B, H, W, C].
    kernel: [Kh, Kw, C, F].
    stride: s >= 1.
  Returns:
    [B, H', W', F] with H' = (H - Kh) // s + 1, equal to
    ``lax.conv_general_dilated(x, kernel, (s, s), 'VALID')``.
  """
  x, kernel = _space_to_depth(jnp.asarray(x), jnp.asarray(kernel), stride)
  return eigen_conv(x, kernel)


def _check_kernel_fits(x: jax.Array, k_h: int, k_w: int) -> None:
  if k_h > x.shape[1] or k_w > x.shape[2]:
    raise ValueError(f'kernel {k_h}x{k_w} is larger than the input '
                     f'{x.shape[1]}x{x.shape[2]}.')


def _patches(x: jax.Array, k_h: int, k_w: int) -> jax.Array:
  """The Kh * Kw shifted windows of ``x`` [B, H, W, C] concatenated on the
  channel axis: [B, H - Kh + 1, W - Kw + 1, Kh*Kw*C], (row, column,
  channel) order, the order of an HWIO kernel flattened."""
  _check_kernel_fits(x, k_h, k_w)
  out_h, out_w = x.shape[1] - k_h + 1, x.shape[2] - k_w + 1
  windows = [x[:, i:i + out_h, j:j + out_w] for i in range(k_h)
             for j in range(k_w)]
  return windows[0] if len(windows) == 1 else jnp.concatenate(windows, -1)


def _checked_valid_conv(x: ArrayLike, kernel: ArrayLike) -> jax.Array:
  """XLA's stride-1 VALID convolution, once the kernel is known to fit."""
  x, kernel = jnp.asarray(x), jnp.asarray(kernel)
  _check_kernel_fits(x, *kernel.shape[:2])
  return _lax_conv(x, kernel)


@jax.custom_vjp
def patches_conv(x: ArrayLike, kernel: ArrayLike) -> jax.Array:
  """Stride-1 VALID convolution that trains fast on XLA:CPU.

  Evaluated, it is ``lax.conv_general_dilated`` (XLA:CPU's forward
  convolution is fast). Differentiated, it is the same convolution as one
  matrix product, ``patches @ kernel``: ``patches`` the Kh * Kw shifted
  windows of ``x`` concatenated on the channel axis, [B, H', W', Kh*Kw*C],
  and the kernel as a [Kh*Kw*C, F] matrix, whose gradient is two more
  products (``patches^T @ cotangent``; ``cotangent @ kernel^T``, its windows
  added back where they came from) instead of XLA:CPU's slow convolution
  backward pass. Measured: BENCHMARKS.md, the CPU convolution path.

  Args:
    x: [B, H, W, C].
    kernel: [Kh, Kw, C, F].
  Returns:
    [B, H - Kh + 1, W - Kw + 1, F].
  """
  return _checked_valid_conv(x, kernel)


def _patches_matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
  k_h, k_w, channels, features = kernel.shape
  return jnp.matmul(_patches(x, k_h, k_w),
                    kernel.reshape(k_h * k_w * channels, features))


def _patches_conv_forward(x, kernel):
  # Differentiated, the convolution is the product itself: its backward
  # pass is then two more products (XLA:CPU's convolution backward is slow).
  return jax.vjp(_patches_matmul, x, kernel)


def _patches_conv_backward(transpose, cotangent):
  return transpose(cotangent)


patches_conv.defvjp(_patches_conv_forward, _patches_conv_backward)


def _channel_major_patches(x: jax.Array, k_h: int, k_w: int) -> jax.Array:
  """The windows of ``x`` [B, H, W, C] as a [Kh*Kw*C, B*H'*W'] matrix, rows
  in (row, column, channel) order (an HWIO kernel's), columns in the output's
  (batch, row, column) order. Small when C is: the window axis leads, so
  ``patches @ cotangent`` is a plain product with no transposed operand."""
  _check_kernel_fits(x, k_h, k_w)
  batch, height, width, channels = x.shape
  out_h, out_w = height - k_h + 1, width - k_w + 1
  x = jnp.moveaxis(x, -1, 0)  # [C, B, H, W]
  windows = [x[:, :, i:i + out_h, j:j + out_w] for i in range(k_h)
             for j in range(k_w)]
  return jnp.stack(windows).reshape(k_h * k_w * channels,
                                    batch * out_h * out_w)


@jax.custom_vjp
def narrow_conv(x: ArrayLike, kernel: ArrayLike) -> jax.Array:
  """Stride-1 VALID convolution of a narrow input (a first layer's image
  channels) that trains fast on XLA:CPU.

  Evaluated, and in training's forward pass, it is XLA's convolution. Its
  kernel gradient is one product, ``patches @ cotangent`` with the patches
  channel-major ([Kh*Kw*C, B*H'*W'], ``_channel_major_patches``): XLA's
  kernel gradient, or ``patches_conv``'s ``patches^T @ cotangent``,
  first transposes the wide cotangent (faster on Su's first layer:
  BENCHMARKS.md).
  Its input gradient, needed only by attacks on the images, is
  ``patches_conv``'s.

  Args:
    x: [B, H, W, C].
    kernel: [Kh, Kw, C, F].
  Returns:
    [B, H - Kh + 1, W - Kw + 1, F].
  """
  return _checked_valid_conv(x, kernel)


def _narrow_conv_forward(x, kernel):
  return narrow_conv(x, kernel), (x, kernel)


def _narrow_conv_backward(residuals, cotangent):
  x, kernel = residuals
  k_h, k_w, _, features = kernel.shape
  # The product's forward half is unused here and removed by XLA.
  _, input_vjp = jax.vjp(lambda x: _patches_matmul(x, kernel), x)
  kernel_grad = (_channel_major_patches(x, k_h, k_w) @
                 cotangent.reshape(-1, features))
  return input_vjp(cotangent)[0], kernel_grad.reshape(kernel.shape)


narrow_conv.defvjp(_narrow_conv_forward, _narrow_conv_backward)


def _unfused(x: jax.Array, key: jax.Array) -> jax.Array:
  """``x`` itself, behind a boundary that XLA:CPU does not fuse across,
  which waits for ``key`` (any array; its first entry is the token).

  The kernel gradient of a convolution transposes its input. XLA fuses the
  input's elementwise producer (a bias and ReLU) into that transpose, whose
  loop then runs 3-4x slower than the transpose of the stored input
  (BENCHMARKS.md).
  XLA:CPU drops ``lax.optimization_barrier`` before fusion; a conditional
  whose branches differ stays. ``token == token`` holds unless ``token`` is
  NaN, and then ``x + 0.0`` is ``x`` too (up to the sign of zeros). An
  empty ``key`` (an empty batch) gives the token 0.
  """
  token = jnp.sum(key.reshape(-1)[:1])
  return jax.lax.cond(token == token, lambda x: x, lambda x: x + 0.0, x)


def _kernel_gradient(x: jax.Array, kernel: jax.Array, cotangent: jax.Array,
                     stride: int, padding: str, key: jax.Array) -> jax.Array:
  """XLA's kernel gradient of ``_lax_conv(x, kernel, stride, padding)``,
  its transposed input read from memory (``_unfused`` keyed on ``key``)."""
  x = _unfused(x, key)
  _, kernel_vjp = jax.vjp(lambda k: _lax_conv(x, k, stride, padding), kernel)
  return kernel_vjp(cotangent)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def eigen_conv(x: ArrayLike, kernel: ArrayLike, stride: int = 1,
               padding: str = 'VALID') -> jax.Array:
  """``lax.conv_general_dilated`` whose kernel gradient reads its input
  from memory instead of recomputing it inside a slow transposing loop
  (``_unfused``); values and both gradients are XLA's own.

  Args:
    x: [B, H, W, C].
    kernel: [Kh, Kw, C, F].
    stride: the same stride along both axes.
    padding: 'VALID' or 'SAME'.
  Returns:
    [B, H', W', F].
  """
  return _lax_conv(jnp.asarray(x), jnp.asarray(kernel), stride, padding)


def _eigen_conv_forward(x, kernel, stride, padding):
  return eigen_conv(x, kernel, stride, padding), (x, kernel)


def _eigen_conv_backward(stride, padding, residuals, cotangent):
  x, kernel = residuals
  _, input_vjp = jax.vjp(lambda x: _lax_conv(x, kernel, stride, padding), x)
  # Keyed on x itself, the boundary need not wait for the backward pass:
  # Su's capsule model at batch 128 trained at 590 against 566 img/s
  # (medians of 6 alternated pairs) with it, and 5% slower than without the
  # boundary when it was keyed on the cotangent (BENCHMARKS.md).
  return (input_vjp(cotangent)[0],
          _kernel_gradient(x, kernel, cotangent, stride, padding, x))


eigen_conv.defvjp(_eigen_conv_forward, _eigen_conv_backward)


def _taps_input_gradient(cotangent: jax.Array, kernel: jax.Array,
                         stride: int, height: int, width: int) -> jax.Array:
  """Input gradient of a VALID convolution with ``stride``, tap by tap.

  Each tap's product ``cotangent @ kernel[i, j]^T``, [B, H', W', C], is
  added in place (a dynamic_update_slice) into its box of the input's
  space-to-depth grid, [B, H'+ceil(Kh/s)-1, W'+ceil(Kw/s)-1, s*s*C]: tap
  (i, j) = (s*a + p, s*b + q) lands at offset (a, b), channel block (p, q).
  No zero taps are multiplied, no patches are built.

  Args:
    cotangent: [B, H', W', F].
    kernel: [Kh, Kw, C, F].
    stride: s.
    height, width: H and W of the input.
  Returns:
    [B, H, W, C].
  """
  k_h, k_w, channels, _ = kernel.shape
  batch, out_h, out_w, _ = cotangent.shape
  s = stride
  rows, cols = out_h + -(-k_h // s) - 1, out_w + -(-k_w // s) - 1
  grad = jnp.zeros((batch, rows, cols, s * s * channels), cotangent.dtype)
  for i in range(k_h):
    for j in range(k_w):
      tap = jnp.einsum('bhwf,cf->bhwc', cotangent, kernel[i, j])
      start = (0, i // s, j // s, ((i % s) * s + j % s) * channels)
      box = jax.lax.dynamic_slice(grad, start, tap.shape)
      grad = jax.lax.dynamic_update_slice(grad, box + tap, start)
  grad = grad.reshape(batch, rows, cols, s, s, channels)
  grad = grad.transpose(0, 1, 3, 2, 4, 5).reshape(batch, rows * s, cols * s,
                                                  channels)
  # Every tap lands inside the input; rows and columns past the windows'
  # reach (the input's remainder) get zeros.
  grad = grad[:, :height, :width]
  return jnp.pad(grad, ((0, 0), (0, height - grad.shape[1]),
                        (0, width - grad.shape[2]), (0, 0)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def taps_conv(x: ArrayLike, kernel: ArrayLike, stride: int) -> jax.Array:
  """VALID strided convolution that trains fast on XLA:CPU.

  Evaluated, and for its kernel gradient, it is XLA's strided convolution
  (both run near the CPU's peak; the kernel gradient's transpose reads the
  stored input: ``_unfused``). Its input gradient, which XLA computes
  as a convolution over the stride-dilated cotangent (12.9 s against
  0.23 s for the paper's PrimaryCaps at batch 64), is ``Kh * Kw`` matrix
  products added in place: ``_taps_input_gradient``. Measured:
  BENCHMARKS.md, the CPU convolution path.

  Args:
    x: [B, H, W, C].
    kernel: [Kh, Kw, C, F].
    stride: s >= 1.
  Returns:
    [B, (H - Kh) // s + 1, (W - Kw) // s + 1, F].
  """
  x, kernel = jnp.asarray(x), jnp.asarray(kernel)
  _check_kernel_fits(x, *kernel.shape[:2])
  return _lax_conv(x, kernel, stride)


def _taps_conv_forward(x, kernel, stride):
  return taps_conv(x, kernel, stride), (x, kernel)


def _taps_conv_backward(stride, residuals, cotangent):
  x, kernel = residuals
  input_grad = _taps_input_gradient(cotangent, kernel, stride, x.shape[1],
                                    x.shape[2])
  # Keyed on the cotangent: keyed on x, the paper CapsNet at batch 128
  # trained 2-3% slower in two alternated pairs (BENCHMARKS.md).
  return input_grad, _kernel_gradient(x, kernel, cotangent, stride, 'VALID',
                                      cotangent)


taps_conv.defvjp(_taps_conv_forward, _taps_conv_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def onednn_input_grad_conv(x: ArrayLike, kernel: ArrayLike, stride: int,
                           padding: str = 'VALID') -> jax.Array:
  """XLA's convolution and kernel gradient, oneDNN's input gradient.

  For the paper's PrimaryCaps (9x9, stride 2, 256 channels) on the
  development CPU, XLA's strided forward and kernel gradient beat oneDNN's
  and oneDNN's input gradient beats the taps (BENCHMARKS.md). Needs
  ``capsjax.kernels.conv.onednn``.

  Args:
    x: [B, H, W, C] float32.
    kernel: [Kh, Kw, C, F] float32.
    stride: the same along both axes.
    padding: 'VALID' or 'SAME'.
  Returns:
    [B, H', W', F].
  """
  return _lax_conv(x, kernel, stride, padding)


def _onednn_input_grad_conv_forward(x, kernel, stride, padding):
  return onednn_input_grad_conv(x, kernel, stride, padding), (x, kernel)


def _onednn_input_grad_conv_backward(stride, padding, residuals, cotangent):
  x, kernel = residuals
  pads = (_conv_padding(x.shape[1], kernel.shape[0], stride, padding),
          _conv_padding(x.shape[2], kernel.shape[1], stride, padding))
  return (onednn.input_gradient(cotangent, kernel, x.shape, stride, pads),
          _kernel_gradient(x, kernel, cotangent, stride, padding, cotangent))


onednn_input_grad_conv.defvjp(_onednn_input_grad_conv_forward,
                              _onednn_input_grad_conv_backward)


def _onednn_fits(x: jax.Array, kernel: jax.Array, pad_h: tuple[int, int],
                 pad_w: tuple[int, int]) -> bool:
  """Whether oneDNN's convolution (``capsjax.kernels.conv.onednn``) can compute this
  one: float32 or bfloat16 (both operands), a non-empty batch, the kernel
  fits the padded input."""
  return (x.shape[0] > 0 and x.dtype == kernel.dtype and
          x.dtype in (jnp.float32, jnp.bfloat16) and
          x.shape[1] + sum(pad_h) >= kernel.shape[0] and
          x.shape[2] + sum(pad_w) >= kernel.shape[1])


def check_conv2d(x: jax.Array, kernel: jax.Array, padding: str) -> None:
  """ValueError unless x is [B, H, W, C], kernel [Kh, Kw, C, F] and padding
  'VALID' or 'SAME'."""
  if x.ndim != 4 or kernel.ndim != 4 or x.shape[-1] != kernel.shape[2]:
    raise ValueError(
        f'conv2d: input [B, H, W, C] = {x.shape} does not match kernel '
        f'[Kh, Kw, C, F] = {kernel.shape}.')
  if padding not in ('VALID', 'SAME'):
    raise ValueError(f"padding must be 'VALID' or 'SAME', got {padding!r}.")


def onednn_why_not(x: jax.Array, kernel: jax.Array, stride: int,
                   padding: str, *, for_speed: bool) -> str:
  """Why oneDNN cannot compute this convolution ('' when it can);
  ``for_speed``: also where it would not be the faster (bfloat16 without
  the CPU's bfloat16 instructions)."""
  if jax.default_backend() != 'cpu':
    return f'it runs on the CPU backend only, not {jax.default_backend()}'
  pad_h = _conv_padding(x.shape[1], kernel.shape[0], stride, padding)
  pad_w = _conv_padding(x.shape[2], kernel.shape[1], stride, padding)
  if not _onednn_fits(x, kernel, pad_h, pad_w):
    return (f'it takes float32 or bfloat16 convolutions of a non-empty batch '
            f'that the kernel fits, not a {x.dtype} input {x.shape} with a '
            f'{kernel.dtype} kernel {kernel.shape}')
  if not onednn.available():
    return f'oneDNN is {onednn.status()}'
  if for_speed and x.dtype == jnp.bfloat16 and not onednn.computes(x.dtype):
    return onednn.bf16_status()[1]
  return ''


def default_lowering(x: jax.Array, kernel: jax.Array, stride: int,
                     padding: str, *, native: bool) -> str:
  """The lowering ``conv2d`` takes: ``dispatch.cpu_conv_impl``'s on the
  CPU backend (``native``: with oneDNN's convolutions), 'direct' elsewhere:
  on GPU the zero taps of the regrouped kernel would add 23% MACs to the 9x9
  stride-2 PrimaryCaps conv and cuDNN's kernels have no such backward
  problem."""
  if jax.default_backend() != 'cpu':
    return 'direct'
  pad_h = _conv_padding(x.shape[1], kernel.shape[0], stride, padding)
  pad_w = _conv_padding(x.shape[2], kernel.shape[1], stride, padding)
  height, width = x.shape[1] + sum(pad_h), x.shape[2] + sum(pad_w)
  out_h = votes_lib.output_size(height, kernel.shape[0], stride)
  out_w = votes_lib.output_size(width, kernel.shape[1], stride)
  return dispatch.cpu_conv_impl(x.shape[-1], stride, height * width,
                                out_h * out_w, onednn=native,
                                bfloat16=x.dtype == jnp.bfloat16)


def conv2d(x: ArrayLike, kernel: ArrayLike, stride: int = 1,
           padding: str = 'VALID', lowering: str = 'direct') -> jax.Array:
  """2-D convolution, NHWC, by the named lowering (``capsjax.kernels.conv2d``
  chooses one; benchmarks and tests name them).

  Args:
    x: [B, H, W, C].
    kernel: [Kh, Kw, C, F].
    stride: the same stride along both axes.
    padding: 'VALID' or 'SAME' (XLA's convention).
    lowering: 'patches' (a strided convolution regrouped space-to-depth
      into a stride-1 one, evaluated by XLA and differentiated as matrix
      products over patches: ``patches_conv``),
      'narrow' (the same regrouping, then XLA's convolution with its kernel
      gradient one product over channel-major patches: ``narrow_conv``),
      'taps' (XLA's strided convolution, its input gradient computed tap by
      tap: ``taps_conv``),
      'space_to_depth' (the regrouping, then ``eigen_conv``: XLA's
      convolution), 'direct' (``lax.conv_general_dilated`` with the
      stride), 'onednn' (oneDNN's, float32 or bfloat16:
      ``capsjax.kernels.conv.onednn``) or 'onednn_input_grad' (XLA's with
      oneDNN's input gradient, float32: ``onednn_input_grad_conv``).
  Returns:
    [B, H', W', F].
  """
  x, kernel = jnp.asarray(x), jnp.asarray(kernel)
  check_conv2d(x, kernel, padding)
  if lowering not in LOWERINGS:
    raise ValueError(f'lowering must be one of {LOWERINGS}, got {lowering!r}.')
  pad_h = _conv_padding(x.shape[1], kernel.shape[0], stride, padding)
  pad_w = _conv_padding(x.shape[2], kernel.shape[1], stride, padding)
  if lowering == 'direct':
    return _lax_conv(x, kernel, stride, padding)
  if lowering in ('onednn', 'onednn_input_grad'):
    why_not = onednn_why_not(x, kernel, stride, padding, for_speed=False)
    if why_not:
      raise ValueError(f'lowering={lowering!r}: {why_not}.')
    if x.dtype == jnp.bfloat16 and lowering == 'onednn_input_grad':
      raise ValueError("lowering='onednn_input_grad' is float32 only (XLA's "
                       "bfloat16 forward pass is slow); use 'onednn'.")
    if lowering == 'onednn_input_grad':
      return onednn_input_grad_conv(x, kernel, stride, padding)
    return onednn.conv(x, kernel, stride, (pad_h, pad_w))
  if lowering == 'space_to_depth' and stride == 1:
    return eigen_conv(x, kernel, 1, padding)
  if padding == 'SAME':
    x = jnp.pad(x, ((0, 0), pad_h, pad_w, (0, 0)))
  if lowering == 'space_to_depth':
    return space_to_depth_conv(x, kernel, stride)
  if lowering == 'taps':
    return taps_conv(x, kernel, stride)
  if stride > 1:
    x, kernel = _space_to_depth(x, kernel, stride)
  if lowering == 'narrow':
    return narrow_conv(x, kernel)
  return patches_conv(x, kernel)
