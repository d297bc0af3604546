"""Decode + cache time, the cached input pipeline and the train step, in img/s.

  python benchmarks/own_images_pipeline.py --fashion=/tmp/fashion_png \\
      --photos=/tmp/photos --out=/tmp/bench

--fashion: the Fashion-MNIST test split as a folder of PNGs (written first
when absent); --photos: a folder of 224x298 JPEG "photos" (written first
when absent). For each: the first ``read_cached`` (Pillow decodes, the
arrays are saved), the second (the cache read back), the loop's per-step
input work alone (``BatchOrder.indices`` + ``take_batch`` from the arrays on
the device) and the smoke CapsNet's jitted train step on the same batches.
"""

import argparse
import functools
import json
import os
import shutil
import time

import jax
import numpy as np
from PIL import Image

from capsjax import data as data_lib
from capsjax import figures
from capsjax.training import own_images
from capsjax.training import state as state_lib
from capsjax.training import vector_capsules
from capsjax.training.sharding import BatchOrder
from capsjax.training.sharding import make_mesh
from capsjax.training.sharding import on_mesh
from capsjax.training.sharding import replicated
from capsjax.training.sharding import take_batch
from experiments.configs import own_images as own_images_config


def write_fashion(root: str, data_dir: str) -> None:
  test = data_lib.load_dataset('fashion_mnist', data_dir=data_dir,
                               validation_size=0).test
  names = figures.CLASS_NAMES['fashion_mnist']
  for name in names:
    os.makedirs(os.path.join(root, name), exist_ok=True)
  for i, (image, label) in enumerate(zip(test.images, test.labels,
                                         strict=True)):
    Image.fromarray(image[..., 0]).save(
        os.path.join(root, names[label], f'{i:05d}.png'))


def write_photos(root: str, per_class: int = 500) -> None:
  """Smooth random colour fields, 224x298, JPEG quality 90: a photo's size
  and entropy for the decoder (the classes are not learnable)."""
  rng = np.random.default_rng(0)
  for k in range(4):
    os.makedirs(os.path.join(root, f'class_{k}'), exist_ok=True)
    for i in range(per_class):
      small = rng.integers(0, 256, (28, 37, 3), dtype=np.uint8)
      image = Image.fromarray(small).resize((298, 224), Image.BICUBIC)
      image.save(os.path.join(root, f'class_{k}', f'{i:04d}.jpg'),
                 quality=90)


def time_it(fn, repeat: int = 1) -> float:
  start = time.perf_counter()
  for _ in range(repeat):
    fn()
  return (time.perf_counter() - start) / repeat


def measure(source: str, image_size: int, cache: str, steps: int) -> dict:
  shutil.rmtree(cache, ignore_errors=True)
  config = own_images_config.get_config('smoke')
  config.images, config.image_size = source, image_size
  options = own_images.image_options(config)
  first = time_it(lambda: data_lib.read_cached(source, options, cache,
                                               say=lambda _: None))
  own = data_lib.read_cached(source, options, cache, say=lambda _: None)
  second = time_it(lambda: data_lib.read_cached(source, options, cache,
                                                say=lambda _: None), 3)
  num = len(own.train.labels)
  dataset = data_lib.Dataset(own.train, own.train, own.train,
                             len(own.class_names), 'bench')
  config = own_images.with_data_shapes(config, dataset, own.class_names,
                                       say=lambda _: None)
  mesh = make_mesh(None)
  images = on_mesh(own.train.images, replicated(mesh))
  labels = on_mesh(own.train.labels, replicated(mesh))
  order = BatchOrder(num, config.batch_size, config.seed)

  def batch(step):
    idx = order.indices(step)
    return take_batch(images, idx, mesh), take_batch(labels, idx, mesh)

  jax.block_until_ready(batch(0))
  start = time.perf_counter()
  for step in range(200):
    out = batch(step)
  jax.block_until_ready(out)
  pipeline_s = (time.perf_counter() - start) / 200

  optimizer = state_lib.make_optimizer(config)
  steps_lib = vector_capsules.make_steps(config, optimizer)
  graphdef, state = state_lib.init_train_state(
      state_lib.create_model(config), optimizer)
  train_step = jax.jit(functools.partial(steps_lib.train_step, graphdef),
                       donate_argnums=0)
  key = jax.random.PRNGKey(0)
  state, metrics = train_step(state, *batch(0), key)  # compiles
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for step in range(1, steps + 1):
    state, metrics = train_step(state, *batch(step),
                                jax.random.fold_in(key, step))
  jax.block_until_ready(metrics)
  step_s = (time.perf_counter() - start) / steps
  batch_size = config.batch_size
  return {
      'source': source, 'images': num, 'image_shape': list(
          own.train.images.shape[1:]),
      'decode_and_cache_s': first, 'decode_img_per_s': num / first,
      'cache_read_s': second, 'cache_read_img_per_s': num / second,
      'pipeline_img_per_s': batch_size / pipeline_s,
      'train_step_img_per_s': batch_size / step_s,
      'batch_size': batch_size, 'train_steps_timed': steps,
      'model': config.model, 'num_params': state_lib.count_params(
          state.params)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--fashion', required=True)
  parser.add_argument('--fashion_data', default='../shared/data/fashion-mnist')
  parser.add_argument('--photos', required=True)
  parser.add_argument('--out', required=True)
  parser.add_argument('--steps', type=int, default=60)
  args = parser.parse_args()
  if not os.path.isdir(args.fashion):
    write_fashion(args.fashion, args.fashion_data)
  if not os.path.isdir(args.photos):
    write_photos(args.photos)
  rows = [measure(args.fashion, 28, os.path.join(args.out, 'cache_fashion'),
                  args.steps),
          measure(args.photos, 32, os.path.join(args.out, 'cache_photos'),
                  args.steps)]
  for row in rows:
    print(json.dumps(row))


if __name__ == '__main__':
  main()
