"""Session 11: parts of the paper CapsNet's PrimaryCaps convolution
(9x9, stride 2, 256 -> 256 channels on 20x20) at batch 64."""
import time, numpy as np, jax, jax.numpy as jnp
from experiments import launcher  # noqa: F401
from capsjax import layers


def bench(f, *args, n=5):
  jax.block_until_ready(f(*args)); ts = []
  for _ in range(n):
    t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
  return np.median(ts) * 1e3


def strided_patches(x, k, s):
  kh, kw = k.shape[:2]
  oh, ow = (x.shape[1] - kh) // s + 1, (x.shape[2] - kw) // s + 1
  return jnp.concatenate([x[:, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s]
                          for i in range(kh) for j in range(kw)], -1)


B = 64
r = np.random.default_rng(0)
x = jnp.asarray(r.standard_normal((B, 20, 20, 256), np.float32))
k = jnp.asarray(r.standard_normal((9, 9, 256, 256), np.float32) * .01)
dy = jnp.asarray(r.standard_normal((B, 6, 6, 256), np.float32))
xs, ks = layers._space_to_depth(x, k, 2)
P = jax.jit(strided_patches, static_argnums=2)(x, k, 2)
kmat = k.reshape(-1, 256)
res = {
    'fwd direct strided': bench(jax.jit(lambda x, k: layers._lax_conv(x, k, 2)), x, k),
    'fwd s2d conv': bench(jax.jit(layers._lax_conv), xs, ks),
    's2d regroup': bench(jax.jit(lambda x, k: layers._space_to_depth(x, k, 2)), x, k),
    'strided patches build': bench(jax.jit(strided_patches, static_argnums=2), x, k, 2),
    'P @ K': bench(jax.jit(jnp.matmul), P, kmat),
    'P^T @ dy (dk)': bench(jax.jit(lambda P, d: jnp.einsum('bhwk,bhwf->kf', P, d)), P, dy),
    'dy @ K^T (dP)': bench(jax.jit(lambda d, K: d @ K.T), dy, kmat),
    'col2im (vjp of patches)': bench(jax.jit(lambda x, dP: jax.vjp(lambda x: strided_patches(x, k, 2), x)[1](dP)[0]), x, P),
    'dk by s2d conv (xla autodiff)': bench(jax.jit(jax.grad(lambda k: jnp.vdot(layers._lax_conv(xs, k), dy))), ks),
    'dx by s2d conv (xla autodiff)': bench(jax.jit(jax.grad(lambda xs: jnp.vdot(layers._lax_conv(xs, ks), dy))), xs),
}
for a, v in res.items():
  print(f'{a:32s} {v:8.1f} ms', flush=True)
