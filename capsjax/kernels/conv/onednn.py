"""oneDNN's convolutions on the CPU, through an XLA FFI call (optional).

XLA:CPU's own (Eigen) convolutions run every pass of Su's 3x3 layers
10-20% slower than oneDNN's, and XLA:CPU hands no convolution to a faster
library (BENCHMARKS.md). With oneDNN's wheels installed
(``pip install 'capsjax[onednn]'``) and a C++ compiler on the machine, the
first use compiles ``csrc/onednn_conv.cc`` against jaxlib's FFI headers
(about 3 s, once per source and jaxlib version) into the user's cache
(``$CAPSJAX_CACHE_DIR``, else ``~/.cache/capsjax``) and registers its
handlers: the forward convolution (any stride, explicit zero padding), its
two gradients, the kernel gradient as one product over the patches, and a
matrix product (``matmul``). ``capsjax.kernels.conv2d`` then runs the
CPU's float32 convolutions through them (``implementation='native'``, the
default where it can; the lowering by ``dispatch.cpu_conv_impl``). Without the
wheels or a compiler, or with ``implementation='xla'`` (or
``CAPSJAX_IMPLEMENTATION=xla`` for every default), nothing changes:
``status()`` says why.

bfloat16 (``compute_dtype='bfloat16'``): the handlers take bfloat16
inputs and kernels too, and oneDNN picks its kernels for the CPU's
bfloat16 instructions itself (AMX, AVX512-BF16). The forward pass and the
input gradient are bfloat16 in and out, accumulated in float32 inside
oneDNN; the kernel gradient, a sum over the whole batch, is accumulated
and returned in float32 and rounded once to the kernel's bfloat16 (JAX
wants a cotangent in its primal's dtype; mixed precision then adds it to
the float32 master kernel). Below AMX, a strided convolution's kernel
gradient is one bfloat16 product over its patches instead
(``_kernel_gradient_as_product``). On a CPU without bfloat16 dot products
oneDNN would convert to float32 and run slower than in float32, so there
(and with ``implementation='xla'``) bfloat16 convolutions stay XLA's:
``bf16_status()`` says which path they take and why.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from capsjax.kernels import native
from capsjax.routing import votes as votes_lib

RUNTIME_WHEEL = 'onednn-cpu-gomp'
HEADERS_WHEEL = 'onednn-devel-cpu-gomp'
_SOURCE = pathlib.Path(__file__).parent / 'csrc' / 'onednn_conv.cc'
_TARGETS = ('OnednnConvForward', 'OnednnConvInputGrad', 'OnednnConvKernelGrad',
            'OnednnConvKernelGradByProduct', 'OnednnMatmul')
_PREFIX = 'capsjax_onednn_'


def wheels_installed() -> bool:
  """Whether both oneDNN wheels (the ``onednn`` extra) are installed."""
  try:
    for name in (RUNTIME_WHEEL, HEADERS_WHEEL):
      importlib.metadata.distribution(name)
  except importlib.metadata.PackageNotFoundError:
    return False
  return True


def _wheel_file(wheel: str, suffix: str) -> pathlib.Path | None:
  """The installed file of ``wheel`` whose path ends with ``suffix``."""
  for entry in importlib.metadata.distribution(wheel).files or ():
    if str(entry).replace('\\', '/').endswith(suffix):
      return pathlib.Path(entry.locate()).resolve()
  return None


def _build(header: pathlib.Path, library: pathlib.Path) -> pathlib.Path:
  """Compiles the handlers (cached by source, jaxlib and oneDNN)."""
  include = header.parent.parent.parent  # .../include/oneapi/dnnl/dnnl.hpp
  return native.build(_SOURCE, _PREFIX,
                      ['-O2', f'-I{include}', str(library),
                       f'-Wl,-rpath,{library.parent}'])


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
  """(the loaded library, None) or (None, why not), once per process."""
  if not wheels_installed():
    return None, (f"not installed: pip install 'capsjax[onednn]' "
                  f'({RUNTIME_WHEEL}, {HEADERS_WHEEL})')
  header = _wheel_file(HEADERS_WHEEL, 'oneapi/dnnl/dnnl.hpp')
  library = _wheel_file(RUNTIME_WHEEL, 'libdnnl.so.3')
  if header is None or library is None:
    return None, (f'the oneDNN wheels lack oneapi/dnnl/dnnl.hpp or '
                  f'libdnnl.so.3: reinstall {RUNTIME_WHEEL} and {HEADERS_WHEEL}')
  try:
    lib = ctypes.CDLL(str(_build(header, library)))
    for name in _TARGETS:
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)),
                                  platform='cpu')
  except (OSError, RuntimeError, AttributeError) as error:
    return None, f'not available: {error}'
  lib.ImplInfo.restype = ctypes.c_char_p
  lib.CpuIsa.restype = ctypes.c_char_p
  return lib, 'in use (convolutions on the CPU)'


def available() -> bool:
  """Whether oneDNN's convolutions are built, loaded and registered."""
  return _load()[0] is not None


