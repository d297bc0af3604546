"""CapsNet on smallNORB (Sabour et al. 2017, section 7: 2.7% test error).

  python -m experiments.train --workdir=/tmp/capsnet_norb \\
      --config=experiments/configs/capsnet_smallnorb.py \\
      --config.data_dir=/path/to/smallnorb

smallNORB is not downloadable on machines without internet: put the six NYU
files (smallnorb-5x46789x9x18x6x2x96x96-{training,testing}-{dat,cat,info}.mat,
gz or not) in data_dir, or install capsjax[tfds] on a machine online (TFDS
name ``smallnorb``).

The paper: the MNIST architecture unchanged ("the same CapsNet
architecture as MNIST"), images resized to 48x48, random 32x32 crops in
training, the central 32x32 at test. The official code
(``input_data/norb/norb_input_record``, read from its own tfrecords of the
96x96 stereo pairs) does the same with these details, which this config
follows: both stereo images as two channels; the resize is TF1's
``resize_images`` (bilinear with the legacy pixel mapping, so each output
pixel is the source pixel (2i, 2j): ``downsample='pick'``); brightness
(max delta 63) and contrast (0.2-1.8) on the whole 48x48 image before the
crop (``augment_order='released'``); per-image standardisation of the 0-255
pixels, also at test; the reconstruction target is that standardised crop
(2,048 values). Its hparams for smallNORB are the defaults: 32 primary
types, 'VALID' padding, no leaky routing, the decoder on. Neither the paper
nor the official code gives a length: 17,200 steps of batch 128 are about
100 epochs of the 22,000 training images left beside validation.

Variants (``--config=experiments/configs/capsnet_smallnorb.py:VARIANT``):
  smoke  a reduced CapsNet (same code, smaller widths): 200 steps of batch
         32, the whole pipeline in minutes on a CPU.
"""

from experiments.configs import capsnet_mnist
from experiments.configs import common


def get_config(variant: str = ''):
  config = capsnet_mnist.get_config()
  config.shorter_run = common.smoke_run('capsnet_smallnorb.py:smoke')
  config.dataset = 'smallnorb'
  # As matrix_capsnet_smallnorb.py: 22,000 of the 24,300 training images.
  config.validation_size = 2300
  config.model_options.input_shape = (32, 32, 2)
  config.model_options.num_classes = 5
  # Both stereo images, as two channels (False: the left one).
  config.stereo = True
  # 96x96 -> 48x48 (data.smallnorb.downsample): 'pick' (pixel (2i, 2j), what
  # the official code's tf.image.resize_images computes) or 'mean'.
  config.downsample = 'pick'
  # The training distortions (data.smallnorb_distort): 'released' (brightness
  # and contrast on the 48x48 image, then the crop) or 'crop_first'.
  config.augment_order = 'released'
  # Pixels are standardised from [0, pixel_max]: 255, the official code's
  # scale; 1.0 differs only where the std floor 1/sqrt(32 * 32 * 2) binds.
  config.pixel_max = 255.0
  # The crops are the only translation (training.vector_capsules.preprocess).
  config.max_shift = 0
  config.num_train_steps = 17_200
  for part in filter(None, variant.split(',')):
    if part == 'smoke':
      config.model_options.conv1_channels = 32
      config.model_options.primary_types = 8
      config.model_options.decoder_widths = (64, 128)
      common.short_schedule(config)
    else:
      raise ValueError(f'unknown variant {part!r} of capsnet_smallnorb; '
                       'known: smoke.')
  return config
