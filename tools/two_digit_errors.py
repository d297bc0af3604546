"""Where a two-digit model fails: wrong pairs with a spurious "1", blank fields.

    python tools/two_digit_errors.py RUN_WORKDIR...

For each trained two-digit model (a run's workdir, as
``experiments.two_digit_transfer`` writes it: ``W/seed0/two_digit_capsnet``)
and each layout of the test pairs (stacked, side by side; the pairs of seed
0 from the 10,000 MNIST test digits), prints accuracy 1 (the two highest
scores are the two digits), how many wrong pairs have a "1" among the two
highest scores that is not in the pair, and the error of the pairs with and
without a blank receptive field (``capsjax.data.blank_fields``). Record:
results/two_digit_transfer/README.md (its output quoted whole).
"""

from __future__ import annotations

import sys

import numpy as np

from capsjax import training
from capsjax.data import blank_fields
from capsjax.data import digit_pairs
from capsjax.data import load_dataset
from capsjax.evaluators import two_digit_transfer
from capsjax.kernels.conv import dispatch


def main(workdirs: list[str]) -> None:
  if not workdirs:
    sys.exit(__doc__)
  dispatch.prefer_eigen_convolutions()  # as the experiments evaluated
  test = load_dataset('mnist', validation_size=5000).test
  for workdir in workdirs:
    model = training.load_trained_model(workdir)
    for layout in ('stacked', 'side_by_side'):
      pairs = digit_pairs(test.images, test.labels, 0, layout)
      scores = two_digit_transfer.predict_scores(model, pairs['image'])
      top = np.argsort(-scores, 1)[:, :2]
      wrong = ~(np.sort(top, 1) == np.sort(pairs['labels'], 1)).all(1)
      spurious_one = (wrong & (top == 1).any(1)
                      & ~(pairs['labels'] == 1).any(1))
      blank = blank_fields(pairs['image']).reshape(len(top), -1).any(1)
      print(f'{workdir} {layout}: {len(top)} pairs, accuracy 1 '
            f'{1 - wrong.mean():.4f}; {wrong.sum()} wrong, '
            f'{spurious_one.sum()} of them with a "1" that is not in the '
            f'pair; {blank.sum()} pairs with a blank field: error '
            f'{wrong[blank].mean():.4f} with one, '
            f'{wrong[~blank].mean():.4f} without', flush=True)


if __name__ == '__main__':
  main(sys.argv[1:])
