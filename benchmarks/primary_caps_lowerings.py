"""The paper CapsNet's PrimaryCaps convolution on the CPU, lowering by lowering.

    pip install -e '.[bench,onednn]'
    python -m benchmarks.primary_caps_lowerings passes [BATCH] [ROUNDS]
    python -m benchmarks.primary_caps_lowerings vjp [BATCH] [ROUNDS]

The convolution is 9x9, stride 2, 256 -> 256 channels on 20x20 (defaults:
batch 128, 5 rounds). ``passes`` times the forward pass, the input gradient
and the kernel gradient alone for XLA's taps lowering, oneDNN's strided
convolution, the space-to-depth regrouping followed by oneDNN's stride-1
one (5x5 over 1024 channels) and PyTorch's. ``vjp`` times the forward pass
and both gradients in one jitted vjp, as a train step runs them, for taps,
oneDNN's convolution, the lowering ``capsjax.kernels.conv2d`` ships for
this layer with the
onednn extra (``'onednn_input_grad'``: XLA's forward and kernel gradient,
oneDNN's input gradient) and PyTorch's, and first prints each lowering's
largest difference to taps. Alternated in one process on 2 threads, host
memory retained; median ms per call. Record:
results/benchmarks/onednn_convolutions/.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks import timing
from capsjax.kernels.conv import lowerings
from capsjax.kernels.conv import onednn


def operands(batch: int):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((batch, 20, 20, 256), np.float32)
  k = rng.standard_normal((9, 9, 256, 256), np.float32) * 0.01
  dy = rng.standard_normal((batch, 6, 6, 256), np.float32)
  return x, k, dy


def torch_operands(x, k, dy, requires_grad: bool):
  xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
  kt = torch.from_numpy(k).permute(3, 2, 0, 1).contiguous()
  dyt = torch.from_numpy(dy).permute(0, 3, 1, 2).contiguous()
  if requires_grad:
    xt.requires_grad_()
    kt.requires_grad_()
  return xt, kt, dyt


def passes(batch: int, rounds: int) -> None:
  x, k, dy = operands(batch)
  xj, kj, dyj = map(jnp.asarray, (x, k, dy))
  convs = {
      'taps': lambda x, k: lowerings.conv2d(x, k, 2, 'VALID', 'taps'),
      'onednn strided': lambda x, k: onednn.conv(x, k, 2),
      'space_to_depth + onednn': lambda x, k: onednn.conv(
          *lowerings._space_to_depth(x, k, 2)),
  }
  calls = {}
  for name, conv in convs.items():
    fwd = jax.jit(conv)
    dx = jax.jit(lambda x, k, dy, conv=conv:
                 jax.vjp(lambda x: conv(x, k), x)[1](dy))
    dk = jax.jit(lambda x, k, dy, conv=conv:
                 jax.vjp(lambda k: conv(x, k), k)[1](dy))
    calls[f'{name} forward'] = lambda f=fwd: jax.block_until_ready(f(xj, kj))
    calls[f'{name} input grad'] = (
        lambda f=dx: jax.block_until_ready(f(xj, kj, dyj)))
    calls[f'{name} kernel grad'] = (
        lambda f=dk: jax.block_until_ready(f(xj, kj, dyj)))
  xt, kt, dyt = torch_operands(x, k, dy, requires_grad=False)
  calls['torch forward'] = lambda: torch.nn.functional.conv2d(xt, kt, stride=2)
  calls['torch input grad'] = lambda: torch.nn.grad.conv2d_input(
      xt.shape, kt, dyt, stride=2)
  calls['torch kernel grad'] = lambda: torch.nn.grad.conv2d_weight(
      xt, kt.shape, dyt, stride=2)
  print('oneDNN kernels, strided:', onednn.kernels(x.shape, k.shape, 2))
  print('oneDNN kernels, regrouped:',
        onednn.kernels((batch, 10, 10, 1024), (5, 5, 1024, 256)))
  times = timing.time_calls_alternately(calls, rounds)
  for name in [*convs, 'torch']:
    parts = [times[f'{name} {p}'] * 1e3
             for p in ('forward', 'input grad', 'kernel grad')]
    print(f'b{batch} {name}: forward {parts[0]:.1f}, input grad '
          f'{parts[1]:.1f}, kernel grad {parts[2]:.1f}, sum {sum(parts):.1f} ms',
          flush=True)


def vjp(batch: int, rounds: int) -> None:
  x, k, dy = operands(batch)
  xj, kj, dyj = map(jnp.asarray, (x, k, dy))
  convs = {
      'taps': lambda x, k: lowerings.conv2d(x, k, 2, 'VALID', 'taps'),
      'onednn': lambda x, k: onednn.conv(x, k, 2),
      'hybrid': lambda x, k: lowerings.conv2d(x, k, 2, 'VALID',
                                           'onednn_input_grad'),
  }
  calls, outs = {}, {}
  for name, conv in convs.items():
    def step(x, k, dy, conv=conv):
      y, pullback = jax.vjp(conv, x, k)
      return y, pullback(dy)

    compiled = jax.jit(step)
    outs[name] = compiled(xj, kj, dyj)
    calls[name] = lambda f=compiled: jax.block_until_ready(f(xj, kj, dyj))
  for name, out in outs.items():
    diffs = [float(jnp.max(jnp.abs(a - b))) for a, b in
             zip(jax.tree.leaves(out), jax.tree.leaves(outs['taps']),
                 strict=True)]
    print(name, 'max |diff| to taps (y, dx, dk):', diffs)
  xt, kt, dyt = torch_operands(x, k, dy, requires_grad=True)

  def torch_step():
    torch.autograd.grad(torch.nn.functional.conv2d(xt, kt, stride=2),
                        [xt, kt], dyt)

  calls['torch'] = torch_step
  times = timing.time_calls_alternately(calls, rounds)
  print(f'b{batch}, forward + both gradients, ms: ' + ', '.join(
      f'{n} {t * 1e3:.1f}' for n, t in times.items()), flush=True)


def main(argv: list[str]) -> None:
  if len(argv) < 2 or argv[1] not in ('passes', 'vjp'):
    sys.exit(f'usage: {argv[0]} passes|vjp [BATCH] [ROUNDS]')
  print('host memory:', timing.retain_host_memory(), flush=True)
  batch = int(argv[2]) if len(argv) > 2 else 128
  rounds = int(argv[3]) if len(argv) > 3 else 5
  torch.set_num_threads(2)
  (passes if argv[1] == 'passes' else vjp)(batch, rounds)


if __name__ == '__main__':
  main(sys.argv)
