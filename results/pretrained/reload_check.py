"""A shipped model reloaded through capsjax.pretrained: its test and
validation accuracy against the recorded ones, and the first 2,000 test
images as PNG files read back by read_digits (the command line's path).

    python results/pretrained/reload_check.py NAME   # MNIST in /work/shared/data
"""
import os
import sys
import tempfile

import numpy as np
from PIL import Image

from capsjax import pretrained

name = sys.argv[1]
context, info = pretrained.load_context(name, data_dir='/work/shared/data')
dataset = context.dataset
for split in ('test', 'validation'):
  got = context.evaluate_split(getattr(dataset, split))['accuracy']
  recorded = info[f'{split}_accuracy']
  print(f'{name} reloaded {split} accuracy {got:.4f} recorded {recorded:.4f}')
images = np.asarray(dataset.test.images[:2000])
labels = np.asarray(dataset.test.labels[:2000])
model = context.model  # what pretrained.load(name) returns
with tempfile.TemporaryDirectory() as tmp:
  files = []
  for k, image in enumerate(images):
    path = os.path.join(tmp, f'{k:04d}.png')
    Image.fromarray(image[..., 0]).save(path)
    files.append(path)
  digits, kept = pretrained.read_digits(files)
assert len(kept) == len(files)


def accuracy(batch):
  scores = pretrained.predict_scores(model, info, batch)
  return np.mean(np.argmax(scores, -1) == labels)


difference = np.mean(np.abs(digits.astype(float) - images.astype(float)))
print(f'{name}: mean |pixel difference| PNG vs arrays {difference:.3f}; '
      f'accuracy on the 2000 arrays {accuracy(images):.4f}, '
      f'on the 2000 PNG files {accuracy(digits):.4f}')
