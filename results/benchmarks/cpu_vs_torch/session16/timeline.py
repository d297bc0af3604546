"""Session 16: when each kernel of one train step runs, from XLA's profiler
(3 traced steps after 2 warm-up ones; the last step's kernels of 20 ms and
more, start and duration in ms, the thread). Shows whether oneDNN's FFI
calls run side by side. From the repository root:
PYTHONPATH=. python this SPEC BATCH"""
import glob, gzip, json, os, sys, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                '..', 'profile'))
import jax
from train_step import compiled_train_step

config, comp, (state, images, labels, key) = compiled_train_step()
for _ in range(2):
  state, _ = comp(state, images, labels, key); jax.block_until_ready(state)
folder = tempfile.mkdtemp()
with jax.profiler.trace(folder):
  for _ in range(3):
    state, _ = comp(state, images, labels, key); jax.block_until_ready(state)
events = json.load(gzip.open(glob.glob(folder + '/**/*.trace.json.gz',
                                       recursive=True)[-1]))
events = events['traceEvents'] if isinstance(events, dict) else events
steps = sorted((e for e in events if e.get('ph') == 'X' and
                e['name'] == 'ThunkExecutor::Execute (wait for completion)'),
               key=lambda e: e['ts'])
last = steps[-1]
print(f'{sys.argv[1]} b{sys.argv[2]}: traced steps ' + ', '.join(
    f"{e['dur'] / 1e3:.1f}" for e in steps) + ' ms; the last one:')
threads = {}
for e in sorted(events, key=lambda e: e.get('ts', 0)):
  if (e.get('ph') == 'X' and e['dur'] >= 20000 and
      last['ts'] <= e['ts'] <= last['ts'] + last['dur'] and
      'Execute' not in e['name'] and not e['name'].startswith('$')):
    thread = threads.setdefault(e['tid'], len(threads))
    print(f"  {(e['ts'] - last['ts']) / 1e3:8.1f} +{e['dur'] / 1e3:7.1f} "
          f"thread {thread} {e['name']}")
