"""The config keys a run may leave out, and the values it then trains with.

A config enters the library through ``fill_defaults`` (``check_config``,
``runs.train``, the trainers' step and data builders, and the configs of
old workdirs read back), which adds the keys it lacks; the trainers then
read ``config.key`` and the fallbacks are written down here only. The
experiments' base config (experiments/configs/common.py) sets most of these
keys itself, with its own choices (a checkpoint every 600 s).
"""

from __future__ import annotations

from typing import Any

import ml_collections

DEFAULTS: dict[str, Any] = {
    # Adam's epsilon (optax's), and its form: 'paper' (Algorithm 1, optax's)
    # or 'tensorflow' (TF's kernel: state.scale_by_tensorflow_adam).
    'adam_epsilon': 1e-8,
    'adam_form': 'paper',
    # smallNORB training crops: 'crop_first' or 'resize_first'
    # (data.smallnorb_train_preprocess).
    'augment_order': 'crop_first',
    # > 0: digits placed on a canvas of this side (0: none).
    'canvas_size': 0,
    # > 0: the central crop of this side (0: none).
    'center_crop': 0,
    # Checkpoints by steps only (no wall-time checkpoint).
    'checkpoint_every_seconds': 0.0,
    'compute_dtype': 'float32',
    # smallNORB's 96 -> 48 downsampling.
    'downsample': 'mean',
    # No gradient clipping.
    'grad_clip': 0.0,
    # The EM family's L2 penalty: the sum of the squared weights.
    'l2_form': 'sum',
    # The EM family's class loss and its margin schedule.
    'loss': 'spread',
    'margin_schedule': 'authors',
    'margin_steps': 50_000,
    # No time limit.
    'max_train_seconds': 0.0,
    # A continuous learning-rate decay with no floor; no extra augmentation.
    'lr_staircase': False,
    'min_learning_rate': 0.0,
    'augment': '',
    # All local devices.
    'num_devices': 0,
    # smallNORB pixels scaled to [0, pixel_max].
    'pixel_max': 1.0,
    # Test the best validation state (False: the latest).
    'select_on_validation': True,
    # No shorter run to suggest with the time estimate.
    'shorter_run': '',
    'spread_class_reduction': 'sum',
    # One central test crop.
    'test_crops': 'centre',
}


def fill_defaults(config: ml_collections.ConfigDict
                  ) -> ml_collections.ConfigDict:
  """Adds the keys of ``DEFAULTS`` that ``config`` lacks, in place (the keys
  it has keep their values, None included); returns ``config``. Cheap and
  idempotent, so every door into the trainers may call it."""
  missing = [key for key in DEFAULTS if key not in config]
  if missing:
    with config.unlocked():
      for key in missing:
        config[key] = DEFAULTS[key]
  return config


def with_defaults(stored: dict[str, Any]) -> dict[str, Any]:
  """A plain (JSON) config with the keys it lacks taken from ``DEFAULTS``."""
  return DEFAULTS | stored
