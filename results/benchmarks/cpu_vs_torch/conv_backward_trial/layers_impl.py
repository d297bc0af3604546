"""Session 11: train step of sum(sin(conv)) per convolution layer of the
shipped models, conv2d's implementations against each other and PyTorch,
one process. argv: BATCH [XLA flags apply through XLA_FLAGS]."""
import sys, time
import numpy as np, jax, jax.numpy as jnp, torch
from experiments import launcher  # noqa: F401
from capsjax import layers
torch.set_num_threads(2)

LAYERS = {  # name: (H, W, C, F, K, stride, padding)
    'capsnet conv1 28x28x1 k9': (28, 28, 1, 256, 9, 1, 'VALID'),
    'capsnet primary 20x20x256 k9 s2': (20, 20, 256, 256, 9, 2, 'VALID'),
    'smoke conv1 28x28x1 k9 ->64': (28, 28, 1, 64, 9, 1, 'VALID'),
    'smoke primary 20x20x64 k9 s2 ->64': (20, 20, 64, 64, 9, 2, 'VALID'),
    'su conv2 26x26x64 k3': (26, 26, 64, 64, 3, 1, 'VALID'),
    'baseline_cnn 28x28x256 k5 SAME': (28, 28, 256, 256, 5, 1, 'SAME'),
    'em conv1 28x28x1 k5 s2 ->32': (28, 28, 1, 32, 5, 2, 'VALID'),
}


def bench(f, *args, n=5):
  jax.block_until_ready(f(*args)); ts = []
  for _ in range(n):
    t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
  return np.median(ts) * 1e3


B = int(sys.argv[1])
impls = sys.argv[2].split(',') if len(sys.argv) > 2 else ['patches', 'space_to_depth', 'direct']
for name, (H, W, C, F, K, s, pad) in LAYERS.items():
  r = np.random.default_rng(0)
  x = jnp.asarray(r.standard_normal((B, H, W, C), np.float32))
  k = jnp.asarray(r.standard_normal((K, K, C, F), np.float32) * .05)
  res = {}
  for impl in impls:
    f = jax.jit(jax.grad(lambda x, k: jnp.sum(jnp.sin(layers.conv2d(x, k, s, pad, impl))), argnums=(0, 1)))
    res[impl] = bench(f, x, k)
  tx = torch.randn(B, C, H, W, requires_grad=True)
  conv = torch.nn.Conv2d(C, F, K, s, padding=K // 2 if pad == 'SAME' else 0)
  def t():
    y = torch.sin(conv(tx)).sum(); y.backward()
  t(); ts = []
  for _ in range(5):
    st = time.perf_counter(); t(); ts.append(time.perf_counter() - st)
  res['torch'] = np.median(ts) * 1e3
  print(f'{name:36s}', ' '.join(f'{a}={v:.1f}' for a, v in res.items()), flush=True)
