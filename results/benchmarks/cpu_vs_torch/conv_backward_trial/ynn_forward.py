"""Session 11: forward of Su's second 3x3 convolution ([128, 26, 26, 64] x [3, 3, 64, 64]) as XLA:CPU compiles it in a few contexts. Run with and without XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-individual_convolution (and CAPSJAX_YNN_CONVOLUTIONS=1, since importing capsjax now sets that flag)."""
import time, numpy as np, jax, jax.numpy as jnp
from experiments import launcher  # noqa: F401
from capsjax import layers
def bench(f, *args, n=9):
  jax.block_until_ready(f(*args)); ts = []
  for _ in range(n):
    t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
  return np.median(ts)
r = np.random.default_rng(0)
x = jnp.asarray(r.standard_normal((128, 26, 26, 64), np.float32))
k = jnp.asarray(r.standard_normal((3, 3, 64, 64), np.float32) * .1)
dy = jnp.asarray(r.standard_normal((128, 24, 24, 64), np.float32))
fs = {
 'fwd': jax.jit(layers._lax_conv),
 'fwd_padded_in_jit': jax.jit(lambda x, k: layers._lax_conv(jnp.pad(x, ((0,0),(1,1),(1,1),(0,0))), k)),
 'fwd_flipk': jax.jit(lambda x, k: layers._lax_conv(x, jnp.flip(k, (0,1)).swapaxes(2,3))),
 'fwd_sin': jax.jit(lambda x, k: jnp.sin(layers._lax_conv(x, k))),
 'fwd_sum': jax.jit(lambda x, k: jnp.sum(layers._lax_conv(x, k))),
}
for rep in range(2):
  for n, f in fs.items():
    print(rep, n, round(bench(f, x, k)*1e3, 1), flush=True)
  print(rep, 'dx_conv', round(bench(jax.jit(lambda d, k: layers._lax_conv(jnp.pad(d, ((0,0),(2,2),(2,2),(0,0))), jnp.flip(k,(0,1)).swapaxes(2,3))), dy, k)*1e3,1))
