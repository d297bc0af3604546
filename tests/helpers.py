"""Helpers shared by several test files: data files written in the real
release formats, tiny training configs, and convolution references."""

import functools
import struct

import jax
import numpy as np
from flax import nnx
from scipy import io as scipy_io

from capsjax import models
from capsjax.data import cifar10
from capsjax.data import smallnorb as norb
from capsjax.data import write_cifar_binary
from capsjax.data import write_cifar_pickle
from capsjax.data import write_norb_matrix
from capsjax.data import write_svhn_mat
from experiments.configs import capsnet_mnist
from tests import conftest

# ----------------------------------------------------------------------------
# Convolutions (capsjax.kernels.conv) against direct and float64 references.


def em_window_inputs(seed, num=3, num_in=7, num_out=4, dtype=np.float64,
                     beta_a_scale=0.3):
  """Random inputs of N windows' EM routing kernels: (poses [N, I, 4, 4],
  activations [N, I], transforms [I, O, 4, 4], beta_u [O], beta_a [O])."""
  rng = np.random.default_rng(seed)
  poses = rng.normal(size=(num, num_in, 4, 4))
  acts = rng.uniform(0.05, 1.0, size=(num, num_in))
  weights = rng.normal(size=(num_in, num_out, 4, 4)) * 0.5
  beta_u = rng.normal(size=num_out) * 0.3
  beta_a = rng.normal(size=num_out) * beta_a_scale
  return tuple(np.asarray(x, dtype) for x in (poses, acts, weights, beta_u,
                                              beta_a))


def np_window_votes(poses, weights):
  """V_io = M_i W_io: [N, I, O, 16]."""
  v = np.einsum('nipq,ioqr->niopr', poses, weights)
  return v.reshape(v.shape[:3] + (16,))


def em_beta_a_scale(name):
  """The authors' logit has -5000 beta_a: small betas keep it informative."""
  return 1e-3 if name == 'authors' else 0.3


def direct_conv(x, kernel, stride, padding='VALID'):
  return jax.lax.conv_general_dilated(
      x, kernel, (stride, stride), padding,
      dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


def random_normal(seed, shape, scale=1.0):
  # NumPy, not jax.random: XLA:CPU takes seconds to compile random bits for
  # each many-axis shape.
  rng = np.random.default_rng(seed)
  return (scale * rng.standard_normal(shape)).astype(np.float32)


# ----------------------------------------------------------------------------
# Convolution.


def output_and_grads(conv, x, kernel, cotangent):
  """conv(x, kernel) and the gradients of <cotangent, conv(x, kernel)>."""
  out, vjp = jax.vjp(conv, x, kernel)
  return out, vjp(cotangent)


# One jitted output_and_grads for every comparison, so that a convolution
# passed again (the same object, e.g. from direct_reference) with inputs of
# shapes seen before reuses its compiled program.
jit_output_and_grads = jax.jit(output_and_grads, static_argnums=0)


@functools.cache
def _jitted_create_model(name, options):
  return nnx.jit(lambda: models.create_model(name, rngs=nnx.Rngs(0),
                                             **dict(options)))


def created_model(name, **options):
  """``models.create_model(name, rngs=nnx.Rngs(0), **options)`` built as
  one compiled program, kept for the next call with the same options
  (eagerly, each initialiser compiles per shape); a new model each call.
  Its initial values may differ from an eager build's in the last bit: for
  checks that do not depend on them."""
  return _jitted_create_model(name, tuple(sorted(options.items())))()


@functools.cache
def direct_reference(stride, padding='VALID'):
  """direct_conv with this stride and padding, as one object per arguments:
  the parametrisations that compare several lowerings on the same shapes
  compile the reference once (a fresh lambda per test would miss the jit
  cache)."""
  return functools.partial(direct_conv, stride=stride, padding=padding)


def assert_equals_direct(fast, direct, x, kernel, cotangent):
  """``fast`` and ``direct`` (convolutions of (x, kernel)) agree in values
  and in the gradients with respect to both the input and the kernel;
  returns fast's output."""
  out, (gx, gk) = jit_output_and_grads(fast, x, kernel, cotangent)
  ref, (gx_ref, gk_ref) = jit_output_and_grads(direct, x, kernel, cotangent)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gk, gk_ref, rtol=1e-5, atol=1e-4)
  return out


def conv_reference(x, kernel, cotangent, stride=1,
                    padding=((0, 0), (0, 0))):
  """The convolution and its gradients (x, kernel, cotangent: NumPy arrays
  or anything np.asarray takes) in float64 NumPy, from the definition:
  with x zero-padded to xp by ((top, bottom), (left, right)),
  y[b, i, j, f] = sum_{u, v, c} xp[b, s i + u, s j + v, c] k[u, v, c, f];
  dxp[b, s i + u, s j + v, c] += dy[b, i, j, f] k[u, v, c, f], cropped;
  dk[u, v, c, f] = sum_{b, i, j} xp[b, s i + u, s j + v, c] dy[b, i, j, f]."""
  (top, bottom), (left, right) = padding
  xp = np.pad(np.asarray(x, np.float64),
              ((0, 0), (top, bottom), (left, right), (0, 0)))
  k64, dy64 = np.asarray(kernel, np.float64), np.asarray(cotangent, np.float64)
  _, out_h, out_w, _ = dy64.shape
  out, gxp, gk = np.zeros(dy64.shape), np.zeros(xp.shape), np.zeros(k64.shape)
  for u in range(kernel.shape[0]):
    for v in range(kernel.shape[1]):
      rows = slice(u, u + stride * (out_h - 1) + 1, stride)
      cols = slice(v, v + stride * (out_w - 1) + 1, stride)
      window = xp[:, rows, cols]
      out += np.einsum('bijc,cf->bijf', window, k64[u, v])
      gxp[:, rows, cols] += np.einsum('bijf,cf->bijc', dy64, k64[u, v])
      gk[u, v] = np.einsum('bijc,bijf->cf', window, dy64)
  gx = gxp[:, top:xp.shape[1] - bottom, left:xp.shape[2] - right]
  return out, gx, gk


