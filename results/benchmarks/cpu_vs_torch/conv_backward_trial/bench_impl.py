"""experiments.benchmark with conv2d's CPU default replaced by
CONV_IMPL_OVERRIDE (patches|direct) for an A/B of whole models."""
import os, sys
from capsjax import layers
impl = os.environ.get('CONV_IMPL_OVERRIDE')
if impl:
  _conv2d = layers.conv2d
  def conv2d(x, kernel, stride=1, padding='VALID', impl_=None):
    return _conv2d(x, kernel, stride, padding, impl_ or impl)
  layers.conv2d = conv2d
from experiments import benchmark
from absl import app
app.run(benchmark.main)
