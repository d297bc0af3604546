"""White-box FGSM and BIM attacks (Hinton et al. 2018, section 6).

    config.evals.attacks = dict(type='adversarial', epsilons=(0.05, 0.1, 0.2),
                                attacks=('fgsm', 'bim'))

The first ``num_examples`` (0: all) test images of the run's dataset, as the
model reads them at evaluation (the run's centre crop, if any), attacked at
every epsilon (pixels in [0, 1]) with the loss of the model's family
(``families.Family.attack_loss``): ``loss='family'`` the run's own class loss,
``'cross_entropy'`` softmax cross-entropy for every model. BIM takes
``bim_steps`` steps of ``bim_step_size``. Returns the clean accuracy, the
fraction of examples with a zero input gradient, and per attack a list of
accuracies, one per epsilon (``adversarial.evaluate_attacks``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ml_collections

from capsjax import adversarial
from capsjax import evaluators
from capsjax import families

DIGIT_DATASETS = ('mnist', 'fashion_mnist')


def check(config: ml_collections.ConfigDict, *,
          epsilons: Sequence[float] = (0.1,),
          attacks: Sequence[str] = adversarial.ATTACKS, loss: str = 'family',
          bim_step_size: float = 0.02, bim_steps: int = 20,
          num_examples: int = 0, batch_size: int = 100) -> None:
  """ValueError naming the bad option or the run that cannot be attacked."""
  bad = [a for a in attacks if a not in adversarial.ATTACKS]
  if not attacks or bad:
    raise ValueError(f'attacks must be a non-empty subset of '
                     f'{adversarial.ATTACKS}, got {tuple(attacks)}.')
  if not epsilons or any(not 0 <= e <= 1 for e in epsilons):
    raise ValueError(f'epsilons must be values in [0, 1], got '
                     f'{tuple(epsilons)}.')
  if loss not in families.ATTACK_LOSSES:
    raise ValueError(f'loss must be one of {families.ATTACK_LOSSES}, got '
                     f'{loss!r}.')
  if num_examples < 0 or bim_steps < 0:
    raise ValueError(f'num_examples and bim_steps must be >= 0, got '
                     f'{num_examples} and {bim_steps}.')
  if batch_size < 1 or bim_step_size <= 0:
    raise ValueError(f'batch_size must be >= 1 and bim_step_size > 0, got '
                     f'{batch_size} and {bim_step_size}.')
  if config.dataset not in DIGIT_DATASETS:
    raise ValueError(
        f'the run was trained on {config.dataset!r}; the attacks perturb '
        f'[0, 1] pixels, which only {DIGIT_DATASETS} models see.')


def evaluate(context: evaluators.Context, *,
             epsilons: Sequence[float] = (0.1,),
             attacks: Sequence[str] = adversarial.ATTACKS,
             loss: str = 'family', bim_step_size: float = 0.02,
             bim_steps: int = 20, num_examples: int = 0,
             batch_size: int = 100) -> dict[str, Any]:
  config = context.config
  check(config, epsilons=epsilons, attacks=attacks, loss=loss,
        bim_step_size=bim_step_size, bim_steps=bim_steps,
        num_examples=num_examples, batch_size=batch_size)
  test = context.dataset.test
  num = num_examples or len(test.labels)
  family = families.of(config.model)
  kind, margin = family.attack_options(config, loss)
  start = time.perf_counter()
  row = adversarial.evaluate_attacks(
      context.model, context.eval_inputs(test.images[:num]),
      test.labels[:num], epsilons, attacks=attacks, kind=kind,
      spread_margin=margin, step_size=bim_step_size, num_steps=bim_steps,
      batch_size=batch_size)
  return {'attack_loss': family.attack_loss_name(kind, margin),
          'attack_wall_s': time.perf_counter() - start, **row}
