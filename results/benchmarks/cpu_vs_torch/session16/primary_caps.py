"""Session 16: the paper CapsNet's PrimaryCaps convolution (9x9, stride 2,
256 -> 256 on 20x20) pass by pass at batch B: XLA's taps lowering, oneDNN's
strided convolution, the space-to-depth regrouping followed by oneDNN's
stride-1 one (5x5 over 1024 channels, 23% zero taps), and PyTorch's;
alternated in one process, 2 threads, host memory retained.
PYTHONPATH=.:results/benchmarks/cpu_vs_torch/profile python this [B] [ROUNDS]"""
import sys
import numpy as np
from train_step import time_calls_alternately  # retains host memory
import jax, jax.numpy as jnp, torch
from capsjax import layers, onednn

B = int(sys.argv[1]) if len(sys.argv) > 1 else 128
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
torch.set_num_threads(2)
rng = np.random.default_rng(0)
x = rng.standard_normal((B, 20, 20, 256), np.float32)
k = rng.standard_normal((9, 9, 256, 256), np.float32) * 0.01
dy = rng.standard_normal((B, 6, 6, 256), np.float32)
xj, kj, dyj = map(jnp.asarray, (x, k, dy))
lowerings = {
    'taps': lambda x, k: layers.conv2d(x, k, 2, 'VALID', 'taps'),
    'onednn strided': lambda x, k: onednn.conv(x, k, 2),
    'space_to_depth + onednn': lambda x, k: onednn.conv(
        *layers._space_to_depth(x, k, 2)),
}
calls = {}
for name, conv in lowerings.items():
  fwd = jax.jit(conv)
  dx = jax.jit(lambda x, k, dy, conv=conv: jax.vjp(lambda x: conv(x, k), x)[1](dy))
  dk = jax.jit(lambda x, k, dy, conv=conv: jax.vjp(lambda k: conv(x, k), k)[1](dy))
  calls[f'{name} forward'] = lambda f=fwd: jax.block_until_ready(f(xj, kj))
  calls[f'{name} input grad'] = lambda f=dx: jax.block_until_ready(f(xj, kj, dyj))
  calls[f'{name} kernel grad'] = lambda f=dk: jax.block_until_ready(f(xj, kj, dyj))
xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
kt = torch.from_numpy(k).permute(3, 2, 0, 1).contiguous()
dyt = torch.from_numpy(dy).permute(0, 3, 1, 2).contiguous()
calls['torch forward'] = lambda: torch.nn.functional.conv2d(xt, kt, stride=2)
calls['torch input grad'] = lambda: torch.nn.grad.conv2d_input(xt.shape, kt, dyt, stride=2)
calls['torch kernel grad'] = lambda: torch.nn.grad.conv2d_weight(xt, kt.shape, dyt, stride=2)
print('oneDNN kernels, strided:', onednn.kernels(x.shape, k.shape, 2))
print('oneDNN kernels, regrouped:', onednn.kernels((B, 10, 10, 1024), (5, 5, 1024, 256)))
times = time_calls_alternately(calls, rounds)
for name in list(lowerings) + ['torch']:
  parts = [times[f'{name} {p}'] * 1e3 for p in ('forward', 'input grad', 'kernel grad')]
  print(f'b{B} {name}: forward {parts[0]:.1f}, input grad {parts[1]:.1f}, '
        f'kernel grad {parts[2]:.1f}, sum {sum(parts):.1f} ms', flush=True)
