import sys, json, time, os
os.environ['CAPSJAX_NO_PROGRESS'] = '1'
from absl import logging; logging.set_verbosity(logging.WARNING)
from capsjax import train_em
from experiments.configs import matrix_capsnet_mnist
name = sys.argv[1]; steps = int(sys.argv[2])
config = matrix_capsnet_mnist.get_config('smoke')
config.num_train_steps = steps; config.validation_size = 1000
config.eval_every_steps = 200; config.checkpoint_every_steps = steps; config.log_every_steps = 50
opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
for k, v in opts.items():
  if k.startswith('cfg.'): config[k[4:]] = v
  else: config.model_options[k] = v
t = time.time()
s = train_em.train_and_evaluate(config, f'/tmp/emtry_{name}')
print(name, 'val', s['validation']['accuracy'], 'test', s['test']['accuracy'], 'img/s', s['train_images_per_s'], 'wall', time.time()-t)
