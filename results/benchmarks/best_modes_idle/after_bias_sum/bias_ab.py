import sys, time, numpy as np, jax
from capsjax import layers
from experiments import benchmark
spec, batch, dtype, rounds, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
config = benchmark.configure(spec, batch_size=batch)
new_add = layers.add_bias
def compiled(add):
  layers.add_bias = add
  step, args = benchmark.train_step_and_inputs(config, dtype=dtype)
  f = jax.jit(step, donate_argnums=0).lower(*args).compile()
  layers.add_bias = new_add
  return f, list(args)
old = lambda y, b: y + b.reshape((1,) * (y.ndim - 1) + (-1,))
calls = {'autodiff bias sum': compiled(old), 'float32 bias sum': compiled(new_add)}
def run(name):
  f, a = calls[name]
  a[0], m = f(*a); jax.block_until_ready(m)
for n in calls: run(n); run(n)
t = {n: [] for n in calls}
for r in range(rounds):
  for n in calls:
    s = time.perf_counter()
    for _ in range(steps): run(n)
    t[n].append((time.perf_counter() - s) / steps)
for n in calls:
  print(f'{spec} b{batch} {dtype} {n}: median {np.median(t[n])*1000:.1f} ms/step ({batch/np.median(t[n]):.1f} img/s), rounds', [round(x*1000,1) for x in t[n]])
print('ratio old/new', np.median(t['autodiff bias sum'])/np.median(t['float32 bias sum']))
