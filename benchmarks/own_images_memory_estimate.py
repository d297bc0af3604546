"""The memory estimate of a training step against XLA's compiled figure.

  python benchmarks/own_images_memory_estimate.py

For each family's own-images config (the full and the smoke model) on
random 32x32x3 images of 10 classes (EM smoke: 24x24): the estimate
(``own_images.model_size``: the traced step's peak of live arrays plus its
state and batch) and XLA's ``memory_analysis()`` of the same step compiled
with the state donated (arguments + temporaries), and their ratio.
"""

import functools
import json

import jax
import numpy as np

from capsjax import data as data_lib
from capsjax.training import matrix_capsules
from capsjax.training import own_images
from capsjax.training import state as state_lib
from capsjax.training import vector_capsules
from experiments.configs import own_images as own_images_config


def row(variant: str, side: int) -> dict:
  labels = np.repeat(np.arange(10), 20).astype(np.int32)
  split = data_lib.Split(np.zeros((200, side, side, 3), np.uint8), labels)
  dataset = data_lib.Dataset(split, split, split, 10, 'random')
  config = own_images_config.get_config(variant)
  config.image_size = side
  config = own_images.with_data_shapes(config, dataset, tuple('abcdefghij'),
                                       say=lambda _: None)
  trainer = matrix_capsules if 'em' in variant else vector_capsules
  optimizer = getattr(trainer, 'make_optimizer',
                      state_lib.make_optimizer)(config)
  steps = trainer.make_steps(config, optimizer)
  size = own_images.model_size(config, steps, optimizer, dataset)
  graphdef, state = state_lib.init_train_state(state_lib.create_model(config),
                                               optimizer)
  batch = config.batch_size
  compiled = jax.jit(functools.partial(steps.train_step, graphdef),
                     donate_argnums=0).lower(
      state, split.images[:batch], labels[:batch],
      jax.random.PRNGKey(0)).compile()
  analysis = compiled.memory_analysis()
  xla = analysis.argument_size_in_bytes + analysis.temp_size_in_bytes
  return {'variant': variant, 'image': f'{side}x{side}x3', 'batch': batch,
          'params': size.num_params, 'estimate_MB': size.train_bytes / 1e6,
          'xla_MB': xla / 1e6, 'ratio': size.train_bytes / xla}


if __name__ == '__main__':
  for variant, side in (('capsnet', 32), ('smoke', 32), ('su', 32),
                        ('su,smoke', 32), ('em', 32), ('em,smoke', 24)):
    print(json.dumps(row(variant, side)), flush=True)