def status() -> str:
  """What this process does with oneDNN, in words."""
  return _load()[1]


def cpu_isa() -> str:
  """The instruction set oneDNN's kernels use on this CPU, oneDNN's name
  for it (such as 'avx512_core_bf16' or 'avx512_core_amx'); '' without
  oneDNN."""
  lib = _load()[0]
  return '' if lib is None else lib.CpuIsa().decode().removeprefix('cpu_isa_')


def native_bf16() -> bool:
  """Whether oneDNN has bfloat16 dot-product kernels on this CPU (AMX,
  AVX512-BF16 or AVX2-VNNI-2); False without oneDNN."""
  lib = _load()[0]
  return lib is not None and bool(lib.NativeBf16())


def bf16_status() -> tuple[bool, str]:
  """(whether oneDNN computes bfloat16 convolutions, why or why not in
  words)."""
  if not available():
    return False, f'XLA: oneDNN {status()}'
  isa = cpu_isa()
  if not native_bf16():
    return False, (f'XLA: this CPU has no bfloat16 instructions for oneDNN '
                   f'(AVX512-BF16 or AMX; oneDNN runs {isa})')
  return True, f'oneDNN ({isa})'


def computes(dtype) -> bool:
  """Whether oneDNN computes this process's convolutions of ``dtype``
  (float32 where it is available; bfloat16 by ``bf16_status``)."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return available()
  return dtype == jnp.bfloat16 and bf16_status()[0]


Padding = tuple[tuple[int, int], tuple[int, int]]
VALID: Padding = ((0, 0), (0, 0))


def output_shape(x_shape, kernel_shape, stride: int = 1,
                 padding: Padding = VALID) -> tuple[int, int, int, int]:
  """[B, H', W', F] of the convolution of x: [B, H, W, C] by kernel:
  [Kh, Kw, C, F] with the stride and ((top, bottom), (left, right)) zero
  padding."""
  (top, bottom), (left, right) = padding
  b, h, w, _ = x_shape
  k_h, k_w, _, f = kernel_shape
  return (b, votes_lib.output_size(h + top + bottom, k_h, stride),
          votes_lib.output_size(w + left + right, k_w, stride), f)


def _geometry(stride: int, padding: Padding) -> dict[str, np.int64]:
  """The FFI attributes of onednn_conv.cc's Geometry."""
  (top, bottom), (left, right) = padding
  return {name: np.int64(value) for name, value in (
      ('stride', stride), ('pad_top', top), ('pad_bottom', bottom),
      ('pad_left', left), ('pad_right', right))}


