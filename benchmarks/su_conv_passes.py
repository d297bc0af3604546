"""Each pass of the 3x3 convolutions of Su's trunk alone, capsjax against PyTorch.

    pip install -e '.[bench,onednn]'
    python -m benchmarks.su_conv_passes [BATCH] [ROUNDS]     # defaults: 128, 7
    CAPSJAX_ONEDNN=0 python -m benchmarks.su_conv_passes     # XLA's lowerings

For the 26x26x64 -> 64, 12x12x64 -> 128 and 10x10x128 -> 128 layers of
Su's two-digit models: the forward pass, the input gradient and the kernel
gradient, each jitted alone, as ``lowerings.conv2d`` lowers them by default
(oneDNN's convolution where the onednn extra is installed), and PyTorch's
``conv2d``, ``conv2d_input`` and ``conv2d_weight``; alternated in one
process on 2 threads, host memory retained; median ms per call. Record:
results/benchmarks/onednn_convolutions/.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks import timing
from capsjax.conv import dispatch
from capsjax.conv import lowerings
from capsjax.conv import onednn

LAYERS = ((26, 26, 64, 64), (12, 12, 64, 128), (10, 10, 128, 128))


def main(argv: list[str]) -> None:
  print('host memory:', timing.retain_host_memory(), flush=True)
  batch = int(argv[1]) if len(argv) > 1 else 128
  rounds = int(argv[2]) if len(argv) > 2 else 7
  torch.set_num_threads(2)
  rng = np.random.default_rng(0)
  for h, w, c, f in LAYERS:
    x = rng.standard_normal((batch, h, w, c), np.float32)
    k = rng.standard_normal((3, 3, c, f), np.float32) * 0.1
    dy = rng.standard_normal((batch, h - 2, w - 2, f), np.float32)
    xj, kj, dyj = map(jnp.asarray, (x, k, dy))

    def conv(x, k):
      return lowerings.conv2d(x, k)

    fwd = jax.jit(conv)
    dx = jax.jit(lambda x, k, dy: jax.vjp(lambda x: conv(x, k), x)[1](dy))
    dk = jax.jit(lambda x, k, dy: jax.vjp(lambda k: conv(x, k), k)[1](dy))
    xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
    kt = torch.from_numpy(k).permute(3, 2, 0, 1).contiguous()
    dyt = torch.from_numpy(dy).permute(0, 3, 1, 2).contiguous()
    calls = {
        'forward': lambda: jax.block_until_ready(fwd(xj, kj)),
        'input grad': lambda: jax.block_until_ready(dx(xj, kj, dyj)),
        'kernel grad': lambda: jax.block_until_ready(dk(xj, kj, dyj)),
        'torch forward': lambda: torch.nn.functional.conv2d(xt, kt),
        'torch input grad': lambda: torch.nn.grad.conv2d_input(
            xt.shape, kt, dyt),
        'torch kernel grad': lambda: torch.nn.grad.conv2d_weight(
            xt, kt.shape, dyt),
    }
    times = timing.time_calls_alternately(calls, rounds)
    impl = dispatch.cpu_conv_impl(
        c, 1, h * w, (h - 2) * (w - 2), onednn=onednn.available())
    print(f'{h}x{w}x{c}->{f} ({impl}), b{batch}: ' + ', '.join(
        f'{n} {t * 1e3:.1f}' for n, t in times.items()) + ' ms', flush=True)


if __name__ == '__main__':
  main(sys.argv)
