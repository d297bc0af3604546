import os, resource, sys, time, jax
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from experiments import benchmark
from train_step import compiled_train_step
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
config, comp, (state, images, labels, key) = compiled_train_step()
print('temp MB', comp.memory_analysis().temp_size_in_bytes/1e6)
state, m = comp(state, images, labels, key); jax.block_until_ready(state)
for i in range(int(__import__("os").environ.get("NSTEPS", "4"))):
    f0 = faults(); t = time.perf_counter()
    state, m = comp(state, images, labels, key); jax.block_until_ready(state)
    print(f'jax step {time.perf_counter()-t:.3f}s faults {faults()-f0} (= {4096*(faults()-f0)/1e6:.0f} MB)')
ts = benchmark.torch_train_step(config, 0); ts()
for i in range(3):
    f0 = faults(); t = time.perf_counter(); ts()
    print(f'torch step {time.perf_counter()-t:.3f}s faults {faults()-f0} (= {4096*(faults()-f0)/1e6:.0f} MB)')
