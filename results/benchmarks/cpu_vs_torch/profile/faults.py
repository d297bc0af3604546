import resource, time, sys, functools, numpy as np, jax
from experiments import benchmark
from capsjax.training import state as state_lib, sharding
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
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
print('temp MB', comp.memory_analysis().temp_size_in_bytes/1e6)
state, m = comp(state, images, labels, key); jax.block_until_ready(state)
for i in range(int(__import__("os").environ.get("NSTEPS", "4"))):
    f0 = faults(); t = time.perf_counter()
    state, m = comp(state, images, labels, key); jax.block_until_ready(state)
    print(f'jax step {time.perf_counter()-t:.3f}s faults {faults()-f0} (= {4096*(faults()-f0)/1e6:.0f} MB)')
ts = benchmark.torch_train_step(config, 0); ts()
for i in range(3):
    f0 = faults(); t = time.perf_counter(); ts()
    print(f'torch step {time.perf_counter()-t:.3f}s faults {faults()-f0} (= {4096*(faults()-f0)/1e6:.0f} MB)')
