import os, sys, numpy as np, jax
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import compiled_train_step
config, comp, (state, images, labels, key) = compiled_train_step()
print('flops', comp.cost_analysis()['flops']/1e9, 'GF; temp MB', comp.memory_analysis().temp_size_in_bytes/1e6)
open('/tmp/capsjax_profile/hlo_em.txt','w').write(comp.as_text())
import time
for _ in range(3):
    state, m = comp(state, images, labels, key); jax.block_until_ready(state)
ts=[]
for _ in range(5):
    t=time.perf_counter(); state, m = comp(state, images, labels, key); jax.block_until_ready(state); ts.append(time.perf_counter()-t)
print('step', np.median(ts))
d = '/tmp/capsjax_profile/trace_em'
import shutil; shutil.rmtree(d, ignore_errors=True)
with jax.profiler.trace(d, create_perfetto_trace=True):
    for _ in range(3):
        state, m = comp(state, images, labels, key); jax.block_until_ready(state)
