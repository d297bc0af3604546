"""Session 12: XLA's profile of a model's train step (3 steps), kernels
summed by kind and the top 40. PYTHONPATH=. python this MODEL BATCH
(uses ../profile/train_step.py and trace.py's approach)."""
import collections, glob, gzip, json, os, re, sys
sys.path.insert(0, 'results/benchmarks/cpu_vs_torch/profile')
from experiments import launcher  # noqa: F401
import jax
from train_step import compiled_train_step
spec = sys.argv[1]
config, comp, (state, images, labels, key) = compiled_train_step()
cost = comp.cost_analysis()
cost = cost[0] if isinstance(cost, list) else cost
for _ in range(2):
  state, m = comp(state, images, labels, key); jax.block_until_ready(state)
d = '/tmp/capsjax_profile/s12_' + spec.replace(':', '_')
with jax.profiler.trace(d):
  for _ in range(3):
    state, m = comp(state, images, labels, key); jax.block_until_ready(state)
f = sorted(glob.glob(d + '/**/*.trace.json.gz', recursive=True))[-1]
ev = json.load(gzip.open(f)); ev = ev['traceEvents'] if isinstance(ev, dict) else ev
skip = ('$', 'Thunk', 'Slinky', 'Pjit', 'PjRt', 'Tfrt', 'CommonPjRt', 'ParseArguments')
tot, kind = collections.Counter(), collections.Counter()
for e in ev:
  if e.get('ph') == 'X' and not e['name'].startswith(skip):
    tot[e['name']] += e['dur']; kind[re.sub(r'[._]?\d+$', '', e['name'])] += e['dur']
hlo = comp.as_text()
print(f'{spec} batch {sys.argv[2]}: XLA cost analysis {cost.get("flops", 0) / 1e9:.1f} GFLOP, '
      f'{cost.get("bytes accessed", 0) / 1e9:.2f} GB accessed a step; kernels {sum(tot.values()) / 3e3:.1f} ms a step')
print('by kind (ms a step):')
for k, t in kind.most_common(15): print(f'  {t / 3e3:8.1f}  {k}')
print('top kernels (ms a step), with their HLO shape:')
for k, t in tot.most_common(40):
  m = re.search(r'%' + re.escape(k) + r' = (\S+)', hlo)
  print(f'  {t / 3e3:8.1f}  {k}  {m.group(1) if m else ""}')
