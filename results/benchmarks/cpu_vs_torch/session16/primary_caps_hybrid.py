"""Session 16: PrimaryCaps (9x9, stride 2, 256 -> 256 on 20x20) forward and
both gradients in one jitted vjp, as a train step runs them, at batch B:
XLA's taps lowering, oneDNN's, a hybrid (XLA's forward and kernel gradient,
oneDNN's input gradient: the faster of each in primary_caps_b128.log) and
PyTorch's; alternated in one process.
PYTHONPATH=.:results/benchmarks/cpu_vs_torch/profile python this [B] [ROUNDS]"""
import functools, sys
import numpy as np
from train_step import time_calls_alternately  # retains host memory
import jax, jax.numpy as jnp, torch
from capsjax import layers, onednn

B = int(sys.argv[1]) if len(sys.argv) > 1 else 128
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
torch.set_num_threads(2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def hybrid(x, k, stride):
  return layers._lax_conv(x, k, stride)
def _fwd(x, k, stride):
  return hybrid(x, k, stride), (x, k)
def _bwd(stride, res, ct):
  x, k = res
  return (onednn._call('OnednnConvInputGrad', x.shape, stride, onednn.VALID, ct, k),
          layers._kernel_gradient(x, k, ct, stride, 'VALID', ct))
hybrid.defvjp(_fwd, _bwd)

rng = np.random.default_rng(0)
x = rng.standard_normal((B, 20, 20, 256), np.float32)
k = rng.standard_normal((9, 9, 256, 256), np.float32) * 0.01
dy = rng.standard_normal((B, 6, 6, 256), np.float32)
xj, kj, dyj = map(jnp.asarray, (x, k, dy))
lowerings = {
    'taps': lambda x, k: layers.conv2d(x, k, 2, 'VALID', 'taps'),
    'onednn': lambda x, k: onednn.conv(x, k, 2),
    'hybrid': lambda x, k: hybrid(x, k, 2),
}
calls = {}
outs = {}
for name, conv in lowerings.items():
  step = jax.jit(lambda x, k, dy, conv=conv: (lambda y, vjp: (y, vjp(dy)))(*jax.vjp(conv, x, k)))
  outs[name] = step(xj, kj, dyj)
  calls[name] = lambda s=step: jax.block_until_ready(s(xj, kj, dyj))
for name in outs:
  print(name, 'max |diff| to taps (y, dx, dk):', [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(outs[name]), jax.tree.leaves(outs['taps']))])
xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().requires_grad_()
kt = torch.from_numpy(k).permute(3, 2, 0, 1).contiguous().requires_grad_()
dyt = torch.from_numpy(dy).permute(0, 3, 1, 2).contiguous()
def torch_step():
  torch.autograd.grad(torch.nn.functional.conv2d(xt, kt, stride=2), [xt, kt], dyt)
calls['torch'] = torch_step
times = time_calls_alternately(calls, rounds)
print(f'b{B}, forward + both gradients, ms: ' + ', '.join(f'{n} {t * 1e3:.1f}' for n, t in times.items()))
