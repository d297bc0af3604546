"""Pure helpers the layers call: initialisers, bias addition, pooling,
depthwise convolution and batch normalisation. Nothing here owns parameters.

Shape legend as in ``capsjax.layers``: B the batch, H x W a grid, C channels,
K a kernel size, F features.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from capsjax.kernels.conv.products import sum_rows_float32

# Initialisers. Each draws a flat vector and reshapes it: on XLA:CPU the
# random-bits program for a many-axis shape compiles 5-10x slower (seconds
# per parameter) than for the same number of values in one axis.
# Truncated normals cut at 2 std, as TF's truncated_normal_initializer.
_TRUNCATED_STD = 0.87962566103423978  # std of a unit normal cut at +-2


def normal_init(std: float):
  """Normal(0, std^2) initialiser: (key, shape, dtype) -> array."""
  def init(key, shape, dtype=jnp.float32):
    size = math.prod(shape)
    return std * jax.random.normal(key, (size,), dtype).reshape(shape)
  return init


def truncated_normal_init(std: float):
  """TF's truncated_normal_initializer(stddev=std): N(0, std^2) cut at 2 std."""
  def init(key, shape, dtype=jnp.float32):
    size = math.prod(shape)
    return std * jax.random.truncated_normal(key, -2.0, 2.0, (size,),
                                             dtype).reshape(shape)
  return init


def lecun_normal(key, shape, dtype=jnp.float32):
  """Flax's default kernel initialiser: variance 1 / fan_in, truncated.

  fan_in is the product of every axis but the last (K*K*Cin for a conv).
  """
  fan_in = math.prod(shape[:-1])
  std = 1.0 / math.sqrt(fan_in) / _TRUNCATED_STD
  return truncated_normal_init(std)(key, shape, dtype)


def glorot_uniform(key, shape, dtype=jnp.float32):
  """Keras' default kernel initialiser: U(-l, l), l = sqrt(6 / (fan_in +
  fan_out)).

  For a conv kernel [K, K, Cin, Cout]: fan_in = K*K*Cin, fan_out = K*K*Cout;
  for a dense [Din, Dout]: Din and Dout (Keras' ``_compute_fans``).
  """
  receptive = math.prod(shape[:-2])
  limit = math.sqrt(6.0 / (receptive * (shape[-2] + shape[-1])))
  return jax.random.uniform(key, shape, dtype, -limit, limit)


def he_normal(key, shape, dtype=jnp.float32):
  """Keras' he_normal: variance 2 / fan_in, a normal cut at 2 std.

  fan_in is the product of every axis but the last: K*K*Cin for a conv,
  Din for a dense layer, I*O*Din for capsule transforms [I, O, Din, Dout]
  (Keras' ``_compute_fans`` gives the same for all three).
  """
  std = math.sqrt(2.0 / math.prod(shape[:-1])) / _TRUNCATED_STD
  return truncated_normal_init(std)(key, shape, dtype)


def glorot_normal(key, shape, dtype=jnp.float32):
  """Keras' glorot_normal: variance 2 / (fan_in + fan_out), a normal cut at
  2 std (fans as in ``glorot_uniform``)."""
  receptive = math.prod(shape[:-2])
  std = math.sqrt(2.0 / (receptive * (shape[-2] + shape[-1]))) / _TRUNCATED_STD
  return truncated_normal_init(std)(key, shape, dtype)


KERNEL_INITS = {'lecun_normal': lecun_normal, 'glorot_uniform': glorot_uniform}


def add_bias(y: jax.Array, bias: jax.Array) -> jax.Array:
  """y + bias along the last axis: y [..., F], bias [F] -> [..., F] in y's
  dtype.

  The bias gradient, the cotangent summed over every other axis, is
  accumulated in float32, or float64 where the cotangent is float64. Left
  to autodiff, a bfloat16 bias sums its gradient in bfloat16 on XLA:CPU:
  over a batch-128 26x26 convolution output that sum was off by 19% of its
  norm, and took about 10x as long as the float32 sum. (Where y and bias
  are both float32 or both float64 this is plain addition, autodiff summing
  in their dtype; else a custom VJP: reverse mode only, as training uses
  it.)
  """
  if y.dtype == bias.dtype == jnp.promote_types(y.dtype, jnp.float32):
    return y + bias.reshape((1,) * (y.ndim - 1) + (-1,))  # autodiff's own sum
  return _add_bias_f32_sum(y, bias)


