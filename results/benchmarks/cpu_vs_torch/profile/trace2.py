import sys, functools, numpy as np, jax
from experiments import benchmark
from capsjax.training import state as state_lib
spec = sys.argv[1]; B = int(sys.argv[2]); opts = dict(a.split('=') for a in sys.argv[3:])
config = benchmark.configure(spec, batch_size=B)
for k, v in opts.items(): config.model_options[k] = benchmark.parse_value(v)
model = state_lib.create_model(config, seed=0)
opt = state_lib.make_optimizer(config)
graphdef, state = state_lib.init_train_state(model, opt)
steps = benchmark.make_steps(config, opt, 'float32')
rng = np.random.default_rng(0); shape = benchmark.image_shape(config)
images = jax.numpy.asarray(rng.integers(0,256,(B,)+shape,np.uint8)); labels = jax.numpy.asarray(rng.integers(0,10,B,np.int32))
train = jax.jit(functools.partial(steps.train_step, graphdef), donate_argnums=0)
key = jax.random.PRNGKey(0)
comp = train.lower(state, images, labels, key).compile()
print('flops', comp.cost_analysis()['flops']/1e9, 'GF; temp MB', comp.memory_analysis().temp_size_in_bytes/1e6)
open('/tmp/capsjax_profile/hlo_em.txt','w').write(comp.as_text())
import time
for _ in range(3):
    state, m = comp(state, images, labels, key); jax.block_until_ready(state)
ts=[]
for _ in range(5):
    t=time.perf_counter(); state, m = comp(state, images, labels, key); jax.block_until_ready(state); ts.append(time.perf_counter()-t)
print('step', np.median(ts))
d = '/tmp/capsjax_profile/trace_em'
import shutil; shutil.rmtree(d, ignore_errors=True)
with jax.profiler.trace(d, create_perfetto_trace=True):
    for _ in range(3):
        state, m = comp(state, images, labels, key); jax.block_until_ready(state)
