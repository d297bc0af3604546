"""Session 14: a model's compiled train step with its stride-1
convolutions whose input gradient would cover over RATIO times the output's
positions lowered as taps (input gradient tap by tap) against the shipped
choice (space_to_depth: XLA's padded convolution), cpu_conv_impl patched
while tracing; optionally Su's average pool as four strided slices too
(POOL=slices). One process, alternated, host memory retained.
PYTHONPATH=. python this MODEL BATCH [ROUNDS] [STEPS] [RATIO]"""
import os, sys
sys.path.insert(0, 'results/benchmarks/cpu_vs_torch/profile')
sys.path.insert(0, 'results/benchmarks/cpu_vs_torch/pool_slices')
from train_step import compiled_train_step, time_alternately
from experiments import launcher  # noqa: F401
from capsjax import cpu_convolutions, models

spec, batch = sys.argv[1], int(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 10
ratio = float(sys.argv[5]) if len(sys.argv) > 5 else 1.3
shipped = cpu_convolutions.cpu_conv_impl
shipped_call = models._SuTrunk.__call__


def taps_impl(in_channels, stride, in_positions, out_positions):
  impl = shipped(in_channels, stride, in_positions, out_positions)
  if (impl == 'space_to_depth' and stride == 1 and in_channels >= 64
      and in_positions > ratio * out_positions):
    print(f'  taps: {in_channels} channels, {in_positions} / {out_positions}')
    return 'taps'
  return impl


compiled = {}
for name in ('shipped', 'taps'):
  cpu_convolutions.cpu_conv_impl = shipped if name == 'shipped' else taps_impl
  if name != 'shipped' and os.environ.get('POOL') == 'slices':
    import in_process as pool_slices
    models._SuTrunk.__call__ = pool_slices.slices_call
  _, comp, (state, images, labels, key) = compiled_train_step([spec, str(batch)])
  compiled[name] = [comp, state]
cpu_convolutions.cpu_conv_impl = shipped
models._SuTrunk.__call__ = shipped_call
time_alternately(compiled, images, labels, key, rounds, steps, f'{spec} b{batch}')
