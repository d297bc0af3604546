import time, sys, numpy as np, jax, jax.numpy as jnp
from capsjax import layers
def bench(f, *args, n=5):
    jax.block_until_ready(f(*args)); ts=[]
    for _ in range(n):
        t=time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter()-t)
    return np.median(ts)
B=128
for H, C, F in [(28, 1, 64), (26, 64, 64), (12, 64, 128), (10, 128, 128)]:
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((B,H,H,C),np.float32)); k = jnp.asarray(r.standard_normal((3,3,C,F),np.float32)*.1)
    def loss(conv):
        return jax.jit(jax.grad(lambda x, k: jnp.sum(jnp.sin(conv(x, k))), argnums=(0, 1)))
    res = {'fwd_lax': bench(jax.jit(layers._lax_conv), x, k), 'train_lax': bench(loss(layers._lax_conv), x, k), 'train_patches': bench(loss(layers.patches_conv), x, k)}
    print(H, C, F, ' '.join(f'{a}={v*1e3:.1f}' for a, v in res.items()), flush=True)
