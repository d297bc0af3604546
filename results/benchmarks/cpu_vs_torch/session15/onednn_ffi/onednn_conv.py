"""Session 15 prototype: oneDNN's convolution (onednn_conv.cc, built by
build.sh) as a JAX function with both gradients, for measuring only."""
import ctypes
import functools
import jax
import jax.numpy as jnp

_lib = ctypes.cdll.LoadLibrary('/tmp/libonednn_conv.so')
for name in ('OnednnConvForward', 'OnednnConvInputGrad', 'OnednnConvKernelGrad'):
  jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(_lib, name)),
                              platform='cpu')
_lib.ImplInfo.restype = ctypes.c_char_p


def impl_info(n, h, c, f):
  return _lib.ImplInfo(n, h, c, f).decode()


@jax.custom_vjp
def onednn_conv(x, kernel):
  """VALID stride-1 NHWC convolution: x [N, H, W, C], kernel [Kh, Kw, C, F]."""
  n, h, w, _ = x.shape
  kh, kw, _, f = kernel.shape
  out = jax.ShapeDtypeStruct((n, h - kh + 1, w - kw + 1, f), x.dtype)
  return jax.ffi.ffi_call('OnednnConvForward', out)(x, kernel)


def _forward(x, kernel):
  return onednn_conv(x, kernel), (x, kernel)


def _backward(residuals, dy):
  x, kernel = residuals
  dx = jax.ffi.ffi_call('OnednnConvInputGrad', jax.ShapeDtypeStruct(x.shape, x.dtype))(
      dy, kernel, x)
  dk = jax.ffi.ffi_call('OnednnConvKernelGrad',
                        jax.ShapeDtypeStruct(kernel.shape, kernel.dtype))(x, dy)
  return dx, dk


onednn_conv.defvjp(_forward, _backward)
