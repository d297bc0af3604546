"""oneDNN's convolutions on the CPU, through an XLA FFI call (optional).

XLA:CPU's own (Eigen) convolutions run every pass of Su's 3x3 layers
10-20% slower than oneDNN's, and XLA:CPU hands no convolution to a faster
library (BENCHMARKS.md, session 15). With oneDNN's wheels installed
(``pip install 'capsjax[onednn]'``) and a C++ compiler on the machine, the
first use compiles ``csrc/onednn_conv.cc`` against jaxlib's FFI headers
(about 3 s, once per source and jaxlib version) into the user's cache
(``$CAPSJAX_CACHE_DIR``, else ``~/.cache/capsjax``) and registers its three
handlers; ``layers.conv2d`` then runs VALID stride-1 float32 convolutions
of 16 input channels and more through it on the CPU. Without the wheels or
a compiler, or with ``CAPSJAX_ONEDNN=0``, nothing changes: ``status()``
says why.
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
  return lib, 'in use (VALID stride-1 float32 convolutions of 16+ channels)'


def available() -> bool:
  """Whether oneDNN's convolutions are built, loaded and registered."""
  return _load()[0] is not None


def status() -> str:
  """What this process does with oneDNN, in words."""
  return _load()[1]


def kernels(batch: int, size: int, in_channels: int, out_channels: int
            ) -> str:
  """The oneDNN kernels for a 3x3 convolution of [batch, size, size,
  in_channels] (forward and both gradients), in words."""
  lib, why = _load()
  if lib is None:
    raise RuntimeError(f'oneDNN convolutions: {why}')
  return lib.ImplInfo(batch, size, in_channels, out_channels).decode()


def _call(target: str, shape, *operands) -> jax.Array:
  out = jax.ShapeDtypeStruct(shape, jnp.float32)
  return jax.ffi.ffi_call(target, out, vmap_method='sequential')(*operands)


@jax.custom_vjp
def conv(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """VALID stride-1 convolution by oneDNN.

  Args:
    x: [B, H, W, C] float32, B >= 1.
    kernel: [Kh, Kw, C, F] float32, Kh <= H, Kw <= W.
  Returns:
    [B, H - Kh + 1, W - Kw + 1, F].
  """
  if not available():
    raise RuntimeError(f'oneDNN convolutions: {status()}')
  b, h, w, _ = x.shape
  k_h, k_w, _, f = kernel.shape
  return _call('OnednnConvForward', (b, h - k_h + 1, w - k_w + 1, f), x,
               kernel)


def _conv_forward(x, kernel):
  return conv(x, kernel), (x, kernel)


def _conv_backward(residuals, cotangent):
  x, kernel = residuals
  return (_call('OnednnConvInputGrad', x.shape, cotangent, kernel),
          _call('OnednnConvKernelGrad', kernel.shape, x, cotangent))


conv.defvjp(_conv_forward, _conv_backward)
