"""Session 13: a narrow first convolution's train-step part (forward with
bias and ReLU, kernel and bias gradients; the images need no gradient),
as shipped (patches_conv) and with the kernel gradient as one plain GEMM
over channel-major patches. PYTHONPATH=. python this [32] (parts_first.log: the first version, shipped
against the XLA-forward variant only; parts_variants.log: this, no argument)."""
import time, sys
import capsjax  # noqa: F401  (sets the CPU flags)
import jax, jax.numpy as jnp
import numpy as np
from capsjax import layers


def channel_major_patches(x, k_h, k_w):
  """[Kh*Kw*C, B*H'*W']: the windows of x [B, H, W, C], (i, j, c) rows."""
  b, h, w, c = x.shape
  oh, ow = h - k_h + 1, w - k_w + 1
  xt = jnp.moveaxis(x, -1, 0)  # [C, B, H, W]
  rows = [xt[:, :, i:i + oh, j:j + ow] for i in range(k_h) for j in range(k_w)]
  return jnp.stack(rows).reshape(k_h * k_w * c, b * oh * ow)


@jax.custom_vjp
def gemm_conv(x, kernel):
  return layers._lax_conv(x, kernel)

def _fwd(x, kernel):
  return layers._lax_conv(x, kernel), (x, kernel)

def _bwd(res, dy):
  x, kernel = res
  k_h, k_w, c, f = kernel.shape
  p = channel_major_patches(x, k_h, k_w)
  gk = (p @ dy.reshape(-1, f)).reshape(k_h, k_w, c, f)
  _, vjp = jax.vjp(lambda x: layers._lax_conv(x, kernel), x)
  return vjp(dy)[0], gk
gemm_conv.defvjp(_fwd, _bwd)


@jax.custom_vjp
def gemm_conv_patches_forward(x, kernel):
  return layers._lax_conv(x, kernel)

def _fwd2(x, kernel):
  return layers._patches_matmul(x, kernel), (x, kernel)
gemm_conv_patches_forward.defvjp(_fwd2, _bwd)


def make(conv, shape, k, f):
  def loss(params, x, w):
    y = jax.nn.relu(conv(x, params['k']) + params['b'])
    return jnp.sum(y * w)
  g = jax.jit(jax.grad(loss))
  return g


def timeit(fn, *args, n=None):
  n = n or (20 if THIRTY_TWO else 10)
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(n):
    t = time.perf_counter(); jax.block_until_ready(fn(*args)); ts.append(time.perf_counter() - t)
  return np.median(ts) * 1e3

# argv[1] '32': the 32-feature first layers, 5 rounds of 20 calls
# (parts_32_features.log); else the others, 3 rounds of 10.
THIRTY_TWO = sys.argv[1:] == ['32']
SHAPES = ((('EM smoke conv1 b32', (32, 24, 24, 1), 5, 32),
           ('EM smoke conv1 b128', (128, 24, 24, 1), 5, 32),
           ('smoke CapsNet conv1 b64', (64, 28, 28, 1), 9, 32),
           ('smoke CapsNet conv1 b128', (128, 28, 28, 1), 9, 32))
          if THIRTY_TWO else
          (('Su conv1 b128', (128, 28, 28, 1), 3, 64),
           ('Su conv1 b64', (64, 28, 28, 1), 3, 64),
           ('Su conv1 b128, 56x28 pairs', (128, 56, 28, 1), 3, 64),
           ('baseline CNN conv1 b128', (128, 32, 32, 1), 5, 256),
           ('paper CapsNet conv1 b128', (128, 28, 28, 1), 9, 256),
           ('smoke CapsNet conv1 b128', (128, 28, 28, 1), 9, 32)))
for name, shape, k, f in SHAPES:
  kx, kk, kw = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, shape)
  params = {'k': 0.1 * jax.random.normal(kk, (k, k, shape[-1], f)), 'b': jnp.zeros(f)}
  w = jax.random.normal(kw, (shape[0], shape[1] - k + 1, shape[2] - k + 1, f))
  # 'shipped': 5891acb's default for these layers, patches_conv.
  shipped = make(lambda x, k: layers.conv2d(x, k, impl='patches'), shape, k, f)
  gemm = make(gemm_conv, shape, k, f)
  gemm2 = make(gemm_conv_patches_forward, shape, k, f)
  a, b, c = shipped(params, x, w), gemm(params, x, w), gemm2(params, x, w)
  err = max(float(jnp.max(jnp.abs(a[n] - o[n])) / jnp.max(jnp.abs(a[n]))) for n in a for o in (b, c))
  for r in range(5 if THIRTY_TWO else 3):
    print(f'{name}: shipped {timeit(shipped, params, x, w):.1f} ms, gemm kernel gradient (XLA forward) {timeit(gemm, params, x, w):.1f} ms, (patches forward) {timeit(gemm2, params, x, w):.1f} ms (rel. diff {err:.1e})', flush=True)
