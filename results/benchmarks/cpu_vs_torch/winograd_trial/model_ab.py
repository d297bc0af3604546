"""Su's capsule model train step: patches path vs Winograd (wide 3x3 convs) vs PyTorch, alternating in one process."""
import sys, functools, statistics
from capsjax.training import host_memory; print(host_memory.retain_freed_memory())
import jax, jax.numpy as jnp, numpy as np
sys.argv = sys.argv[:1] + ['--model=x']
from experiments import benchmark as B
from capsjax import layers
from capsjax.training import state as state_lib
exec(open('/tmp/wino/proto.py').read().split("def bench")[0].split("import numpy as np, jax, jax.numpy as jnp\n")[1].split("from capsjax import layers\n")[1])

@jax.custom_vjp
def wino_conv(x, k): return winograd_conv(x, k)
wino_conv.defvjp(lambda x, k: jax.vjp(winograd_conv, x, k), lambda t, g: t(g))
orig = layers.patches_conv
def patched(x, k):
  if k.shape[:2] == (3, 3) and k.shape[2] >= 16: return winograd_conv(x, k)
  return orig(x, k)

model, batch = sys.argv_model if hasattr(sys, 'argv_model') else ('two_digit_capsnet', 128)
import os; model = os.environ.get('M', model); batch = int(os.environ.get('BS', batch))
config = B.configure(model, batch_size=batch)
def make_call(use_wino):
  layers.patches_conv = patched if use_wino else orig
  m = state_lib.create_model(config, seed=0); opt = state_lib.make_optimizer(config)
  graphdef, state = state_lib.init_train_state(m, opt)
  steps = B.make_steps(config, opt, 'float32')
  rng = np.random.default_rng(0); shape = B.image_shape(config)
  images = jnp.asarray(rng.integers(0, 256, (batch,) + shape, np.uint8)); labels = jnp.asarray(rng.integers(0, 10, batch, np.int32))
  train = jax.jit(functools.partial(steps.train_step, graphdef), donate_argnums=0).lower(state, images, labels, jax.random.PRNGKey(0)).compile()
  ev = jax.jit(functools.partial(steps.eval_step, graphdef)).lower(state.params, state.model_state, images, labels, jnp.ones(batch)).compile()
  box = [state]
  def call():
    box[0], m = train(box[0], images, labels, jax.random.PRNGKey(1)); return m
  def ecall(): return ev(box[0].params, box[0].model_state, images, labels, jnp.ones(batch))
  return call, ecall
pc, pe = make_call(False); wc, we = make_call(True); layers.patches_conv = orig
tc = B.torch_train_step(config, 0)
for c in (pc, wc, tc): B._median_seconds(c, 1, 1)
r = {'patches': [], 'winograd': [], 'torch': []}
for _ in range(int(os.environ.get('R', 3))):
  for name, c in (('patches', pc), ('winograd', wc), ('torch', tc)):
    r[name].append(B._median_seconds(c, 0, 3))
med = {k: statistics.median(v) for k, v in r.items()}
print(model, batch, {k: f'{batch / v:.1f} img/s' for k, v in med.items()},
      f"ratio vs torch: patches {med['torch']/med['patches']:.2f} winograd {med['torch']/med['winograd']:.2f}")
print('eval img/s patches %.0f winograd %.0f' % (batch / B._median_seconds(pe, 1, 5), batch / B._median_seconds(we, 1, 5)))
print('rounds', {k: [round(x, 3) for x in v] for k, v in r.items()})
