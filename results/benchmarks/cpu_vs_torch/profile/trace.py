import sys, functools, numpy as np, jax, glob, gzip, json, collections
from experiments import benchmark
from capsjax.training import state as state_lib
spec = sys.argv[1]; B = int(sys.argv[2])
config = benchmark.configure(spec, batch_size=B)
model = state_lib.create_model(config, seed=0)
opt = state_lib.make_optimizer(config)
graphdef, state = state_lib.init_train_state(model, opt)
steps = benchmark.make_steps(config, opt, 'float32')
rng = np.random.default_rng(0); shape = benchmark.image_shape(config)
images = jax.numpy.asarray(rng.integers(0,256,(B,)+shape,np.uint8)); labels = jax.numpy.asarray(rng.integers(0,10,B,np.int32))
train = jax.jit(functools.partial(steps.train_step, graphdef), donate_argnums=0)
key = jax.random.PRNGKey(0)
comp = train.lower(state, images, labels, key).compile()
open('/tmp/capsjax_profile/hlo.txt','w').write(comp.as_text())
for _ in range(2):
    state, m = comp(state, images, labels, key); jax.block_until_ready(state)
d = '/tmp/capsjax_profile/trace_' + spec.replace(':','_')
with jax.profiler.trace(d, create_perfetto_trace=True):
    for _ in range(3):
        state, m = comp(state, images, labels, key); jax.block_until_ready(state)
f = glob.glob(d + '/**/*.trace.json.gz', recursive=True)[-1]
ev = json.load(gzip.open(f))
ev = ev['traceEvents'] if isinstance(ev, dict) else ev
tot = collections.Counter(); cnt = collections.Counter()
for e in ev:
    if e.get('ph') == 'X':
        tot[e['name']] += e['dur']; cnt[e['name']] += 1
for n, t in tot.most_common(45):
    print(f'{t/3/1e3:9.1f} ms  x{cnt[n]//3:4d}  {n[:110]}')