@jax.custom_vjp
def _add_bias_f32_sum(y: jax.Array, bias: jax.Array) -> jax.Array:
  return y + bias.astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))


def _add_bias_fwd(y, bias):
  return _add_bias_f32_sum(y, bias), bias  # [F]: only its dtype is needed


def _sum_rows(dy: jax.Array) -> jax.Array:
  """dy [..., F] summed over every axis but the last: [F], in float32, or
  float64 for a float64 dy (``sum_rows_float32`` would round it)."""
  if jnp.promote_types(dy.dtype, jnp.float32) != jnp.float32:
    return jnp.sum(dy, axis=tuple(range(dy.ndim - 1)))
  return sum_rows_float32(dy)


def _add_bias_bwd(bias, dy):
  return dy, _sum_rows(dy).astype(bias.dtype)


_add_bias_f32_sum.defvjp(_add_bias_fwd, _add_bias_bwd)


def average_pool_2x2(x: jax.Array) -> jax.Array:
  """Keras' AveragePooling2D(2): [B, H, W, C] -> [B, H // 2, W // 2, C] (an
  odd last row or column dropped).

  Four strided slices summed, which XLA:CPU fuses with the ReLU before it
  into one loop; a reshape and mean becomes a YNNPACK reduction, for which
  XLA materialises its operands, zeros included (Su's capsule model trained
  1.02x faster at batch 128 with the slices: BENCHMARKS.md).
  Summed in float32 for bfloat16 inputs.
  """
  h, w = x.shape[1] // 2 * 2, x.shape[2] // 2 * 2
  wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  total = ((wide[:, 0:h:2, 0:w:2] + wide[:, 0:h:2, 1:w:2]) +
           (wide[:, 1:h:2, 0:w:2] + wide[:, 1:h:2, 1:w:2]))
  return (0.25 * total).astype(x.dtype)


def depthwise_conv2d(x: ArrayLike, kernel: ArrayLike, stride: int = 1,
                     padding: str = 'VALID') -> jax.Array:
  """Depthwise convolution, NHWC: channel c convolved with its own kernel.

  Keras' ``Conv2D(C, K, groups=C)`` on C channels (one output channel per
  input channel): out[b, i, j, c] = sum_{u, v} x[b, s i + u, s j + v, c]
  kernel[u, v, 0, c].

  Computed without XLA's grouped convolution, whose gradient on a CPU took
  65 of the 122 ms of an Efficient-CapsNet train step at batch 16 (a 9 x 9
  kernel on a 9 x 9 map): a kernel that covers the whole input is one
  product and sum; otherwise the sum over the K x K taps of strided
  slices, which XLA fuses into one loop forward and backward.

  Args:
    x: [B, H, W, C].
    kernel: [K, K, 1, C].
    padding: 'VALID' or 'SAME' (XLA's split: the extra row or column at the
      end).
  Returns:
    [B, H', W', C], H' = (H - K) // stride + 1 with 'VALID' padding,
    ceil(H / stride) with 'SAME'.
  """
  x, kernel = jnp.asarray(x), jnp.asarray(kernel)
  if kernel.ndim != 4 or kernel.shape[2] != 1 or kernel.shape[3] != x.shape[-1]:
    raise ValueError(f'depthwise_conv2d: kernel must be [K, K, 1, C] with C = '
                     f'{x.shape[-1]} (the input channels), got {kernel.shape}.')
  k_h, k_w = kernel.shape[:2]
  pads = jax.lax.padtype_to_pads(x.shape[1:3], (k_h, k_w), (stride, stride),
                                 padding)
  x = jnp.pad(x, ((0, 0), *pads, (0, 0)))
  out_h = (x.shape[1] - k_h) // stride + 1
  out_w = (x.shape[2] - k_w) // stride + 1
  kernel = kernel.astype(x.dtype)
  if out_h == out_w == 1:
    window = x[:, :k_h, :k_w, :]
    return jnp.einsum('bhwc,hwc->bc', window, kernel[:, :, 0])[:, None, None]
  out = None
  for u in range(k_h):
    for v in range(k_w):
      window = jax.lax.slice(
          x, (0, u, v, 0),
          (x.shape[0], u + stride * (out_h - 1) + 1,
           v + stride * (out_w - 1) + 1, x.shape[3]), (1, stride, stride, 1))
      tap = window * kernel[u:u + 1, v:v + 1]  # [1, 1, 1, C]
      out = tap if out is None else out + tap
  return out