def kernels(x_shape, kernel_shape, stride: int = 1,
            padding: Padding = VALID, dtype=jnp.float32) -> str:
  """The oneDNN kernels of a convolution (forward and both gradients; sizes
  as in ``conv``; ``dtype`` float32 or bfloat16), in words."""
  lib, why = _load()
  if lib is None:
    raise RuntimeError(f'oneDNN convolutions: {why}')
  _, out_h, out_w, _ = output_shape(x_shape, kernel_shape, stride, padding)
  geometry = _geometry(stride, padding)
  sizes = (*x_shape, *kernel_shape[:2], kernel_shape[3], out_h, out_w,
           *geometry.values(), int(jnp.dtype(dtype) == jnp.bfloat16))
  return lib.ImplInfo(*(ctypes.c_int64(int(v)) for v in sizes)).decode()


def _check_bfloat16_kernels(dtype, what: str) -> None:
  """Raises ValueError for bfloat16 operands on a CPU where oneDNN has no
  bfloat16 kernels (it refuses to build them there)."""
  if jnp.dtype(dtype) == jnp.bfloat16 and not native_bf16():
    raise ValueError(
        f'oneDNN {what}: this CPU has no bfloat16 instructions for oneDNN '
        f'(AVX512-BF16 or AMX; oneDNN runs {cpu_isa()}), so it has no '
        f'bfloat16 kernels here. Use float32 operands, or capsjax.conv2d, '
        f'which computes bfloat16 with XLA on such a CPU.')


def _call(target: str, shape, dtype, stride: int, padding: Padding,
          *operands) -> jax.Array:
  if not available():
    raise RuntimeError(f'oneDNN convolutions: {status()}')
  dtypes = {jnp.dtype(operand.dtype) for operand in operands}
  if len(dtypes) != 1 or not dtypes <= {jnp.dtype(jnp.float32),
                                        jnp.dtype(jnp.bfloat16)}:
    raise ValueError(f'oneDNN convolutions take operands all float32 or all '
                     f'bfloat16, got {sorted(d.name for d in dtypes)}.')
  _check_bfloat16_kernels(operands[0].dtype, 'convolutions')
  out = jax.ShapeDtypeStruct(shape, dtype)
  return jax.ffi.ffi_call(target, out, vmap_method='sequential')(
      *operands, **_geometry(stride, padding))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def conv(x: jax.Array, kernel: jax.Array, stride: int = 1,
         padding: Padding = VALID) -> jax.Array:
  """Convolution by oneDNN.

  Args:
    x: [B, H, W, C] float32 or bfloat16, B >= 1.
    kernel: [Kh, Kw, C, F] of x's dtype, the padded input at least its size.
    stride: the same along both axes.
    padding: ((top, bottom), (left, right)) zeros around the input.
  Returns:
    [B, H', W', F] of x's dtype, H' = (H + top + bottom - Kh) // stride + 1.
    Its kernel gradient is summed in float32 (module docstring).
  """
  return _call('OnednnConvForward',
               output_shape(x.shape, kernel.shape, stride, padding), x.dtype,
               stride, padding, x, kernel)


def _conv_forward(x, kernel, stride, padding):
  return conv(x, kernel, stride, padding), (x, kernel)


def input_gradient(cotangent: jax.Array, kernel: jax.Array, x_shape,
                   stride: int = 1, padding: Padding = VALID) -> jax.Array:
  """The gradient of ``conv(x, kernel, stride, padding)`` with respect to
  x: [B, H, W, C] (``x_shape``) for the cotangent [B, H', W', F], by oneDNN,
  in the cotangent's dtype (float32 or bfloat16, the kernel's too).
  """
  return _call('OnednnConvInputGrad', tuple(x_shape), cotangent.dtype, stride,
               padding, cotangent, kernel)


def kernel_gradient(x: jax.Array, cotangent: jax.Array, kernel_shape,
                    stride: int = 1, padding: Padding = VALID) -> jax.Array:
  """The gradient of ``conv(x, kernel, stride, padding)`` with respect to
  the kernel [Kh, Kw, C, F] (``kernel_shape``) for the cotangent
  [B, H', W', F], by oneDNN: float32, summed in float32 also for bfloat16
  x and cotangent."""
  return _call('OnednnConvKernelGrad', tuple(kernel_shape), jnp.float32,
               stride, padding, x, cotangent)


