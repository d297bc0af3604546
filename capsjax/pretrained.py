"""Trained models that ship with capsjax: load one in a line, no training.

  model, info = capsjax.pretrained.load('capsnet_mnist_smoke')
  capsjax.pretrained.available()   # {name: one-line description}

  python -m capsjax.pretrained capsnet_mnist_smoke digits/ photo.jpg

Each model is two files in ``capsjax/pretrained_models/``: ``NAME.npz``, its
trained parameters and batch statistics by their paths in the model
(float32, or float16 where float32 would pass 5 MB), and ``NAME.json``: the
training run's config, command, commit, date, validation and test accuracy,
and the SHA-256 of the ``.npz``. ``load`` reads each file once and checks
it against ``MODELS`` below (the ``.npz``'s bytes, the ``.json``'s content)
before using it, then builds the model from the stored config with the
function training uses (``training.state.create_model``) and fills its
parameters.

The command line classifies image files (PNG, JPEG and the rest Pillow
reads; any size, grey or colour) as the model's training images looked:
``mnist_like`` turns a dark digit on light paper, or a light one on dark,
into an MNIST digit (light on black, fitted into 20x20 and centred by its
centre of mass in 28x28). It prints ``PATH<TAB>CLASS<TAB>SCORE`` per image
(the score: the winning capsule's length, or the EM model's activation;
a tab or newline in PATH is escaped as ``\\t``, ``\\n``);
unreadable files are named on stderr and skipped; exit status 2 when none
could be read.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import NamedTuple

import jax
import ml_collections
import numpy as np
from flax import nnx
from PIL import Image

from capsjax import evaluators
from capsjax.data import images as images_lib
from capsjax.evaluators import confusion
from capsjax.training import runs
from capsjax.training import state as state_lib

# The shipped files, beside this module (pyproject.toml's package-data).
MODELS_DIR = Path(__file__).resolve().parent / 'pretrained_models'


# What a shipped file holds: the trained parameters and, for models with
# batch normalisation, its running statistics (without them the model
# normalises by its initial mean 0 and variance 1 and guesses at chance).
SHIPPED = (nnx.Param, nnx.BatchStat)


class Entry(NamedTuple):
  """A shipped model: what it is, the SHA-256 of its ``.npz`` and that of
  its ``.json``'s content (``info_sha256``: the config that builds the
  model is checked too)."""

  description: str
  sha256: str
  info_sha256: str


# The registry. A retrained model changes its digest here too: the file and
# this line are one change.
MODELS: dict[str, Entry] = {
    'efficient_capsnet_mnist': Entry(
        'Efficient-CapsNet (self-attention routing, 161,824 parameters and '
        'its decoder) on MNIST digits 0-9 at its authors\' protocol, 99.72% '
        'test; float16 file',
        '39a2060d19e63e736816163f589102f7d784feb3c1e2d53528aa52199b52ebeb',
        '1fed987683deda7de44f65bf6b2528b044975e9dbc539a59ccc00a140d330319'),
    'matrix_capsnet_mnist': Entry(
        'EM-routing matrix capsules, the paper\'s model (A=B=C=D=32, 3 '
        'iterations) on MNIST digits 0-9 at its full protocol, 99.33% test',
        '1279737bdf9db7ef2868059f8d58504b540700426c719057680f539dfac71d6d',
        '7259c0dfcf6fe101c736d425cae85a3713e3cbd438f3d8529494e59e91ef66ea'),
    'capsnet_mnist_smoke': Entry(
        'CapsNet (reduced :smoke widths, 3 routing iterations) on MNIST '
        'digits 0-9; 700 steps on a 2-core CPU',
        '357092940b99903bff3aadf51893c004e26574a1955792717c60aacf602613d4',
        '2285799fca84aa6df6832b841bcb39279aac3dd2065e12d8fda31bd743c74f30'),
    'matrix_capsnet_mnist_smoke': Entry(
        'EM-routing matrix capsules (:smoke, A=32 B=4 C=D=8) on MNIST digits '
        '0-9, reading the central 24x24; 1,169 steps on a 2-core CPU',
        '6361788ec993d585bf7ef32fbddacc170c416569e5fff92e8efbc73c30f61652',
        'd5934e711209cd994f051a7e5d1a6bb2f2b73c4274224088c419eeb3a4f677dd'),
}

# MNIST's digits: fitted into a 20x20 box, centred by mass in 28x28.
MNIST_SIZE = 28
MNIST_BOX = 20
# Images are decoded (stretched) at this side before the digit is found in
# them: enough detail for the 20-pixel box.
DECODE_SIZE = 112


class DigestMismatch(ValueError):
  """A shipped model's file differs from the digest in the registry."""


