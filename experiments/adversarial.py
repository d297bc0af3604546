"""White-box FGSM and BIM attacks on trained models (Hinton et al. 2018).

  python -m experiments.adversarial --workdir=/tmp/adversarial \\
      --models=/tmp/capsnet,/tmp/cnn,/tmp/em \\
      [--config=experiments/configs/adversarial.py[:smoke]]

Loads each --models workdir's model (the checkpoint selected on validation),
attacks the first config.num_examples test images at every epsilon, and
writes WORKDIR/summary.json (clean accuracy and accuracy per attack and
epsilon, for every model) and WORKDIR/accuracy_vs_epsilon.png. The :smoke
config trains tiny models itself and needs no --models. Keys (epsilons,
attacks, bim_step_size, bim_steps, loss, num_examples, ...): see the config
file's docstring; override them with --config.KEY=VALUE.
"""

from absl import flags

from capsjax import robustness
from experiments import launcher

_MODELS = flags.DEFINE_list(
    'models', [], 'Comma-separated workdirs of trained models to attack '
    '(capsnet, baseline_cnn, matrix_capsnet, ... on MNIST or Fashion-MNIST).')

if __name__ == '__main__':
  launcher.run(lambda config, workdir: robustness.run(config, workdir,
                                                      _MODELS.value),
               'adversarial.py', workdir_help='Directory for summary.json, '
               'accuracy_vs_epsilon.png and the models the config trains.')
