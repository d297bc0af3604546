"""A/B of matrix_votes formulations on a model's train step, alternating in one process."""
import functools, sys, time, numpy as np, jax, jax.numpy as jnp
from capsjax import votes as votes_lib
from experiments import benchmark
from capsjax.training import state as state_lib

orig = votes_lib.matrix_votes
def bcast_votes(poses, weights):
  poses, weights = jnp.asarray(poses), jnp.asarray(weights)
  # V[..., i, o, p, r] = sum_q M[..., i, p, q] W[i, o, q, r]
  v = jnp.sum(poses[..., :, None, :, :, None] * weights[:, :, None, :, :], axis=-2)
  return v.reshape(v.shape[:-2] + (-1,))
def qsum_votes(poses, weights):
  poses, weights = jnp.asarray(poses), jnp.asarray(weights)
  v = sum(poses[..., :, None, :, q, None] * weights[:, :, None, q, :] for q in range(poses.shape[-1]))
  return v.reshape(v.shape[:-2] + (-1,))
VARIANTS = {'einsum': orig, 'bcast': bcast_votes, 'qsum': qsum_votes}

def build(spec, B, variant):
  votes_lib.matrix_votes = VARIANTS[variant]
  config = benchmark.configure(spec, batch_size=B)
  model = state_lib.create_model(config, seed=0)
  opt = state_lib.make_optimizer(config)
  graphdef, state = state_lib.init_train_state(model, opt)
  steps = benchmark.make_steps(config, opt, 'float32')
  rng = np.random.default_rng(0); shape = benchmark.image_shape(config)
  images = jnp.asarray(rng.integers(0,256,(B,)+shape,np.uint8)); labels = jnp.asarray(rng.integers(0,10,B,np.int32))
  train = jax.jit(functools.partial(steps.train_step, graphdef))
  key = jax.random.PRNGKey(0)
  comp = train.lower(state, images, labels, key).compile()
  votes_lib.matrix_votes = orig
  out = comp(state, images, labels, key); jax.block_until_ready(out)
  return lambda: jax.block_until_ready(comp(state, images, labels, key)), out

spec, B, steps, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
names = sys.argv[5].split(',')
fns = {}
for n in names:
  fns[n], out = build(spec, B, n)
  print(n, 'loss', float(out[1]['loss']) if 'loss' in out[1] else out[1])
times = {n: [] for n in names}
for r in range(rounds):
  for n in names:
    t = time.perf_counter()
    for _ in range(steps): fns[n]()
    times[n].append((time.perf_counter() - t) / steps)
for n in names: print(n, 'median step s', np.median(times[n]), 'img/s', B / np.median(times[n]), times[n])
