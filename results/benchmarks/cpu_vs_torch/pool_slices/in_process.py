"""Session 14: Su's trunk with its 2x2 average pool as the sum of four
strided slices (one XLA loop fusion with the bias and ReLU: no YNNPACK
reduction, whose operands XLA materialises, zeros included) against the
shipped reshape + mean; one process, compiled train steps alternated,
host memory retained. PYTHONPATH=. python this MODEL BATCH [ROUNDS] [STEPS]"""
import sys
sys.path.insert(0, 'results/benchmarks/cpu_vs_torch/profile')
from train_step import compiled_train_step, time_alternately
from experiments import launcher  # noqa: F401
import jax
from capsjax import models


def slices_pool(x):
  h, w = x.shape[1] // 2 * 2, x.shape[2] // 2 * 2
  return 0.25 * ((x[:, 0:h:2, 0:w:2] + x[:, 0:h:2, 1:w:2]) +
                 (x[:, 1:h:2, 0:w:2] + x[:, 1:h:2, 1:w:2]))


def slices_call(self, x):
  for i, conv in enumerate(self.convs):
    x = jax.nn.relu(conv(x))
    if i == 1:
      x = slices_pool(x)
  return x


if __name__ == '__main__':
  spec, batch = sys.argv[1], int(sys.argv[2])
  rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
  steps = int(sys.argv[4]) if len(sys.argv) > 4 else 10
  shipped = models._SuTrunk.__call__
  compiled = {}
  for name, call in (('mean', shipped), ('slices', slices_call)):
    models._SuTrunk.__call__ = call
    _, comp, (state, images, labels, key) = compiled_train_step([spec, str(batch)])
    compiled[name] = [comp, state]
  models._SuTrunk.__call__ = shipped
  time_alternately(compiled, images, labels, key, rounds, steps, f'{spec} b{batch}')
