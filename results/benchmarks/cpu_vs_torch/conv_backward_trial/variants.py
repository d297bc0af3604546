"""Session 11: backward-pass variants of a 3x3 stride-1 VALID convolution,
train step of sum(sin(conv(x, k))) at Su's four layer shapes, against the
shipped patches path and PyTorch, in one process."""
import sys, time
import numpy as np, jax, jax.numpy as jnp, torch
from experiments import launcher  # noqa: F401  (imports capsjax; applies no host-memory setting)
from capsjax import layers
torch.set_num_threads(2)


def bench(f, *args, n=7):
  jax.block_until_ready(f(*args)); ts = []
  for _ in range(n):
    t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
  return np.median(ts)


def dx_by_conv(dy, kernel):
  """Input gradient of a stride-1 VALID conv as a forward conv: the
  cotangent padded by K-1 on each side, correlated with the kernel flipped
  in space and with its channel axes swapped."""
  kh, kw = kernel.shape[:2]
  flipped = jnp.flip(kernel, (0, 1)).swapaxes(2, 3)
  dy = jnp.pad(dy, ((0, 0), (kh - 1, kh - 1), (kw - 1, kw - 1), (0, 0)))
  return layers._lax_conv(dy, flipped)


def dk_by_patches(x, dy, kernel):
  kh, kw, c, f = kernel.shape
  p = layers._patches(x, kh, kw)
  return jnp.einsum('bhwk,bhwf->kf', p, dy).reshape(kh, kw, c, f)


def dk_by_slices(x, dy, kernel):
  kh, kw, c, f = kernel.shape
  oh, ow = dy.shape[1:3]
  taps = [jnp.einsum('bhwc,bhwf->cf', x[:, i:i + oh, j:j + ow], dy)
          for i in range(kh) for j in range(kw)]
  return jnp.stack(taps).reshape(kh, kw, c, f)


def dk_by_flat(x, dy, kernel):
  """Flattened rows: tap (i, j) is the contiguous slice at offset i*W+j of
  x's [B, H*W, C] rows, against dy padded to the full width W."""
  kh, kw, c, f = kernel.shape
  b, h, w, _ = x.shape
  oh = dy.shape[1]
  dyf = jnp.pad(dy, ((0, 0), (0, 0), (0, w - dy.shape[2]), (0, 0))).reshape(b, oh * w, f)
  xf = jnp.pad(x.reshape(b, h * w, c), ((0, 0), (0, kw), (0, 0)))
  taps = [jnp.einsum('bpc,bpf->cf', xf[:, i * w + j:i * w + j + oh * w], dyf)
          for i in range(kh) for j in range(kw)]
  return jnp.stack(taps).reshape(kh, kw, c, f)


def dk_by_conv(x, dy, kernel):
  """Kernel gradient as a forward conv: batch <-> channels swapped."""
  kh, kw = kernel.shape[:2]
  lhs = x.transpose(3, 1, 2, 0)            # [C, H, W, B]: batch=C, feature=B
  rhs = dy.transpose(1, 2, 0, 3)           # [oh, ow, B, F]: HWIO
  return layers._lax_conv(lhs, rhs).transpose(1, 2, 0, 3)  # [C,kh,kw,F]->[kh,kw,C,F]


def make(dk_fn):
  @jax.custom_vjp
  def conv(x, k):
    return layers._lax_conv(x, k)
  conv.defvjp(lambda x, k: (layers._lax_conv(x, k), (x, k)),
              lambda res, dy: (dx_by_conv(dy, res[1]), dk_fn(res[0], dy, res[1])))
  return conv


VARIANTS = {
    'patches': layers.patches_conv,
    'xla': layers._lax_conv,
    'convdx+patchdk': make(dk_by_patches),
    'convdx+slicedk': make(dk_by_slices),
    'convdx+flatdk': make(dk_by_flat),
    'convdx+convdk': make(dk_by_conv),
}

B = int(sys.argv[1])
shapes = [(28, 1, 64), (26, 64, 64), (12, 64, 128), (10, 128, 128)]
if len(sys.argv) > 2:
  shapes = [shapes[int(i)] for i in sys.argv[2].split(',')]
for H, C, F in shapes:
  r = np.random.default_rng(0)
  x = jnp.asarray(r.standard_normal((B, H, H, C), np.float32))
  k = jnp.asarray(r.standard_normal((3, 3, C, F), np.float32) * .1)
  def loss(conv):
    return jax.jit(jax.grad(lambda x, k: jnp.sum(jnp.sin(conv(x, k))), argnums=(0, 1)))
  ref = loss(layers._lax_conv)(x, k)
  res = {}
  for name, conv in VARIANTS.items():
    g = loss(conv)(x, k)
    for a, b_ in zip(g, ref):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=2e-3, atol=2e-3 * float(jnp.abs(b_).max()))
    res[name] = bench(loss(conv), x, k)
  dy = jnp.ones((B, H - 2, H - 2, F), jnp.float32)
  res['part:fwd'] = bench(jax.jit(layers._lax_conv), x, k)
  res['part:dx_conv'] = bench(jax.jit(dx_by_conv), dy, k)
  for name, fn in [('patch', dk_by_patches), ('slice', dk_by_slices), ('flat', dk_by_flat), ('conv', dk_by_conv)]:
    res[f'part:dk_{name}'] = bench(jax.jit(fn), x, dy, k)
  tx = torch.randn(B, C, H, H, requires_grad=True); conv = torch.nn.Conv2d(C, F, 3)
  def t():
    y = torch.sin(conv(tx)).sum(); y.backward()
  t(); ts = []
  for _ in range(7):
    s = time.perf_counter(); t(); ts.append(time.perf_counter() - s)
  res['torch_train'] = np.median(ts)
  print(H, C, F, ' '.join(f'{a}={v*1e3:.1f}' for a, v in res.items()), flush=True)
