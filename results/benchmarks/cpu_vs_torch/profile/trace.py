import os, sys, numpy as np, jax, glob, gzip, json, collections
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import compiled_train_step
spec = sys.argv[1]
config, comp, (state, images, labels, key) = compiled_train_step()
open('/tmp/capsjax_profile/hlo.txt','w').write(comp.as_text())
for _ in range(2):
    state, m = comp(state, images, labels, key); jax.block_until_ready(state)
d = '/tmp/capsjax_profile/trace_' + spec.replace(':','_')
with jax.profiler.trace(d, create_perfetto_trace=True):
    for _ in range(3):
        state, m = comp(state, images, labels, key); jax.block_until_ready(state)
f = glob.glob(d + '/**/*.trace.json.gz', recursive=True)[-1]
ev = json.load(gzip.open(f))
ev = ev['traceEvents'] if isinstance(ev, dict) else ev
tot = collections.Counter(); cnt = collections.Counter()
for e in ev:
    if e.get('ph') == 'X':
        tot[e['name']] += e['dur']; cnt[e['name']] += 1
for n, t in tot.most_common(45):
    print(f'{t/3/1e3:9.1f} ms  x{cnt[n]//3:4d}  {n[:110]}')
