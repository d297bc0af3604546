"""Session 15 prototype: experiments.benchmark with every VALID stride-1
float32 convolution of 16+ input channels on the CPU (Su's last three
layers) through oneDNN by XLA FFI (onednn_conv.py). Same flags as
experiments.benchmark. OMP_NUM_THREADS=2 PYTHONPATH=. python this --model=...
"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from absl import app
from capsjax import layers
from experiments import benchmark
import jax
from onednn_conv import onednn_conv

_conv2d = layers.conv2d
routed = []


def conv2d(x, kernel, stride=1, padding='VALID', impl=None):
  if (impl is None and stride == 1 and padding == 'VALID' and
      x.dtype == kernel.dtype == jax.numpy.float32 and x.shape[-1] >= 16 and
      jax.default_backend() == 'cpu'):
    routed.append((x.shape, kernel.shape))
    return onednn_conv(x, kernel)
  return _conv2d(x, kernel, stride, padding, impl)


layers.conv2d = conv2d


def main(argv):
  benchmark.main(argv)
  print('through oneDNN:', sorted(set(routed)))


if __name__ == '__main__':
  app.run(main)
