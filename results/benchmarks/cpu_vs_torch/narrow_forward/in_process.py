"""Session 14: a model's compiled train step with the narrow first layer's
forward pass as one product over patches (depth <= 25, the shipped
NARROW_PRODUCT_MAX_DEPTH) against XLA's convolution (the threshold patched
to 0 while tracing); one process, alternated, host memory retained.
PYTHONPATH=. python this MODEL BATCH [ROUNDS] [STEPS]"""
import sys
sys.path.insert(0, 'results/benchmarks/cpu_vs_torch/profile')
from train_step import compiled_train_step, time_alternately
from experiments import launcher  # noqa: F401
from capsjax import cpu_convolutions

spec, batch = sys.argv[1], int(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 10
shipped = cpu_convolutions.NARROW_PRODUCT_MAX_DEPTH
compiled = {}
for name in ('conv', 'product'):
  cpu_convolutions.NARROW_PRODUCT_MAX_DEPTH = shipped if name == 'product' else 0
  _, comp, (state, images, labels, key) = compiled_train_step([spec, str(batch)])
  compiled[name] = [comp, state]
cpu_convolutions.NARROW_PRODUCT_MAX_DEPTH = shipped
time_alternately(compiled, images, labels, key, rounds, steps, f'{spec} b{batch}')
