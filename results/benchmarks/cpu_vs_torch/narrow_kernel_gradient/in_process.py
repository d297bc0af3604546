"""Session 13: one model's compiled train step with the narrow first layers
as narrow_conv and as patches_conv (cpu_conv_impl patched while tracing),
in one process, alternated: R rounds of N steps each, median step.
PYTHONPATH=. python this MODEL BATCH [ROUNDS] [STEPS]"""
import sys
sys.path.insert(0, 'results/benchmarks/cpu_vs_torch/profile')
from experiments import launcher  # noqa: F401
from capsjax import cpu_convolutions
from train_step import compiled_train_step, time_alternately

spec, batch = sys.argv[1], int(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 10
shipped = cpu_convolutions.cpu_conv_impl
compiled = {}
for name in ('narrow', 'patches'):
  cpu_convolutions.cpu_conv_impl = (
      shipped if name == 'narrow' else
      lambda *a: 'patches' if shipped(*a) == 'narrow' else shipped(*a))
  _, comp, (state, images, labels, key) = compiled_train_step([spec, str(batch)])
  compiled[name] = [comp, state]
cpu_convolutions.cpu_conv_impl = shipped
time_alternately(compiled, images, labels, key, rounds, steps, f'{spec} b{batch}')
