"""oneDNN's convolutions on the CPU, through an XLA FFI call (optional).

XLA:CPU's own (Eigen) convolutions run every pass of Su's 3x3 layers
10-20% slower than oneDNN's, and XLA:CPU hands no convolution to a faster
library (BENCHMARKS.md). With oneDNN's wheels installed
(``pip install 'capsjax[onednn]'``) and a C++ compiler on the machine, the
first use compiles ``csrc/onednn_conv.cc`` against jaxlib's FFI headers
(about 3 s, once per source and jaxlib version) into the user's cache
(``$CAPSJAX_CACHE_DIR``, else ``~/.cache/capsjax``) and registers its three
handlers: the forward convolution (any stride, explicit zero padding) and
its two gradients. ``lowerings.conv2d`` then runs the CPU's float32
convolutions through them (``dispatch.cpu_conv_impl``). Without the
wheels or a compiler, or with ``CAPSJAX_ONEDNN=0``, nothing changes:
``status()`` says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from capsjax import votes as votes_lib

RUNTIME_WHEEL = 'onednn-cpu-gomp'
HEADERS_WHEEL = 'onednn-devel-cpu-gomp'
_SOURCE = pathlib.Path(__file__).parent / 'csrc' / 'onednn_conv.cc'
_TARGETS = ('OnednnConvForward', 'OnednnConvInputGrad', 'OnednnConvKernelGrad')
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


def _cache_dir() -> pathlib.Path:
  root = os.environ.get('CAPSJAX_CACHE_DIR')
  return (pathlib.Path(root) if root else
          pathlib.Path.home() / '.cache' / 'capsjax')


def _build(header: pathlib.Path, library: pathlib.Path) -> pathlib.Path:
  """Compiles the handlers (cached by source, jaxlib and oneDNN); the file
  appears atomically, so concurrent processes may build it side by side."""
  include = header.parent.parent.parent  # .../include/oneapi/dnnl/dnnl.hpp
  key = hashlib.sha256(b'\0'.join([
      _SOURCE.read_bytes(), importlib.metadata.version('jaxlib').encode(),
      str(library).encode()])).hexdigest()[:16]
  target = _cache_dir() / f'{_PREFIX}{key}.so'
  if target.exists():
    return target
  compiler = os.environ.get('CXX') or shutil.which('g++') or shutil.which('c++')
  if not compiler:
    raise RuntimeError('no C++ compiler (g++, c++ or $CXX) on PATH')
  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
    built = pathlib.Path(tmp) / target.name
    command = [compiler, '-O2', '-std=c++17', '-shared', '-fPIC', '-w',
               f'-I{jax.ffi.include_dir()}', f'-I{include}', str(_SOURCE),
               str(library), f'-Wl,-rpath,{library.parent}', '-o', str(built)]
    result = subprocess.run(command, capture_output=True, text=True,
                            check=False)
    if result.returncode:
      raise RuntimeError(f'compiling {_SOURCE.name} failed:\n'
                         f'{result.stderr[-2000:]}')
    os.replace(built, target)
  return target


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
  """(the loaded library, None) or (None, why not), once per process."""
  if os.environ.get('CAPSJAX_ONEDNN', '1') == '0':
    return None, 'off (CAPSJAX_ONEDNN=0)'
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
  return lib, 'in use (float32 convolutions on the CPU)'


def available() -> bool:
  """Whether oneDNN's convolutions are built, loaded and registered."""
  return _load()[0] is not None


def status() -> str:
  """What this process does with oneDNN, in words."""
  return _load()[1]


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
            padding: Padding = VALID) -> str:
  """The oneDNN kernels of a convolution (forward and both gradients; sizes
  as in ``conv``), in words."""
  lib, why = _load()
  if lib is None:
    raise RuntimeError(f'oneDNN convolutions: {why}')
  _, out_h, out_w, _ = output_shape(x_shape, kernel_shape, stride, padding)
  geometry = _geometry(stride, padding)
  sizes = (*x_shape, *kernel_shape[:2], kernel_shape[3], out_h, out_w,
           *geometry.values())
  return lib.ImplInfo(*(ctypes.c_int64(int(v)) for v in sizes)).decode()


def _call(target: str, shape, stride: int, padding: Padding, *operands
          ) -> jax.Array:
  if not available():
    raise RuntimeError(f'oneDNN convolutions: {status()}')
  out = jax.ShapeDtypeStruct(shape, jnp.float32)
  return jax.ffi.ffi_call(target, out, vmap_method='sequential')(
      *operands, **_geometry(stride, padding))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def conv(x: jax.Array, kernel: jax.Array, stride: int = 1,
         padding: Padding = VALID) -> jax.Array:
  """Convolution by oneDNN.

  Args:
    x: [B, H, W, C] float32, B >= 1.
    kernel: [Kh, Kw, C, F] float32, the padded input at least its size.
    stride: the same along both axes.
    padding: ((top, bottom), (left, right)) zeros around the input.
  Returns:
    [B, H', W', F], H' = (H + top + bottom - Kh) // stride + 1.
  """
  return _call('OnednnConvForward',
               output_shape(x.shape, kernel.shape, stride, padding), stride,
               padding, x, kernel)


def _conv_forward(x, kernel, stride, padding):
  return conv(x, kernel, stride, padding), (x, kernel)


def input_gradient(cotangent: jax.Array, kernel: jax.Array, x_shape,
                   stride: int = 1, padding: Padding = VALID) -> jax.Array:
  """The gradient of ``conv(x, kernel, stride, padding)`` with respect to
  x: [B, H, W, C] (``x_shape``) for the cotangent [B, H', W', F], by oneDNN.
  """
  return _call('OnednnConvInputGrad', tuple(x_shape), stride, padding,
               cotangent, kernel)


def _conv_backward(stride, padding, residuals, cotangent):
  x, kernel = residuals
  return (input_gradient(cotangent, kernel, x.shape, stride, padding),
          _call('OnednnConvKernelGrad', kernel.shape, stride, padding, x,
                cotangent))


conv.defvjp(_conv_forward, _conv_backward)
