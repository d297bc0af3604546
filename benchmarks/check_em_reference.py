"""Checks that the PyTorch EM reference computes capsjax's matrix-capsule model.

    python -m benchmarks.check_em_reference

Copies one capsjax MatrixCapsNet's parameters into
``torch_models.MatrixCapsNet`` and prints the largest difference of their
class activations on the same random images, for the smoke config with
capsjax's routing options and with the paper's (grid coordinates: the
reference adds the grid's). Needs torch (``pip install -e '.[bench]'``),
so it is not part of the test suite.
"""

import numpy as np
import torch
from flax import nnx
from jax import numpy as jnp

from benchmarks import torch_models
from capsjax import models
from capsjax.training import state as state_lib
from experiments.configs import matrix_capsnet_mnist


def copy_parameters(source: models.MatrixCapsNet,
                    target: torch_models.MatrixCapsNet) -> None:
  def tensor(param):
    return torch.tensor(np.asarray(param[...]))
  primary = source.primary
  with torch.no_grad():
    target.conv1.weight.copy_(tensor(source.conv1.kernel).permute(3, 2, 0, 1))
    target.conv1.bias.copy_(tensor(source.conv1.bias))
    kernel = torch.cat([tensor(primary.pose_kernel),
                        tensor(primary.activation_kernel)], 1)
    target.primary.weight.copy_(kernel.T[:, :, None, None])
    target.primary.bias.copy_(torch.cat([tensor(primary.pose_bias),
                                         tensor(primary.activation_bias)]))
    for ours, theirs in ((source.caps1, target.caps1),
                         (source.caps2, target.caps2)):
      theirs.weights.copy_(tensor(ours.weights).flatten(0, 2))
      theirs.beta_u.copy_(tensor(ours.beta_u))
      theirs.beta_a.copy_(tensor(ours.beta_a))
    target.class_weights.copy_(tensor(source.class_caps.weights))
    target.beta_u.copy_(tensor(source.class_caps.beta_u))
    target.beta_a.copy_(tensor(source.class_caps.beta_a))


def max_difference(variant: str, batch_size: int = 4) -> float:
  config = matrix_capsnet_mnist.get_config(variant)
  options = state_lib.model_options(config) | {'coordinate_form': 'grid'}
  ours = models.create_model('matrix_capsnet', rngs=nnx.Rngs(0), **options)
  theirs = torch_models.MatrixCapsNet(**options)
  copy_parameters(ours, theirs)
  images = np.random.default_rng(0).random(
      (batch_size,) + options['input_shape'], np.float32)
  expected = np.asarray(ours(jnp.asarray(images))['class_scores'])
  got = theirs(torch.tensor(images).permute(0, 3, 1, 2), None)['activations']
  return float(np.abs(expected - got.detach().numpy()).max())


def main() -> None:
  for variant in ('smoke', 'smoke,paper'):
    difference = max_difference(variant)
    print(f'matrix_capsnet_mnist:{variant}: largest class-activation '
          f'difference {difference:.2e}')
    if not difference < 1e-5:
      raise SystemExit('the PyTorch reference differs from capsjax')


if __name__ == '__main__':
  main()
