"""Matrix capsules with EM routing on smallNORB (Hinton et al. 2018, table 1).

  python -m experiments.train --workdir=/tmp/em_norb \\
      --config=experiments/configs/matrix_capsnet_smallnorb.py \\
      --config.data_dir=/path/to/smallnorb

smallNORB is not downloadable on machines without internet: put the six NYU
files (smallnorb-5x46789x9x18x6x2x96x96-{training,testing}-{dat,cat,info}.mat,
gz or not) in data_dir, or install capsjax[tfds] on a machine online.

Variants: small (A=64, B=8, C=D=16: the 68K model), azimuth / elevation
(novel-viewpoint splits), paper (the paper's routing options), authors
(the released code's routing options, training protocol, 2,000,000 steps
and data pipeline: pixel picking, brightness and contrast before the crop
in 0-255, the 13-crop test), mono (one stereo image), smoke (tiny, for
tests).
"""

from experiments.configs import common
from experiments.configs import matrix_capsnet_mnist


def get_config(variant: str = ''):
  config = matrix_capsnet_mnist.em_defaults(common.base_config())
  config.shorter_run = common.smoke_run('matrix_capsnet_smallnorb.py:smoke')
  config.dataset = 'smallnorb'
  config.validation_size = 2300
  config.max_shift = 0
  config.model_options.input_shape = (32, 32, 2)
  config.model_options.num_classes = 5
  config.num_train_steps = 150_000
  # 96x96 -> 48x48 (data.smallnorb.downsample): 'mean' (the 2x2 mean) or
  # 'pick' (pixel (2i, 2j): the released code's tf.image.resize_images).
  config.downsample = 'mean'
  # The training distortions (data.smallnorb_distort): 'crop_first' (crop,
  # then brightness and contrast) or 'released' (brightness and contrast on
  # the 48x48 image, then the crop); standardisation last in both.
  config.augment_order = 'crop_first'
  # Pixels are scaled to [0, pixel_max] before the distortions and the
  # standardisation: 1.0, or 255.0 (the released code's bytes); only the
  # standardisation's std floor 1/sqrt(32 * 32 * C) tells them apart.
  config.pixel_max = 1.0
  # Test-time views (training.matrix_capsules.eval_crop_mode): 'centre' (the
  # central 32x32) or
  # 'released13' (run.sh's test: 13 crops shifted by at most 2 pixels, each
  # crop's activations divided by their sum over the classes, summed).
  config.test_crops = 'centre'
  for part in filter(None, variant.split(',')):
    if part == 'small':
      config.model_options.A = 64
      config.model_options.B = 8
      config.model_options.C = 16
      config.model_options.D = 16
    elif part in ('azimuth', 'elevation'):
      config.viewpoint_split = part
    elif part == 'paper':
      matrix_capsnet_mnist.paper_routing(config)
    elif part == 'authors':
      matrix_capsnet_mnist.authors_routing(config)
      matrix_capsnet_mnist.authors_protocol(config)
      config.num_train_steps = 2_000_000
      config.downsample = 'pick'
      config.augment_order = 'released'
      config.pixel_max = 255.0
      config.test_crops = 'released13'
    elif part == 'mono':
      config.stereo = False
      config.model_options.input_shape = (32, 32, 1)
    elif part == 'smoke':
      config.model_options.A = 8
      config.model_options.B = 4
      config.model_options.C = 4
      config.model_options.D = 4
      config.num_train_steps = 20
      config.batch_size = 8
      config.validation_size = 8
      config.eval_every_steps = 10
      config.checkpoint_every_steps = 10
      config.log_every_steps = 5
    else:
      raise ValueError(f'unknown variant {part!r} of matrix_capsnet_smallnorb; '
                       f'known: small, azimuth, elevation, paper, authors, '
                       f'mono, smoke.')
  return config