def matmul(a: jax.Array, b: jax.Array, transpose_a: bool = False,
           transpose_b: bool = False, out_dtype=None) -> jax.Array:
  """op(a) @ op(b) by oneDNN, op transposing where asked, without copying
  the transposed operand.

  Args:
    a: [M, K], or [K, M] with ``transpose_a``; float32 or bfloat16.
    b: [K, N], or [N, K] with ``transpose_b``; a's dtype.
    transpose_a, transpose_b: as above.
    out_dtype: float32 or the operands' dtype (None: theirs). Summed in
      float32 either way.
  Returns:
    [M, N].
  """
  if not available():
    raise RuntimeError(f'oneDNN: {status()}')
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  if (a.ndim != 2 or b.ndim != 2 or a.dtype != b.dtype or
      a.dtype not in (jnp.float32, jnp.bfloat16) or
      out_dtype not in (jnp.float32, a.dtype)):
    raise ValueError(f'oneDNN matmul takes 2-D operands both float32 or both '
                     f'bfloat16, the result float32 or theirs; got '
                     f'{a.dtype} {a.shape}, {b.dtype} {b.shape} -> '
                     f'{out_dtype}.')
  _check_bfloat16_kernels(a.dtype, 'matmul')
  m, k = a.shape[::-1] if transpose_a else a.shape
  k_b, n = b.shape[::-1] if transpose_b else b.shape
  if k != k_b:
    raise ValueError(f'oneDNN matmul: {a.shape} and {b.shape} do not '
                     f'multiply (transpose_a={transpose_a}, '
                     f'transpose_b={transpose_b}).')
  out = jax.ShapeDtypeStruct((m, n), out_dtype)
  return jax.ffi.ffi_call('OnednnMatmul', out, vmap_method='sequential')(
      a, b, transpose_a=np.int64(transpose_a),
      transpose_b=np.int64(transpose_b))


def _kernel_gradient_by_product(x: jax.Array, cotangent: jax.Array,
                                kernel_shape, stride: int, padding: Padding
                                ) -> jax.Array:
  """``kernel_gradient`` as one product, patches^T @ cotangent (the patches
  [B*H'*W', Kh*Kw*C] built inside the call), by oneDNN's matmul: float32
  [Kh, Kw, C, F], summed in float32."""
  return _call('OnednnConvKernelGradByProduct', tuple(kernel_shape),
               jnp.float32, stride, padding, x, cotangent)


def _kernel_gradient_as_product(dtype, stride: int) -> bool:
  """Whether the kernel gradient of a ``dtype`` convolution with ``stride``
  is one product over its patches (``_kernel_gradient_by_product``).

  Below AMX, oneDNN's bfloat16 kernel gradient of a strided convolution
  (its 'jit_bf16' kernel, which PyTorch runs too) is slower than its
  float32 one on the same values, itself slower than oneDNN's bfloat16
  matrix product over the patches (measured for the paper CapsNet's
  PrimaryCaps on an AVX512-BF16 CPU). At stride 1 its bfloat16 convolution
  kernels were the faster. With AMX oneDNN has other kernel-gradient
  kernels (brgemm ones, not measured here), which are kept.
  """
  return (jnp.dtype(dtype) == jnp.bfloat16 and stride > 1 and
          'amx' not in cpu_isa())


def _conv_backward(stride, padding, residuals, cotangent):
  x, kernel = residuals
  cotangent = cotangent.astype(x.dtype)
  if _kernel_gradient_as_product(x.dtype, stride):
    kernel_grad = _kernel_gradient_by_product(x, cotangent, kernel.shape,
                                              stride, padding)
  else:
    kernel_grad = kernel_gradient(x, cotangent, kernel.shape, stride, padding)
  return (input_gradient(cotangent, kernel, x.shape, stride, padding),
          kernel_grad.astype(kernel.dtype))


conv.defvjp(_conv_forward, _conv_backward)