def available() -> dict[str, str]:
  """The shipped models: name -> one-line description."""
  return {name: entry.description for name, entry in MODELS.items()}


def _entry(name: str) -> Entry:
  if name not in MODELS:
    raise KeyError(f'no shipped model named {name!r}; available: '
                   f'{", ".join(MODELS)}.')
  return MODELS[name]


def paths(name: str) -> tuple[Path, Path]:
  """The ``.npz`` of parameters and the ``.json`` of a shipped model."""
  _entry(name)
  return MODELS_DIR / f'{name}.npz', MODELS_DIR / f'{name}.json'


def file_sha256(path: str | os.PathLike) -> str:
  """SHA-256 of a file's bytes, in hex."""
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def _verified_bytes(path: str | os.PathLike, expected: str) -> bytes:
  """The file's bytes, read once: DigestMismatch naming ``path`` and both
  digests unless their SHA-256 is ``expected``. What is checked is what is
  used."""
  with open(path, 'rb') as f:
    data = f.read()
  _check(path, hashlib.sha256(data).hexdigest(), expected)
  return data


def info_sha256(info: dict[str, Any]) -> str:
  """SHA-256 of a model's info (its ``.json``) as canonical JSON: the
  content is checked, not its whitespace or line endings (a checkout that
  turns them into CRLF changes no digest)."""
  text = json.dumps(info, sort_keys=True, separators=(',', ':'))
  return hashlib.sha256(text.encode()).hexdigest()


def _check(path: str | os.PathLike, actual: str, expected: str) -> None:
  if actual != expected:
    raise DigestMismatch(
        f'{os.fspath(path)}: SHA-256 {actual} differs from the registry\'s '
        f'{expected}; the file is damaged or was replaced. Reinstall capsjax '
        f'(or git checkout the file).')


# ----------------------------------------------------------------------------
# Parameters <-> a flat .npz.


def _flat(tree) -> dict[str, Any]:
  """A pytree's leaves by their path (``jax.tree_util.keystr``)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def _filled(tree, arrays: dict[str, np.ndarray], where: str):
  """``tree`` with each leaf replaced by ``arrays[its path]``, cast to the
  leaf's dtype; ValueError naming ``where`` unless paths and shapes match."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  names = [jax.tree_util.keystr(path) for path, _ in leaves]
  if sorted(names) != sorted(arrays):
    missing = sorted(set(names) - set(arrays))
    extra = sorted(set(arrays) - set(names))
    raise ValueError(f'{where}: its parameters do not fit the model built '
                     f'from its config (missing {missing[:3]}, unexpected '
                     f'{extra[:3]}).')
  values = []
  for name, (_, leaf) in zip(names, leaves, strict=True):
    array = arrays[name]
    if array.shape != leaf.shape:
      raise ValueError(f'{where}: {name} has shape {array.shape}, the model '
                       f'{leaf.shape}.')
    values.append(jax.numpy.asarray(array, leaf.dtype))
  return jax.tree_util.tree_unflatten(treedef, values)


