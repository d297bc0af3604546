"""Su's two-digit transfer test: train on single digits, name two at once.

  python -m experiments.two_digit_transfer --workdir=/tmp/two_digit \\
      --config=experiments/configs/two_digit_transfer.py[:smoke]

Trains Su's pooling baseline and shared-weight capsule model on single MNIST
digits (each in WORKDIR/<model>, resumable), then shows both pairs of
different test digits side by side (28x56). Writes WORKDIR/summary.json
(normal test accuracy; accuracy 1: the two highest scores are the two digits;
accuracy 2: the same and both scores > 0.5; Su's numbers beside them) and
WORKDIR/pairs.png. Config keys: see the config file's docstring.
"""

from capsjax import transfer
from experiments import launcher

if __name__ == '__main__':
  launcher.run(transfer.train_and_evaluate, 'two_digit_transfer.py')
