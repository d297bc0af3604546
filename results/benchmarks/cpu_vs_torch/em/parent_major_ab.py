"""In-process A/B: capsjax's EM routing (parent-major) against the child-major
em_routing of an older checkout, on one model's compiled train step.

  PYTHONPATH=. python results/benchmarks/cpu_vs_torch/em/parent_major_ab.py \
      OLD_CHECKOUT SPEC BATCH STEPS ROUNDS

The two train steps are compiled in this process (host memory retained, as
the experiments run) and timed alternately, ROUNDS rounds of STEPS steps on
one fixed batch; the median round of each is printed with the loss and
gradient norm of their first step (equal up to float rounding).
"""
import functools
import importlib.util
import sys
import time

from capsjax.training import host_memory

print(host_memory.retain_freed_memory())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from capsjax import routing  # noqa: E402
from capsjax.training import state as state_lib  # noqa: E402
from experiments import benchmark  # noqa: E402

old_checkout, spec, batch, steps, rounds = sys.argv[1:6]
batch, steps, rounds = int(batch), int(steps), int(rounds)
loader = importlib.util.spec_from_file_location(
    'old_routing', f'{old_checkout}/capsjax/routing.py')
old_routing = importlib.util.module_from_spec(loader)
loader.loader.exec_module(old_routing)
ROUTINGS = {'child-major (old)': old_routing.em_routing,
            'parent-major (new)': routing.em_routing}


def compiled_step(em_routing):
  new = routing.em_routing
  routing.em_routing = em_routing  # layers call routing.em_routing
  try:
    config = benchmark.configure(spec, batch_size=batch)
    model = state_lib.create_model(config, seed=0)
    optimizer = state_lib.make_optimizer(config)
    graphdef, state = state_lib.init_train_state(model, optimizer)
    train = benchmark.make_steps(config, optimizer, 'float32').train_step
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.integers(
        0, 256, (batch,) + benchmark.image_shape(config), np.uint8))
    labels = jnp.asarray(rng.integers(0, 10, batch, np.int32))
    key = jax.random.PRNGKey(0)
    step = jax.jit(functools.partial(train, graphdef)).lower(
        state, images, labels, key).compile()
  finally:
    routing.em_routing = new
  _, metrics = step(state, images, labels, key)
  print({k: round(float(v), 6) for k, v in metrics.items()})
  return lambda: jax.block_until_ready(step(state, images, labels, key))


steps_by_name = {name: compiled_step(fn) for name, fn in ROUTINGS.items()}
times = {name: [] for name in ROUTINGS}
for _ in range(rounds):
  for name, fn in steps_by_name.items():
    start = time.perf_counter()
    for _ in range(steps):
      fn()
    times[name].append((time.perf_counter() - start) / steps)
for name, rounds_s in times.items():
  median = float(np.median(rounds_s))
  print(f'{spec} batch {batch} {name}: median step {median:.4f} s, '
        f'{batch / median:.1f} img/s; rounds {[round(t, 4) for t in rounds_s]}')
old, new = (np.median(t) for t in times.values())
print(f'parent-major speed-up: {old / new:.2f}x')