def save_params(params, path: str | os.PathLike, dtype='float32') -> str:
  """Writes ``params`` (an ``nnx.State``) as a compressed ``.npz`` of
  ``dtype`` arrays by path ('float16' halves a file; ``load`` casts back to
  the model's dtype); returns its SHA-256."""
  with np.errstate(over='ignore'):  # checked below, with the leaf named
    arrays = {name: np.asarray(leaf, np.dtype(dtype))
              for name, leaf in _flat(params).items()}
  for name, array in arrays.items():
    if not np.all(np.isfinite(array)):
      # float16 ends at 65,504: a larger weight would ship as inf.
      raise ValueError(f'{name} is not finite as {dtype}; store float32.')
  with open(path, 'wb') as f:
    np.savez_compressed(f, **arrays)
  return file_sha256(path)


# ----------------------------------------------------------------------------
# Loading.


def _read_info(name: str) -> dict[str, Any]:
  """The model's ``.json``, checked against the registry's digest."""
  _, json_path = paths(name)
  with open(json_path) as f:
    info = json.load(f)
  _check(json_path, info_sha256(info), _entry(name).info_sha256)
  return info


def _model_with(config, arrays: dict[str, np.ndarray], where: str):
  """The model of ``config`` (``training.state.create_model``, as training
  builds it) holding ``arrays`` as its parameters and batch statistics."""
  # Built abstractly: the random initial values, each a small XLA program
  # to compile, would all be replaced. Only SHIPPED state is in the file,
  # so a model with other state (RNG streams) is built for real.
  abstract = nnx.eval_shape(lambda: state_lib.create_model(config))
  graphdef, shipped, rest = nnx.split(abstract, SHIPPED, ...)
  if _has_leaves(rest):
    graphdef, shipped, rest = nnx.split(state_lib.create_model(config),
                                        SHIPPED, ...)
  return nnx.merge(graphdef, _filled(shipped, arrays, where), rest)


def _has_leaves(tree) -> bool:
  return bool(jax.tree_util.tree_leaves(tree))


def load_context(name: str, data_dir: str | None = None):
  """A shipped model as the evaluators see it (``evaluators.Context``, as
  ``training.load_context`` gives for a workdir), and its info; the
  model's data (for ``evaluate_split``) is read from ``data_dir`` on first
  use. Nothing is written (``write_files`` False).

  Raises:
    KeyError: no such model.
    DigestMismatch: its ``.npz`` is not the registry's.
  """
  npz_path, _ = paths(name)
  data = _verified_bytes(npz_path, _entry(name).sha256)
  info = _read_info(name)
  config = ml_collections.ConfigDict(info['config'])
  config.data_dir = data_dir or ''
  with np.load(io.BytesIO(data)) as stored:
    arrays = {key: stored[key] for key in stored.files}
  graphdef, state = state_lib.init_train_state(
      _model_with(config, arrays, os.fspath(npz_path)),
      state_lib.make_optimizer(config))
  context = runs.context_of(config, graphdef, state, workdir='',
                            write_files=False)
  return context, info | {'name': name, 'file': os.fspath(npz_path)}


def load(name: str) -> tuple[Any, dict[str, Any]]:
  """A shipped model with its trained parameters, and its info: 'classes',
  'image_size' and 'channels' (the images it is given, uint8, before
  ``preprocess``), 'model_input' (what the model reads), 'config',
  'command', 'commit', 'date', 'validation_accuracy', 'test_accuracy',
  'sha256', 'file'.

  Raises:
    KeyError: no such model.
    DigestMismatch: its ``.npz`` is not the registry's.
  """
  context, info = load_context(name)
  return context.model, info


def preprocess(info: dict[str, Any]) -> Callable:
  """uint8 images [N, S, S, C] (``info['image_size']``) -> what the model
  reads: the training run's own evaluation preprocessing."""
  config = ml_collections.ConfigDict(info['config'])
  return runs.family(config).steps_for(
      config, state_lib.make_optimizer(config)).eval_inputs


