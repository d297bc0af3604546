"""Session 14: one model's compiled train step timed alone (XLA_FLAGS as
the process was started with), R rounds of N steps, median step; the
same loop as the in-process A/B scripts, for flags that are process-wide.
PYTHONPATH=. python this MODEL BATCH [ROUNDS] [STEPS]"""
import os, sys
sys.path.insert(0, 'results/benchmarks/cpu_vs_torch/profile')
from experiments import launcher  # noqa: F401
from train_step import compiled_train_step, time_alternately

spec, batch = sys.argv[1], int(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 10
_, comp, (state, images, labels, key) = compiled_train_step([spec, str(batch)])
flags = os.environ.get('XLA_FLAGS', '(capsjax default)')
time_alternately({flags: [comp, state]}, images, labels, key, rounds, steps,
                 f'{spec} b{batch}')
