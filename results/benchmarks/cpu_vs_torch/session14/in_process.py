"""Session 14: a model's compiled train step with the session's two changes
(stride-1 taps above 1.4x input / output positions; Su's average pool as
four strided slices) against the code before them (cpu_conv_impl and the
trunk patched back while tracing); one process, alternated, host memory
retained. PYTHONPATH=. python this MODEL BATCH [ROUNDS] [STEPS]"""
import sys
sys.path.insert(0, 'results/benchmarks/cpu_vs_torch/profile')
from train_step import compiled_train_step, time_alternately
from experiments import launcher  # noqa: F401
import jax
from capsjax import cpu_convolutions, models

spec, batch = sys.argv[1], int(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 10
shipped_impl = cpu_convolutions.cpu_conv_impl
shipped_call = models._SuTrunk.__call__


def before_impl(in_channels, stride, in_positions, out_positions):
  impl = shipped_impl(in_channels, stride, in_positions, out_positions)
  return 'space_to_depth' if impl == 'taps' and stride == 1 else impl


def before_call(self, x):
  for i, conv in enumerate(self.convs):
    x = jax.nn.relu(conv(x))
    if i == 1:
      h, w = x.shape[1] // 2 * 2, x.shape[2] // 2 * 2
      x = x[:, :h, :w].reshape(x.shape[0], h // 2, 2, w // 2, 2, x.shape[-1])
      x = x.mean(axis=(2, 4))
  return x


compiled = {}
for name in ('before', 'after'):
  cpu_convolutions.cpu_conv_impl = before_impl if name == 'before' else shipped_impl
  models._SuTrunk.__call__ = before_call if name == 'before' else shipped_call
  _, comp, (state, images, labels, key) = compiled_train_step([spec, str(batch)])
  compiled[name] = [comp, state]
cpu_convolutions.cpu_conv_impl = shipped_impl
models._SuTrunk.__call__ = shipped_call
time_alternately(compiled, images, labels, key, rounds, steps, f'{spec} b{batch}')
