"""Session 12: matrix products as YNNPACK fusions (jaxlib 0.10's default)
against XLA:CPU's Eigen ones (--xla_cpu_experimental_ynn_fusion_type=
-individual_dot), one process per setting; run through dots.sh."""
import os, time, numpy as np, jax, jax.numpy as jnp


def bench(f, *args, n=7):
  jax.block_until_ready(f(*args)); ts = []
  for _ in range(n):
    t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
  return np.median(ts) * 1e3


r = np.random.default_rng(0)
arr = lambda *s: jnp.asarray(r.standard_normal(s, np.float32))
cases = {  # name: (m, k, n) of a [m, k] @ [k, n] product
    'PrimaryCaps P @ K (b64)': (2304, 20736, 256),
    'PrimaryCaps dy @ K^T (b64)': (2304, 256, 20736),
    'PrimaryCaps dk tap dy^T @ w (b64)': (256, 2304, 256),
    'Su 3x3 64->64 patches (b128, 26x26)': (128 * 24 * 24, 576, 64),
    'DigitCaps-like votes (b64)': (64 * 1152, 8, 160),
    'square 1024': (1024, 1024, 1024),
}
print('XLA_FLAGS', os.environ.get('XLA_FLAGS'))
for name, (m, k, n) in cases.items():
  a, b = arr(m, k), arr(k, n)
  f = jax.jit(jnp.matmul)
  hlo = f.lower(a, b).compile().as_text()
  ms = bench(f, a, b)
  print(f'{name:38s} {m}x{k}x{n}: {ms:8.2f} ms  {2 * m * k * n / ms / 1e6:6.1f} GFLOP/s'
        f'  ynn={"ynn" in hlo}', flush=True)
