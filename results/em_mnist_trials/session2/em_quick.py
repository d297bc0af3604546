import sys, json, time, numpy as np, jax, jax.numpy as jnp, optax
from flax import nnx
from capsjax import models, data, losses, layers
opts = json.loads(sys.argv[1]); steps = int(sys.argv[2]) if len(sys.argv) > 2 else 150
std = opts.pop('std', None); lr = opts.pop('lr', 3e-3); loss_kind = opts.pop('loss', 'spread'); B = opts.pop('batch', 32)
if std is not None:
  orig = layers._transform_init
  layers._transform_init = lambda rngs, shape, p, ts: orig(rngs, shape, p, std if ts is None else ts)
size = dict(A=16, B=4, C=4, D=4); size.update({k: opts.pop(k) for k in list(opts) if k in 'ABCD'})
m = models.create_model('matrix_capsnet', rngs=nnx.Rngs(0), input_shape=(28,28,1), num_classes=10, **size, **opts)
ds = data.load_dataset('mnist', data_dir='/work/shared/data/mnist', validation_size=1000)
X = ds.train.images.astype(np.float32)/255.; X = X.reshape(-1,28,28,1); Y = ds.train.labels.astype(np.int32)
Xv = jnp.asarray(ds.validation.images.reshape(-1,28,28,1).astype(np.float32)/255.); Yv = jnp.asarray(ds.validation.labels.astype(np.int32))
gd, params = nnx.split(m, nnx.Param)
opt = optax.adam(lr); os_ = opt.init(params)
def lossf(p, x, y, step):
  a = nnx.merge(gd, p)(x)['activations']
  if loss_kind == 'spread':
    l = losses.spread_loss(a, y, jnp.minimum(0.9, 0.2 + 0.7*step/1000.))
  else:
    ac = jnp.clip(a, 1e-6, 1-1e-6); l = losses.cross_entropy_loss(jnp.log(ac)-jnp.log1p(-ac), y)
  return jnp.mean(l), jnp.mean(jnp.argmax(a,-1)==y)
@jax.jit
def step(p, s, x, y, t):
  (l, acc), g = jax.value_and_grad(lossf, has_aux=True)(p, x, y, t)
  u, s = opt.update(g, s, p); return optax.apply_updates(p, u), s, l, acc, optax.tree.norm(g)
evalf = jax.jit(lambda p, x: jnp.argmax(nnx.merge(gd, p)(x)['activations'], -1))
rng = np.random.default_rng(0); t0 = time.time(); accs = []
for t in range(steps):
  idx = rng.integers(0, len(X), B)
  params, os_, l, acc, gn = step(params, os_, jnp.asarray(X[idx]), jnp.asarray(Y[idx]), t)
  accs.append(float(acc))
  if (t+1) % 50 == 0:
    va = float(jnp.mean(evalf(params, Xv[:500]) == Yv[:500]))
    print(f'step {t+1} loss {float(l):.3f} train_acc(last50) {np.mean(accs[-50:]):.3f} val {va:.3f} gnorm {float(gn):.3g} t {time.time()-t0:.0f}s', flush=True)
