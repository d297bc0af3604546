"""Session 16: the baseline CNN's 5x5 SAME 256 -> F layer at batch 64, forward
and both gradients, as capsjax.onednn runs it (NHWC) and as PyTorch does
(NCHW), 3 times each. Run with ONEDNN_VERBOSE=1: oneDNN prints each
primitive's kernel, layouts and time (ms).
PYTHONPATH=. ONEDNN_VERBOSE=1 python this [F]"""
import sys, numpy as np, torch, jax, jax.numpy as jnp
from capsjax import onednn
torch.set_num_threads(2)
B, C, F = 64, 256, int(sys.argv[1]) if len(sys.argv) > 1 else 256
x = np.random.default_rng(0).standard_normal((B, 28, 28, C), np.float32)
k = np.random.default_rng(1).standard_normal((5, 5, C, F), np.float32) * 0.01
dy = np.random.default_rng(2).standard_normal((B, 28, 28, F), np.float32)
pads = ((2, 2), (2, 2))
f = jax.jit(lambda x, k, dy: (lambda y, vjp: (y, vjp(dy)))(*jax.vjp(lambda x, k: onednn.conv(x, k, 1, pads), x, k)))
xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().requires_grad_()
kt = torch.from_numpy(k).permute(3, 2, 0, 1).contiguous().requires_grad_()
dyt = torch.from_numpy(dy).permute(0, 3, 1, 2).contiguous()
for r in range(3):
  print('--- capsjax', flush=True); jax.block_until_ready(f(x, k, dy))
  print('--- torch', flush=True); torch.autograd.grad(torch.nn.functional.conv2d(xt, kt, padding=2), [xt, kt], dyt)
