"""Session 16: every convolution of the shipped models alone, as a train step
needs it (forward, kernel gradient, and the input gradient unless the input
is the image), at batch B (PyTorch's on NCHW tensors, as in
benchmarks/torch_models.py; convs.log is a first run whose capsjax columns
lacked the forward pass, which XLA dropped as unused; convs_b*.log have it): XLA's lowering (cpu_convolutions.cpu_conv_impl's
choice), oneDNN's (capsjax.onednn, now with strides and padding) and
PyTorch's, alternated in one process, 2 threads, host memory retained.
PYTHONPATH=.:results/benchmarks/cpu_vs_torch/profile python this [B] [ROUNDS]"""
import sys
import numpy as np
from train_step import time_calls_alternately  # retains host memory
import jax, jax.numpy as jnp, torch
from capsjax import layers, cpu_convolutions, votes as votes_lib

B = int(sys.argv[1]) if len(sys.argv) > 1 else 128
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
torch.set_num_threads(2)
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


def xla_impl(shape, kshape, stride, padding):
  (h, w, c), k = shape, kshape[0]
  ph = layers._conv_padding(h, k, stride, padding)
  pw = layers._conv_padding(w, k, stride, padding)
  hp, wp = h + sum(ph), w + sum(pw)
  out = votes_lib.output_size(hp, k, stride) * votes_lib.output_size(wp, k, stride)
  return cpu_convolutions.cpu_conv_impl(c, stride, hp * wp, out)


rng = np.random.default_rng(0)
print(f'batch {B}, {rounds} rounds, ms per call (median)', flush=True)
for name, shape, kshape, stride, padding in CONVS:
  image = shape[-1] == 1  # no input gradient needed
  x = rng.standard_normal((B,) + shape, np.float32)
  k = rng.standard_normal(kshape, np.float32) * 0.05
  y_shape = jax.eval_shape(lambda x, k: layers._lax_conv(x, k, stride, padding), x, k).shape
  dy = rng.standard_normal(y_shape, np.float32)
  xj, kj, dyj = map(jnp.asarray, (x, k, dy))
  calls = {}
  impls = [xla_impl(shape, kshape, stride, padding), 'onednn']
  for impl in impls:
    conv = lambda x, k, impl=impl: layers.conv2d(x, k, stride, padding, impl)
    # The output is returned too: unused, XLA would drop the forward pass.
    if image:
      step = jax.jit(lambda x, k, dy, conv=conv: (
          lambda y, vjp: (y, vjp(dy)))(*jax.vjp(lambda k: conv(x, k), k)))
    else:
      step = jax.jit(lambda x, k, dy, conv=conv: (
          lambda y, vjp: (y, vjp(dy)))(*jax.vjp(conv, x, k)))
    calls[impl] = lambda step=step: jax.block_until_ready(step(xj, kj, dyj))
  xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().requires_grad_(not image)
  kt = torch.from_numpy(k).permute(3, 2, 0, 1).contiguous().requires_grad_(True)
  dyt = torch.from_numpy(dy).permute(0, 3, 1, 2).contiguous()
  pad = 'same' if padding == 'SAME' else 0
  def torch_step():
    out = torch.nn.functional.conv2d(xt, kt, stride=stride, padding=pad)
    torch.autograd.grad(out, [kt] if image else [xt, kt], dyt)
  calls['torch'] = torch_step
  times = time_calls_alternately(calls, rounds)
  print(f'{name} {shape}->{kshape[-1]} s{stride} {padding}'
        f'{" (no input grad)" if image else ""}: ' + ', '.join(
            f'{n} {t * 1e3:.1f}' for n, t in times.items()) +
        f'; onednn/xla {times["onednn"] / times[impls[0]]:.2f}', flush=True)
