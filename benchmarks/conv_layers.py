"""Every convolution of the shipped models alone, on the CPU, three ways.

    pip install -e '.[bench,onednn]'
    python -m benchmarks.conv_layers [BATCH] [ROUNDS] [DTYPE]
    # defaults: 128, 5, float32; DTYPE bfloat16 times all three in bfloat16

Each convolution runs as a train step needs it: the forward pass, the kernel
gradient and, unless the input is the image, the input gradient, in one
jitted vjp. It runs with the lowering ``conv2d`` picks without the onednn
extra (``dispatch.cpu_conv_impl``: narrow, patches, taps or
space_to_depth), with oneDNN's convolution (``capsjax.kernels.conv.onednn``) and in
PyTorch (NCHW tensors, as ``benchmarks/torch_models.py`` has them). The
three are alternated in one process on 2 threads, with the host memory
retained; each line prints the median ms per call and oneDNN's time over
XLA's. Record: results/benchmarks/onednn_convolutions/.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks import timing
from capsjax.kernels.conv import backend as conv_backend
from capsjax.kernels.conv import dispatch
from capsjax.kernels.conv import lowerings
from capsjax.routing import votes as votes_lib

# (where, [H, W, C], [K, K, C, F], stride, padding)
CONVS = [
    ('paper CapsNet conv1', (28, 28, 1), (9, 9, 1, 256), 1, 'VALID'),
    ('paper CapsNet PrimaryCaps', (20, 20, 256), (9, 9, 256, 256), 2, 'VALID'),
    ('smoke CapsNet conv1', (28, 28, 1), (9, 9, 1, 32), 1, 'VALID'),
    ('smoke CapsNet PrimaryCaps', (20, 20, 32), (9, 9, 32, 64), 2, 'VALID'),
    ('baseline CNN conv1', (28, 28, 1), (5, 5, 1, 256), 1, 'SAME'),
    ('baseline CNN conv2', (28, 28, 256), (5, 5, 256, 256), 1, 'SAME'),
    ('baseline CNN conv3', (28, 28, 256), (5, 5, 256, 128), 1, 'SAME'),
    ("Su's conv1", (28, 28, 1), (3, 3, 1, 64), 1, 'VALID'),
    ('EM conv1 (smoke, 24x24)', (24, 24, 1), (5, 5, 1, 32), 2, 'VALID'),
    ('EM conv1 (paper, 28x28)', (28, 28, 1), (5, 5, 1, 32), 2, 'VALID'),
]


def xla_impl(shape, kshape, stride: int, padding: str) -> str:
  """The lowering conv2d picks on the CPU without the onednn extra."""
  (h, w, c), k = shape, kshape[0]
  ph = lowerings._conv_padding(h, k, stride, padding)
  pw = lowerings._conv_padding(w, k, stride, padding)
  hp, wp = h + sum(ph), w + sum(pw)
  out = (votes_lib.output_size(hp, k, stride) *
         votes_lib.output_size(wp, k, stride))
  return dispatch.cpu_conv_impl(c, stride, hp * wp, out)


def train_step_calls(batch: int, shape, kshape, stride: int, padding: str,
                     rng: np.random.Generator, dtype: str = 'float32'):
  """{lowering: call} for one convolution's forward pass and gradients, in
  ``dtype`` ('float32' or 'bfloat16')."""
  image = shape[-1] == 1  # no input gradient needed
  x = rng.standard_normal((batch,) + shape, np.float32)
  k = rng.standard_normal(kshape, np.float32) * 0.05
  y_shape = jax.eval_shape(
      lambda x, k: lowerings._lax_conv(x, k, stride, padding), x, k).shape
  dy = rng.standard_normal(y_shape, np.float32)
  xj, kj, dyj = (jnp.asarray(a, dtype) for a in (x, k, dy))
  calls = {}
  impls = [xla_impl(shape, kshape, stride, padding), 'onednn']
  for impl in impls:
    def conv(x, k, impl=impl):
      return lowerings.conv2d(x, k, stride, padding, impl)

    # The output is returned too: unused, XLA would drop the forward pass.
    if image:
      def step(x, k, dy, conv=conv):
        y, vjp = jax.vjp(lambda k: conv(x, k), k)
        return y, vjp(dy)
    else:
      def step(x, k, dy, conv=conv):
        y, vjp = jax.vjp(conv, x, k)
        return y, vjp(dy)
    compiled = jax.jit(step)
    calls[impl] = lambda f=compiled: jax.block_until_ready(f(xj, kj, dyj))
  torch_dtype = getattr(torch, dtype)
  xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().to(torch_dtype)
  xt.requires_grad_(not image)
  kt = torch.from_numpy(k).permute(3, 2, 0, 1).contiguous().to(
      torch_dtype).requires_grad_(True)
  dyt = torch.from_numpy(dy).permute(0, 3, 1, 2).contiguous().to(torch_dtype)
  pad = 'same' if padding == 'SAME' else 0

  def torch_step():
    out = torch.nn.functional.conv2d(xt, kt, stride=stride, padding=pad)
    torch.autograd.grad(out, [kt] if image else [xt, kt], dyt)

  calls['torch'] = torch_step
  return impls, calls


def main(argv: list[str]) -> None:
  print('host memory:', timing.retain_host_memory(), flush=True)
  batch = int(argv[1]) if len(argv) > 1 else 128
  rounds = int(argv[2]) if len(argv) > 2 else 5
  dtype = argv[3] if len(argv) > 3 else 'float32'
  if dtype not in ('float32', 'bfloat16'):
    raise SystemExit(f'DTYPE must be float32 or bfloat16, got {dtype!r}')
  torch.set_num_threads(2)
  rng = np.random.default_rng(0)
  print(f'batch {batch}, {rounds} rounds, {dtype}, ms per call (median); '
        f'convolutions: {conv_backend()}', flush=True)
  for name, shape, kshape, stride, padding in CONVS:
    impls, calls = train_step_calls(batch, shape, kshape, stride, padding, rng,
                                    dtype)
    times = timing.time_calls_alternately(calls, rounds)
    no_input_grad = ' (no input grad)' if shape[-1] == 1 else ''
    print(f'{name} {shape}->{kshape[-1]} s{stride} {padding}{no_input_grad}: '
          + ', '.join(f'{n} {t * 1e3:.1f}' for n, t in times.items())
          + f'; onednn/xla {times["onednn"] / times[impls[0]]:.2f}', flush=True)


if __name__ == '__main__':
  main(sys.argv)
