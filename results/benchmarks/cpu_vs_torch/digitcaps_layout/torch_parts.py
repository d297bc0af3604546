"""Session 12: PyTorch's DigitCaps train step (benchmarks/torch_models.py's
routing), the same shapes as parts.py. BATCH=128 python this"""
import os, time, numpy as np, torch
from benchmarks import torch_models
torch.set_num_threads(2)
B = int(os.environ.get('BATCH', 128))
g = torch.Generator().manual_seed(0)
x = (0.3 * torch.randn(B, 1152, 8, generator=g)).requires_grad_()
w = (0.1 * torch.randn(1152, 10, 16, 8, generator=g)).requires_grad_()
bias = torch.full((10, 16), 0.1)
target = torch.randn(B, 10, 16, generator=g)


def step():
  u_hat = torch.einsum('bie,ijde->bijd', x, w)
  v = torch_models.dynamic_routing(u_hat, 3, bias=bias)
  (v * target).sum().backward()
  x.grad = None; w.grad = None


def fwd():
  with torch.no_grad():
    torch_models.dynamic_routing(torch.einsum('bie,ijde->bijd', x, w), 3, bias=bias)


for f in (step, fwd):
  f(); ts = []
  for _ in range(7):
    t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
  print(f'torch {f.__name__} B={B}: {np.median(ts) * 1e3:.1f} ms', flush=True)