def batch_norm(x: ArrayLike, scale: ArrayLike, offset: ArrayLike,
               mean: ArrayLike, var: ArrayLike, *, train: bool,
               momentum: float, epsilon: float
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Batch normalisation over every axis but the last, as TensorFlow's fused
  kernel computes it (FusedBatchNorm, which Keras 2's BatchNormalization
  runs on 4-D inputs).

  With ``train``, x is normalised by its batch mean m and biased variance v
  (two passes: the mean of the squared centred values), and the running
  averages become

      mean' = momentum * mean + (1 - momentum) * m
      var'  = momentum * var + (1 - momentum) * n / (n - 1) * v

  with n = the values per channel (B*H*W): the running variance takes the
  unbiased (Bessel-corrected) batch variance, as TF's kernel does (its
  ``rest_size_adjust``; 1 for n = 1). flax's BatchNorm and Keras 3 take the
  biased v there. Otherwise x is normalised by (mean, var), returned as
  they are. Either way y = (x - mu) / sqrt(sigma^2 + epsilon) * scale +
  offset.

  Args:
    x: [..., C].
    scale, offset, mean, var: [C].
  Returns:
    (y [..., C], mean' [C], var' [C]), in x's dtype promoted with the
    statistics' and float32 (a bfloat16 x is normalised in float32); no
    gradient flows into the running averages.
  """
  x = jnp.asarray(x)
  dtype = jnp.result_type(x, scale, offset, mean, var, jnp.float32)
  wide = x.astype(dtype)
  mean, var = jnp.asarray(mean, dtype), jnp.asarray(var, dtype)
  if train:
    axes = tuple(range(wide.ndim - 1))
    count = math.prod(wide.shape[:-1])
    batch_mean = jnp.mean(wide, axis=axes, keepdims=True)
    batch_var = jnp.mean(jnp.square(wide - batch_mean), axis=axes)
    batch_mean = batch_mean.reshape(batch_var.shape)
    bessel = count / max(count - 1, 1)
    new_mean = jax.lax.stop_gradient(
        momentum * mean + (1 - momentum) * batch_mean)
    new_var = jax.lax.stop_gradient(
        momentum * var + (1 - momentum) * bessel * batch_var)
    mean, var = batch_mean, batch_var
  else:
    new_mean, new_var = mean, var

  def spread(a):  # [C] -> x's shape: no implicit rank promotion
    return jnp.broadcast_to(jnp.asarray(a, dtype), wide.shape)

  factor = jax.lax.rsqrt(var + epsilon) * jnp.asarray(scale, dtype)
  y = (wide - spread(mean)) * spread(factor) + spread(offset)
  return y, new_mean, new_var


def dense(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
  """[..., Cin] @ [Cin, F] + [F], broadcast explicitly (no rank promotion)."""
  return add_bias(jnp.einsum('...c,cf->...f', x, kernel), bias)


def capsule_transform_init(key: jax.Array, shape: Sequence[int],
                           pose_size: int, transform_std: float | None,
                           transform_init: str = 'normal') -> jax.Array:
  """Matrix-capsule transforms of ``shape``: a normal (or, 'truncated', TF's
  truncated normal: the released code's) with std ``transform_std``, default
  1/sqrt(pose_size)."""
  std = 1.0 / math.sqrt(pose_size) if transform_std is None else transform_std
  if transform_init not in ('normal', 'truncated'):
    raise ValueError(f"transform_init must be 'normal' or 'truncated', got "
                     f'{transform_init!r}.')
  init = truncated_normal_init if transform_init == 'truncated' else normal_init
  return init(std)(key, tuple(shape))
