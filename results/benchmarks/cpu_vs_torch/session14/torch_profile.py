"""Session 14: PyTorch's train step of a model (the benchmark's reference,
host memory retained, 2 threads): median of 10 steps, then torch.profiler's
table over 3 steps (ms are for the 3). PYTHONPATH=. python this MODEL BATCH"""
import sys, time
import numpy as np
from capsjax.training import host_memory
print('host memory:', host_memory.retain_freed_memory())
from torch.profiler import ProfilerActivity, profile
from experiments import benchmark

config = benchmark.configure(sys.argv[1], batch_size=int(sys.argv[2]))
step = benchmark.torch_train_step(config, 0)
for _ in range(3): step()
times = []
for _ in range(10):
  t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
print(f'median step {np.median(times) * 1e3:.1f} ms')
with profile(activities=[ProfilerActivity.CPU]) as prof:
  for _ in range(3): step()
print(prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=20))