# ----------------------------------------------------------------------------
# Data files in the real formats.


def idx_bytes(array: np.ndarray, type_code: int = 0x08) -> bytes:
  """IDX file bytes written by hand (independent of the reader)."""
  header = struct.pack('>BBBB', 0, 0, type_code, array.ndim)
  header += struct.pack(f'>{array.ndim}I', *array.shape)
  return header + array.astype(array.dtype.newbyteorder('>')).tobytes()


def write_release_mat(path, images, labels):
  """Writes a file laid out as the release's: images as the columns of a
  1600 x N matrix, each in row-major order; labels 1 x N."""
  n = len(labels)
  onehot = np.eye(10, dtype=np.uint8)[labels].T
  scipy_io.savemat(path, {'affNISTdata': {
      'human_readable_transform': np.zeros((5, n)),
      'label_int': labels.astype(np.uint8)[None],
      'image': images.reshape(n, 1600).T,
      'transform': np.zeros((6, n)),
      'label_one_of_n': onehot,
  }})


def make_norb_release(directory, n_train=36, n_test=36, *, gz=False):
  """A fake release: image i of a file is filled with i (as its id)."""
  directory.mkdir(parents=True, exist_ok=True)
  arrays = {}
  for split, n in (('training', n_train), ('testing', n_test)):
    i = np.arange(n)
    dat = np.broadcast_to(i[:, None, None, None], (n, 2, 96, 96)).copy()
    dat[:, 1] += 100  # tell the stereo images apart
    dat = dat.astype(np.uint8)
    cat = (i % 5).astype(np.int32)
    info = np.stack([i % 10, i % 9, 2 * (i % 18), i % 6], 1).astype(np.int32)
    for kind, array in (('dat', dat), ('cat', cat), ('info', info)):
      name = f'{norb.SPLIT_FILES[split]}-{kind}.mat' + ('.gz' if gz else '')
      write_norb_matrix(directory / name, array)
    arrays[split] = (dat, cat, info)
  return arrays


def make_cifar10_release(directory, n_per_batch=6, n_test=8, *, form='binary',
                 seed=0):
  """A fake release in ``directory``: image i of the training files is
  filled with i (as its id) in its red plane."""
  directory.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  write = write_cifar_binary if form == 'binary' else write_cifar_pickle
  train_names, test_name = cifar10.RELEASES[form]
  images = rng.integers(0, 256, (5 * n_per_batch, 32, 32, 3), dtype=np.uint8)
  images[..., 0] = np.arange(5 * n_per_batch)[:, None, None]
  labels = rng.integers(0, 10, 5 * n_per_batch)
  for k, name in enumerate(train_names):
    part = slice(k * n_per_batch, (k + 1) * n_per_batch)
    write(directory / name, images[part], labels[part])
  test = (rng.integers(0, 256, (n_test, 32, 32, 3), dtype=np.uint8),
          rng.integers(0, 10, n_test))
  write(directory / test_name, *test)
  return (images, labels), test


def make_svhn_release(directory, n_train=12, n_test=6, seed=0):
  """``train_32x32.mat`` and ``test_32x32.mat``; image i of the training
  file is filled with i (as its id) in its red channel."""
  directory.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  train = (rng.integers(0, 256, (n_train, 32, 32, 3), dtype=np.uint8),
           np.arange(n_train) % 10)
  train[0][..., 0] = np.arange(n_train)[:, None, None]
  test = (rng.integers(0, 256, (n_test, 32, 32, 3), dtype=np.uint8),
          rng.integers(0, 10, n_test))
  write_svhn_mat(directory / 'train_32x32.mat', *train)
  write_svhn_mat(directory / 'test_32x32.mat', *test)
  return train, test


# ----------------------------------------------------------------------------
# Tiny CapsNet training runs.

TINY_OPTIONS = dict(conv1_channels=8, primary_types=2, decoder_widths=(16, 32))

TINY = dict(batch_size=8, validation_size=40, num_train_steps=12,
            checkpoint_every_steps=2, eval_every_steps=2, log_every_steps=1,
            eval_batch_size=40)


def write_tiny_mnist(directory, num_train=200, num_test=40, seed=0):
  """Random digits in the four IDX files of MNIST (enough to train on)."""
  rng = np.random.default_rng(seed)

  def random_split(num):
    images = rng.integers(0, 256, (num, 28, 28), dtype=np.uint8)
    return images, rng.integers(0, 10, num, dtype=np.uint8)

  train = random_split(num_train)
  return conftest.write_mnist_dir(directory, train, random_split(num_test))


def tiny_config(data_dir, **overrides):
  config = capsnet_mnist.get_config('smoke')
  config.model_options.update(TINY_OPTIONS)
  config.update(TINY)
  config.data_dir = data_dir
  config.update(overrides)
  return config


def tiny_flags(data_dir, **overrides):
  """The command-line flags of ``tiny_config``."""
  flags = [f'--config.model_options.{k}={v}' for k, v in TINY_OPTIONS.items()]
  flags += [f'--config.{k}={v}' for k, v in (TINY | overrides).items()]
  return flags + [f'--config.data_dir={data_dir}']
