"""A shipped model reloaded through capsjax.pretrained: its test and
validation accuracy against the recorded ones, and the first 2,000 test
images as PNG files read back by read_digits (the command line's path)."""
import sys, tempfile, os
import numpy as np
from PIL import Image
from capsjax import pretrained
name = sys.argv[1]
context, info = pretrained.load_context(name, data_dir='/work/shared/data')
dataset = context.dataset
for split, key in (('test', 'test_accuracy'), ('validation', 'validation_accuracy')):
  got = context.evaluate_split(getattr(dataset, split))['accuracy']
  print(f'{name} reloaded {split} accuracy {got:.4f} recorded {info[key]:.4f}')
test = dataset.test
images, labels = np.asarray(test.images[:2000]), np.asarray(test.labels[:2000])
model, info = pretrained.load(name)
with tempfile.TemporaryDirectory() as tmp:
  files = []
  for k, image in enumerate(images):
    path = os.path.join(tmp, f'{k:04d}.png')
    Image.fromarray(image[..., 0]).save(path)
    files.append(path)
  digits, kept = pretrained.read_digits(files)
assert len(kept) == 2000
diff = np.mean(np.abs(digits.astype(float) - images.astype(float)))
acc_arrays = np.mean(np.argmax(pretrained.predict_scores(model, info, images), -1) == labels)
acc_png = np.mean(np.argmax(pretrained.predict_scores(model, info, digits), -1) == labels)
print(f'{name}: mean |pixel difference| PNG vs arrays {diff:.3f}; accuracy on the 2000 arrays {acc_arrays:.4f}, on the 2000 PNG files {acc_png:.4f}')
