"""CapsNet on Fashion-MNIST (same model and training as on MNIST).

  python -m experiments.train --workdir=/tmp/capsnet_fashion \\
      --config=experiments/configs/capsnet_fashion_mnist.py

Variants: smoke, norecon, iter1 (as capsnet_mnist.py).
"""

from experiments.configs import capsnet_mnist


def get_config(variant: str = ''):
  return capsnet_mnist.get_config(','.join(filter(None, ['fashion', variant])))