# ----------------------------------------------------------------------------
# Image files -> MNIST-like digits.


def _background(grey: np.ndarray) -> float:
  """The median of the image's outermost pixels: its paper or its
  darkness."""
  edge = np.concatenate([grey[0], grey[-1], grey[:, 0], grey[:, -1]])
  return float(np.median(edge))


def _ink_box(ink: np.ndarray) -> tuple[int, int, int, int]:
  """(top, bottom, left, right), exclusive ends, of the pixels above a
  tenth of the brightest; the whole image when it is blank."""
  visible = ink > 0.1 * max(ink.max(), 1e-6)
  rows = np.flatnonzero(visible.any(axis=1))
  cols = np.flatnonzero(visible.any(axis=0))
  if not len(rows):
    return 0, ink.shape[0], 0, ink.shape[1]
  return rows[0], rows[-1] + 1, cols[0], cols[-1] + 1


def mnist_like(grey: np.ndarray, size: tuple[int, int]) -> np.ndarray:
  """One decoded image -> an MNIST digit: uint8 [28, 28].

  ``grey``: uint8 [S, S], the file stretched to a square; ``size``: the
  image's (width, height) as shown, so that the digit keeps its aspect
  ratio. The
  background (the border's median) becomes black and the ink light at
  full contrast, as MNIST's; the ink's bounding box is fitted into 20x20
  and placed so that its centre of mass is the image's centre, as MNIST's
  digits were made.
  """
  grey = grey.astype(np.float32)
  background = _background(grey)
  # Dark ink on light paper (a photo, a scan) is inverted: MNIST's is light.
  ink = grey - background if background < 128 else background - grey
  ink = np.clip(ink, 0, None)
  top, bottom, left, right = _ink_box(ink)
  ink = ink[top:bottom, left:right] * (255 / max(ink.max(), 1e-6))
  # The box's sides in the file's pixels (the decoded square stretched it).
  width = (right - left) * size[0] / grey.shape[1]
  height = (bottom - top) * size[1] / grey.shape[0]
  scale = MNIST_BOX / max(width, height)
  fitted = Image.fromarray(ink.astype(np.uint8)).resize(
      (max(1, round(width * scale)), max(1, round(height * scale))),
      Image.Resampling.BILINEAR, reducing_gap=3.0)
  return _centred(np.asarray(fitted, np.float32))


def _centred(digit: np.ndarray) -> np.ndarray:
  """``digit`` (at most 20x20) in a black 28x28, its centre of mass at the
  centre (kept inside the image)."""
  out = np.zeros((MNIST_SIZE, MNIST_SIZE), np.float32)
  h, w = digit.shape
  total = digit.sum()
  if total > 0:
    cy = (digit.sum(axis=1) @ np.arange(h)) / total
    cx = (digit.sum(axis=0) @ np.arange(w)) / total
  else:
    cy, cx = (h - 1) / 2, (w - 1) / 2
  # MNIST's centres of mass lie at pixel (14, 14), not between pixels.
  top = int(np.clip(round(MNIST_SIZE / 2 - cy), 0, MNIST_SIZE - h))
  left = int(np.clip(round(MNIST_SIZE / 2 - cx), 0, MNIST_SIZE - w))
  out[top:top + h, left:left + w] = digit
  return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def _decode(path: Path) -> images_lib.Decoded:
  """One file decoded to a square: at ``DECODE_SIZE``, or at its own larger
  side when smaller (upsampling only blurs it: an MNIST image of 28x28 then
  comes back pixel for pixel)."""
  decoded = images_lib.decode_image(path, DECODE_SIZE, 'stretch')
  side = max(decoded.size)
  if side < DECODE_SIZE:
    decoded = images_lib.decode_image(path, side, 'stretch')
  return decoded


