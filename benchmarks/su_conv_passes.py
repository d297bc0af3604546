"""Each pass of the 3x3 convolutions of Su's trunk alone, capsjax against PyTorch.

    pip install -e '.[bench,onednn]'
    python -m benchmarks.su_conv_passes [BATCH] [ROUNDS] [DTYPE]
                        # defaults: 128, 7, float32 (or bfloat16)
    CAPSJAX_IMPLEMENTATION=xla python -m benchmarks.su_conv_passes  # XLA's lowerings

For the 26x26x64 -> 64, 12x12x64 -> 128 and 10x10x128 -> 128 layers of
Su's two-digit models: the forward pass, the input gradient and the kernel
gradient, each jitted alone, as ``capsjax.kernels.conv2d`` runs them by default
(oneDNN's convolution where the onednn extra is installed), and PyTorch's
``conv2d``, ``conv2d_input`` and ``conv2d_weight`` (in bfloat16 also on
channels-last tensors, the layout ``torch.compile`` may pick); alternated in
one process on 2 threads, host memory retained; median ms per call and
GFLOP/s (2 * MACs). Record: results/benchmarks/onednn_convolutions/.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks import timing
from capsjax import kernels
from capsjax.kernels.conv import dispatch
from capsjax.kernels.conv import onednn

LAYERS = ((26, 26, 64, 64), (12, 12, 64, 128), (10, 10, 128, 128))


def main(argv: list[str]) -> None:
  print('host memory:', timing.retain_host_memory(), flush=True)
  batch = int(argv[1]) if len(argv) > 1 else 128
  rounds = int(argv[2]) if len(argv) > 2 else 7
  dtype = argv[3] if len(argv) > 3 else 'float32'
  if dtype not in ('float32', 'bfloat16'):
    raise SystemExit(f'DTYPE must be float32 or bfloat16, got {dtype!r}.')
  bf16 = dtype == 'bfloat16'
  torch_dtype = torch.bfloat16 if bf16 else torch.float32
  torch.set_num_threads(2)
  rng = np.random.default_rng(0)
  for h, w, c, f in LAYERS:
    x = rng.standard_normal((batch, h, w, c), np.float32)
    k = rng.standard_normal((3, 3, c, f), np.float32) * 0.1
    dy = rng.standard_normal((batch, h - 2, w - 2, f), np.float32)
    xj, kj, dyj = (jnp.asarray(a, dtype) for a in (x, k, dy))

    def conv(x, k):
      return kernels.conv2d(x, k)

    fwd = jax.jit(conv)
    dx = jax.jit(lambda x, k, dy: jax.vjp(lambda x: conv(x, k), x)[1](dy))
    dk = jax.jit(lambda x, k, dy: jax.vjp(lambda k: conv(x, k), k)[1](dy))
    xt, kt, dyt = (torch.from_numpy(a).permute(*order).contiguous().to(
        torch_dtype) for a, order in ((x, (0, 3, 1, 2)), (k, (3, 2, 0, 1)),
                                      (dy, (0, 3, 1, 2))))
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
    if bf16:
      last = torch.channels_last
      xl, kl, dyl = (a.contiguous(memory_format=last) for a in (xt, kt, dyt))
      calls |= {
          'torch NHWC forward': lambda: torch.nn.functional.conv2d(xl, kl),
          'torch NHWC input grad': lambda: torch.nn.grad.conv2d_input(
              xl.shape, kl, dyl),
          'torch NHWC kernel grad': lambda: torch.nn.grad.conv2d_weight(
              xl, kl.shape, dyl),
      }
    times = timing.time_calls_alternately(calls, rounds)
    impl = dispatch.cpu_conv_impl(
        c, 1, h * w, (h - 2) * (w - 2), onednn=onednn.available(),
        bfloat16=bf16)
    flop = 2 * batch * (h - 2) * (w - 2) * 9 * c * f
    print(f'{h}x{w}x{c}->{f} ({impl}, {dtype}), b{batch}: ' + ', '.join(
        f'{n} {t * 1e3:.1f} ms ({flop / t / 1e9:.0f} GFLOP/s)'
        for n, t in times.items()), flush=True)


if __name__ == '__main__':
  main(sys.argv)
