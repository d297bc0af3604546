"""Session 15: Su's 26x26x64->64 convolution at batch B, each pass alone
(forward, input gradient, kernel gradient of lax.conv_general_dilated),
under this process's XLA_FLAGS, with the fusion kind the compiled HLO gives
each: is there an XLA:CPU convolution faster than Eigen's?
PYTHONPATH=. XLA_FLAGS=... CAPSJAX_YNN_CONVOLUTIONS=1 python this [B]"""
import os, re, sys, time, numpy as np
from capsjax.training import host_memory
host_memory.retain_freed_memory()
import jax, jax.numpy as jnp
print('XLA_FLAGS:', os.environ.get('XLA_FLAGS'))
B = int(sys.argv[1]) if len(sys.argv) > 1 else 128
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((B, 26, 26, 64), np.float32))
k = jnp.asarray(rng.standard_normal((3, 3, 64, 64), np.float32) * 0.1)
dy = jnp.asarray(rng.standard_normal((B, 24, 24, 64), np.float32))
conv = lambda x, k: jax.lax.conv_general_dilated(
    x, k, (1, 1), 'VALID', dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
fns = {'forward': (jax.jit(conv), (x, k)),
       'input grad': (jax.jit(lambda x, k, dy: jax.vjp(lambda x: conv(x, k), x)[1](dy)), (x, k, dy)),
       'kernel grad': (jax.jit(lambda x, k, dy: jax.vjp(lambda k: conv(x, k), k)[1](dy)), (x, k, dy))}
out = []
for name, (f, args) in fns.items():
  hlo = f.lower(*args).compile().as_text()
  kinds = sorted(set(re.findall(r'(ynn_fusion|xnn_fusion|onednn\w*|convolution)', hlo)))
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(5):
    t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
  out.append(f'{name} {np.median(ts) * 1e3:.1f} ms [{",".join(kinds)}]')
print(f'b{B}: ' + '; '.join(out), flush=True)