def read_digits(files: Sequence[str | os.PathLike],
                say: Callable[[str], None] | None = None
                ) -> tuple[np.ndarray, list[Path]]:
  """Image files as MNIST digits: uint8 [M, 28, 28, 1] and the M files
  read. Decoded as ``capsjax.data.images`` decodes training images
  (Pillow; EXIF rotation; transparency onto white; colour to grey by
  Pillow's 'L'); a file that cannot be decoded is told to ``say`` and
  skipped."""
  digits, kept = [], []
  for path in map(Path, files):
    try:
      decoded = _decode(path)
    except images_lib.DataError as e:
      if say:
        say(f'{e}; skipped.')
      continue
    grey = images_lib.to_grey(decoded.array[None])[0, ..., 0]
    digits.append(mnist_like(grey, decoded.size))
    kept.append(path)
  shape = (len(digits), MNIST_SIZE, MNIST_SIZE, 1)
  return np.reshape(np.asarray(digits, np.uint8), shape), kept


def predict_scores(model, info: dict[str, Any], images: np.ndarray
                   ) -> np.ndarray:
  """uint8 images [N, 28, 28, 1] -> float32 class scores [N, K] (capsule
  lengths, or EM activations), through the run's preprocessing."""
  context = evaluators.Context(
      model=model, config=ml_collections.ConfigDict(info['config']),
      workdir='', evaluate_split=None, eval_inputs=preprocess(info),
      load_dataset=None, write_files=False)
  return confusion.predict_scores(context, images)


# ----------------------------------------------------------------------------
# Command line.


def _parser() -> argparse.ArgumentParser:
  listing = '\n'.join(f'  {name}: {text}' for name, text in
                      available().items())
  parser = argparse.ArgumentParser(
      prog='python -m capsjax.pretrained',
      description='Classify image files with a model shipped with capsjax '
      '(no training). Prints PATH<TAB>CLASS<TAB>SCORE per image.',
      epilog=f'models:\n{listing}',
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('name', choices=sorted(MODELS), metavar='NAME',
                      help='the model (listed below)')
  parser.add_argument('images', nargs='+', metavar='IMAGES',
                      help='image files, or folders read recursively')
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """The command line; its exit status."""
  args = _parser().parse_args(argv)
  say = lambda line: print(line, file=sys.stderr)  # noqa: E731
  found = images_lib.find_image_files(args.images)
  for path in found.missing:
    say(f'{path}: no such file or folder; skipped.')
  digits, kept = read_digits(found.files, say)
  if not kept:
    say(f'{", ".join(args.images)}: no image could be read; nothing was '
        f'classified.')
    return 2
  model, info = load(args.name)
  scores = predict_scores(model, info, digits)
  lines = []
  for path, row in zip(kept, scores, strict=True):
    k = int(np.argmax(row))
    # A tab or newline in a file name would break the three columns.
    shown = os.fspath(path).replace('\t', '\\t').replace('\n', '\\n')
    lines.append(f'{shown}\t{info["classes"][k]}\t{row[k]:.4f}')
  return 0 if print_until_closed(lines) else CLOSED_PIPE_STATUS


# The exit status when the reader of stdout closed it (``| head -1``): that
# of a command ended by SIGPIPE, as a shell reports it.
CLOSED_PIPE_STATUS = 128 + 13


def print_until_closed(lines) -> bool:
  """Prints ``lines`` to stdout; False, quietly, if its reader closed it
  (``python -m capsjax.pretrained NAME DIR | head -1``).

  Stdout is then pointed at ``/dev/null``, so that Python's flush of it at
  exit does not fail again.
  """
  try:
    for line in lines:
      print(line)
    sys.stdout.flush()
  except BrokenPipeError:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return False
  return True


if __name__ == '__main__':
  from capsjax.kernels.conv import dispatch
  # XLA:CPU's Eigen convolutions, as training ran them (before JAX starts).
  dispatch.prefer_eigen_convolutions()
  sys.exit(main())
