"""A/B: EM routing with votes in [..., O, I, D] (weighted sums as einsum) vs capsjax's."""
import functools, sys, time, math, numpy as np, jax, jax.numpy as jnp
from capsjax import routing
from experiments import benchmark
from capsjax.training import state as state_lib
orig = routing.em_routing
LOG2PI = math.log(2 * math.pi)

def em_omajor(votes, activations, beta_u, beta_a, num_iterations=3, *, inverse_temperature=None,
              variance_epsilon=routing.VARIANCE_FLOOR, normalize_cost=False, center_momentum=0.0,
              activation_form='paper', assignment_normalizer=None, remat_iterations=False):
  assert assignment_normalizer is None and activation_form == 'paper' and not center_momentum
  votes = jnp.asarray(votes, jnp.float32)
  vt = jnp.swapaxes(votes, -3, -2)  # [..., O, I, D]
  a = jnp.asarray(activations, jnp.float32)
  lambdas = routing._inverse_temperatures(inverse_temperature, num_iterations)
  num_out, dim = votes.shape[-2], votes.shape[-1]
  log_r = jnp.full(vt.shape[:-1], -math.log(num_out))  # [..., O, I]
  for t in range(num_iterations):
    w = jnp.exp(log_r) * a[..., None, :]
    mass = jnp.sum(w, -1)  # [..., O]
    nw = w / (mass[..., None] + routing.MASS_EPSILON)
    mu = jnp.einsum('...oi,...oid->...od', nw, vt)
    diff = vt - mu[..., None, :]
    var = jnp.einsum('...oi,...oid->...od', nw, jnp.square(diff))
    log_var = jnp.log(var + variance_epsilon)
    cost = (dim * beta_u + 0.5 * jnp.sum(log_var, -1)) * mass
    if normalize_cost:
      mean = jnp.mean(cost, -1, keepdims=True)
      std = jnp.sqrt(jnp.mean(jnp.square(cost - mean), -1, keepdims=True) + routing.COST_STD_EPSILON**2)
      cost = (cost - mean) / std
    logits = lambdas[t] * (beta_a - cost)
    if t < num_iterations - 1:
      sq = jnp.einsum('...oid,...od->...oi', jnp.square(diff), jnp.exp(-log_var))
      log_p = -0.5 * (sq + jnp.sum(log_var + LOG2PI, -1)[..., None])
      log_r = jax.nn.log_softmax(jax.nn.log_sigmoid(logits)[..., None] + log_p, axis=-2)
  return mu, jax.nn.sigmoid(logits), jnp.swapaxes(jnp.exp(log_r), -1, -2)

def build(spec, B, variant):
  routing.em_routing = em_omajor if variant == 'omajor' else orig
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
  routing.em_routing = orig
  out = comp(state, images, labels, key); jax.block_until_ready(out)
  return lambda: jax.block_until_ready(comp(state, images, labels, key)), out

spec, B, steps, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
names = ['capsjax', 'omajor']
fns = {}
for n in names:
  fns[n], out = build(spec, B, n)
  print(n, {k: float(v) for k, v in out[1].items()})
times = {n: [] for n in names}
for r in range(rounds):
  for n in names:
    t = time.perf_counter()
    for _ in range(steps): fns[n]()
    times[n].append((time.perf_counter() - t) / steps)
for n in names: print(n, 'median step s', np.median(times[n]), 'img/s', B / np.median(times[n]), times[n])
