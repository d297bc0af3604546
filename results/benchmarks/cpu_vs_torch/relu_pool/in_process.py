"""Session 13: Su's trunk with ReLU + 2x2 average pool as one custom_vjp
whose backward is one select over the 6-D view (the pool's broadcast
inline) against autodiff's (a materialised broadcast, then the ReLU
mask); one process, compiled train steps alternated.
PYTHONPATH=. python this MODEL BATCH [ROUNDS] [STEPS]"""
import sys
sys.path.insert(0, 'results/benchmarks/cpu_vs_torch/profile')
from experiments import launcher  # noqa: F401
import jax, jax.numpy as jnp
from capsjax import models
from train_step import compiled_train_step, time_alternately


@jax.custom_vjp
def relu_pool(z):
  b, h, w, c = z.shape
  return jax.nn.relu(z).reshape(b, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))

def _fwd(z):
  return relu_pool(z), z

def _bwd(z, g):
  b, h, w, c = z.shape
  z6 = z.reshape(b, h // 2, 2, w // 2, 2, c)
  dz = jnp.where(z6 > 0, 0.25 * g[:, :, None, :, None, :], 0.0)
  return (dz.reshape(z.shape),)
relu_pool.defvjp(_fwd, _bwd)


def fused_call(self, x):
  if min(x.shape[1:3]) < 14:
    raise ValueError('small')
  for i, conv in enumerate(self.convs):
    if i == 1:
      z = conv(x)
      h, w = z.shape[1] // 2 * 2, z.shape[2] // 2 * 2
      x = relu_pool(z[:, :h, :w])
    else:
      x = jax.nn.relu(conv(x))
  return x


spec, batch = sys.argv[1], int(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 10
shipped = models._SuTrunk.__call__
compiled = {}
for name in ('autodiff', 'fused'):
  models._SuTrunk.__call__ = shipped if name == 'autodiff' else fused_call
  _, comp, (state, images, labels, key) = compiled_train_step([spec, str(batch)])
  compiled[name] = [comp, state]
models._SuTrunk.__call__ = shipped
time_alternately(compiled, images, labels, key, rounds, steps, f'{spec} b{batch}')
