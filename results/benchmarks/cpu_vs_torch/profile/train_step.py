"""The compiled train step these profiles time: argv SPEC BATCH [KEY=VALUE...]
(a benchmark --model spec, the batch, model options); float32, random uint8
images, donated state, as experiments.benchmark runs it: since session 14
with glibc keeping freed memory (host_memory, which the experiments' launcher
applies; sessions 12-13's profiles and in-process A/B ran without it, and
their steps paid ~30,000 page faults each: Su's at b128 250 against 218 ms)."""
import functools, sys, time, numpy as np, jax
from capsjax.training import host_memory
print('host memory:', host_memory.retain_freed_memory())
from experiments import benchmark
from capsjax.training import state as state_lib

def compiled_train_step(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    spec, B, opts = argv[0], int(argv[1]), dict(a.split('=') for a in argv[2:])
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
    return config, comp, (state, images, labels, key)


def time_alternately(compiled, images, labels, key, rounds, steps, title):
    """compiled: {name: [compiled step, state]}; runs `steps` steps of each
    in turn, `rounds` times (one warm-up step before each), and prints each
    round and each name's median step. Added in session 13 for the
    in-process A/B scripts (narrow_kernel_gradient/, relu_pool/)."""
    times = {n: [] for n in compiled}
    for r in range(rounds):
        for name, entry in compiled.items():
            comp, state = entry
            state, _ = comp(state, images, labels, key); jax.block_until_ready(state)
            t = time.perf_counter()
            for _ in range(steps):
                state, _ = comp(state, images, labels, key)
            jax.block_until_ready(state)
            times[name].append((time.perf_counter() - t) / steps)
            entry[1] = state
        print(f'round {r}: ' + ', '.join(f'{n} {times[n][-1] * 1e3:.1f} ms' for n in times), flush=True)
    for n, ts in times.items():
        print(f'{title} {n}: median step {np.median(ts) * 1e3:.1f} ms, '
              f'{images.shape[0] / np.median(ts):.1f} img/s')


def time_calls_alternately(calls, rounds, reps=3):
    """calls: {name: callable that blocks until done}; runs each twice to
    warm up, then `rounds` times each in turn, `reps` calls a time; returns
    {name: median seconds per call}. Added in session 16 for the per-layer
    scripts (earlier ones, e.g. session15/passes.py, have their own copy)."""
    times = {n: [] for n in calls}
    for fn in calls.values():
        fn(); fn()
    for _ in range(rounds):
        for n, fn in calls.items():
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            times[n].append((time.perf_counter() - t) / reps)
    return {n: float(np.median(ts)) for n, ts in times.items()}
