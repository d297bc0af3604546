"""The compiled train step these profiles time: argv SPEC BATCH [KEY=VALUE...]
(a benchmark --model spec, the batch, model options); float32, random uint8
images, donated state, as experiments.benchmark runs it."""
import functools, sys, numpy as np, jax
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
