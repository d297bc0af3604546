"""Figures of trained capsule networks: reconstructions, capsule dimensions, routing.

    model = training.load_trained_model(workdir)
    outputs = figures.model_outputs(model, images)  # images float [N, H, W, C]
    figures.reconstruction_grid(images, outputs['reconstructions'],
                                'reconstructions.png')
    figures.perturbation_grid(model, images[0], 'perturbation.png')
    figures.routing_figure(model, images[0], 'routing.png')

Shape legend: N images, H x W x C pixels, K classes, D the capsule dimension
(16 in the MNIST CapsNet), S perturbation offsets, I input capsules of the
routing shown (h x w grid positions times ``types`` capsule types).

The array functions (``perturbed_reconstructions``, ``capsnet_routing``,
``em_class_routing``) are plain model calls and return NumPy arrays. The
drawing functions build a ``matplotlib.figure.Figure`` directly rather than
through pyplot: it renders with Agg whatever the backend, works headless, and
no figure is left registered in pyplot's global state. Each returns the figure
and writes a PNG when given a path; in a notebook the returned figure displays
itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

# Sabour et al. 2017, Section 5.1: each dimension tweaked "by intervals of
# 0.05 in the range [-0.25, 0.25]". Rounded so that the middle offset is an
# exact +0 (np.arange(-0.25, 0.2501, 0.05) leaves 2.8e-17 there).
PERTURBATION_STEPS = np.round(np.linspace(-0.25, 0.25, 11), 6) + 0.0

# Titles for datasets whose labels are not their own names.
CLASS_NAMES: dict[str, tuple[str, ...]] = {
    'fashion_mnist': ('T-shirt', 'trouser', 'pullover', 'dress', 'coat',
                      'sandal', 'shirt', 'sneaker', 'bag', 'boot'),
    'smallnorb': ('animal', 'human', 'airplane', 'truck', 'car'),
}

_HEATMAP_CMAP = 'viridis'
_HIGHLIGHT = 'tab:red'


# ----------------------------------------------------------------------------
# Arrays. The model calls are jitted: eager, op by op, they take seconds.


@nnx.jit
def _outputs(model: nnx.Module, x: jax.Array) -> dict[str, jax.Array]:
  return model(x, train=False)


def model_outputs(model: nnx.Module, images: ArrayLike) -> dict[str, np.ndarray]:
  """The model's test-time outputs (NumPy) for [N, H, W, C] images, jitted.

  uint8 images are scaled to [0, 1] first, as the trainers do.
  """
  images = jnp.asarray(_as_float_images(images))
  return jax.tree.map(np.asarray, _outputs(model, images))


@nnx.jit
def _capsnet_forward(model: nnx.Module, x: jax.Array) -> dict[str, jax.Array]:
  out = model(x, train=False)
  out['mask'] = model.decoder_mask(out['class_scores'], None, False)
  return out


@nnx.jit
def _decode(model: nnx.Module, masked: jax.Array) -> jax.Array:
  return jax.nn.sigmoid(model.decoder(masked))


def _as_float_images(images: ArrayLike) -> np.ndarray:
  """uint8 images -> float32 in [0, 1]; float images unchanged."""
  images = np.asarray(images)
  if np.issubdtype(images.dtype, np.integer):
    return images.astype(np.float32) / 255.0
  return images.astype(np.float32)


def _check_image(image: ArrayLike) -> np.ndarray:
  image = _as_float_images(image)
  if image.ndim != 3:
    raise ValueError(f'image must be [H, W, C], got shape {image.shape}.')
  return image


def _capsnet_parts(model: nnx.Module) -> None:
  for name in ('conv1', 'primary', 'digit', 'decoder_mask', 'input_shape'):
    if not hasattr(model, name):
      raise ValueError(
          f'expected a CapsNet (create_model("capsnet")), got '
          f'{type(model).__name__} without .{name}.')


def perturbed_reconstructions(model: nnx.Module, image: ArrayLike,
                              steps: ArrayLike = PERTURBATION_STEPS
                              ) -> np.ndarray:
  """Decodes the winning capsule with each dimension tweaked (Sabour Fig. 4).

  The image goes through the CapsNet; the decoder sees only the longest
  capsule (``model.decoder_mask`` at test time), with ``steps[s]`` added to its
  dimension ``d``.

  Args:
    model: a CapsNet with a decoder.
    image: [H, W, C], float in [0, 1] or uint8.
    steps: [S] offsets.
  Returns:
    [D, S, H, W, C] float32 reconstructions; at an offset of 0 every row is the
    model's own reconstruction of ``image``.
  """
  _capsnet_parts(model)
  if getattr(model, 'decoder', None) is None:
    raise ValueError('the CapsNet has no decoder (reconstruction=False): '
                     'nothing to perturb.')
  image = _check_image(image)
  steps = np.asarray(steps, np.float32)
  if steps.ndim != 1:
    raise ValueError(f'steps must be [S], got shape {steps.shape}.')
  out = _capsnet_forward(model, jnp.asarray(image[None]))
  capsules = np.asarray(out['capsules'][0])  # [K, D]
  mask = np.asarray(out['mask'][0])  # [K]
  num_classes, dim = capsules.shape
  winner = int(np.argmax(mask))
  base = capsules * mask[:, None]
  # delta[d, s, k, e] = steps[s] if (k, e) == (winner, d) else 0.
  delta = np.zeros((dim, steps.size, num_classes, dim), np.float32)
  delta[np.arange(dim), :, winner, np.arange(dim)] = steps
  perturbed = (base[None, None] + delta).reshape(dim * steps.size, -1)
  pixels = _decode(model, jnp.asarray(perturbed))
  return np.asarray(pixels).reshape((dim, steps.size) + image.shape)


def capsnet_routing(model: nnx.Module, image: ArrayLike) -> dict[str, Any]:
  """The DigitCaps coupling coefficients of one image, with their context.

  Args:
    model: a CapsNet.
    image: [H, W, C], float in [0, 1] or uint8.
  Returns:
    {'coupling': [I, K], 'primary_lengths': [I] (the lengths of the primary
    capsules, which scale their votes), 'grid': (h, w, types) with
    I = h * w * types in that order, 'scores': [K] capsule lengths,
    'prediction': int}; NumPy arrays.
  """
  _capsnet_parts(model)
  image = _check_image(image)
  out = _capsnet_forward(model, jnp.asarray(image[None]))
  height, width = model.input_shape[:2]
  conv = model.primary.conv
  grid = (conv.output_size(model.conv1.output_size(height)),
          conv.output_size(model.conv1.output_size(width)),
          model.primary.num_types)
  coupling = np.asarray(out['coupling'][0])
  if coupling.shape[0] != int(np.prod(grid)):
    raise ValueError(f'coupling {coupling.shape} does not match the primary '
                     f'capsule grid {grid}.')
  scores = np.asarray(out['class_scores'][0])
  return {'coupling': coupling,
          'primary_lengths': np.asarray(out['primary_lengths'][0]),
          'grid': grid, 'scores': scores, 'prediction': int(np.argmax(scores))}


def em_class_routing(model: nnx.Module, image: ArrayLike) -> dict[str, Any]:
  """The class-layer EM assignments of one image (matrix capsules).

  One call of the model itself, which returns its class layer's
  assignments and input activations beside the class activations.

  Args:
    model: a MatrixCapsNet.
    image: [H, W, C] preprocessed as the model was trained (float).
  Returns:
    {'assignments': [I, K] (each input's split over the classes),
    'input_activations': [I], 'grid': (h, w, types) of the ConvCaps2 output,
    I = h * w * types in that order, 'scores': [K] class activations,
    'prediction': int}; NumPy arrays.
  """
  for name in ('conv1', 'primary', 'caps1', 'caps2', 'class_caps'):
    if not hasattr(model, name):
      raise ValueError(
          f'expected a MatrixCapsNet (create_model("matrix_capsnet")), got '
          f'{type(model).__name__} without .{name}.')
  image = np.asarray(image, np.float32)
  if image.ndim != 3:
    raise ValueError(f'image must be [H, W, C], got shape {image.shape}.')
  out = _outputs(model, jnp.asarray(image[None]))
  scores = np.asarray(out['class_scores'][0])
  rows, cols = (sizes[-1] for sizes in model.grid_sizes)
  return {'assignments': np.asarray(out['assignments'][0]),
          'input_activations': np.asarray(out['class_input_activations'][0]),
          'grid': (rows, cols, model.class_caps.weights.shape[0]),
          'scores': scores, 'prediction': int(np.argmax(scores))}


# ----------------------------------------------------------------------------
# Drawing.


def _figure(width: float, height: float):
  from matplotlib.figure import Figure
  return Figure(figsize=(width, height), dpi=100)


def _save(fig, path: str | os.PathLike | None):
  if path is not None:
    directory = os.path.dirname(os.fspath(path))
    if directory:
      os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=fig.dpi, facecolor='white', bbox_inches='tight',
                pad_inches=0.1)
  return fig


def _show_image(ax, image: np.ndarray, **kwargs) -> None:
  """[H, W, C] on ``ax``: grey for 1 channel, RGB for 3, else side by side."""
  channels = image.shape[-1]
  if channels == 3:
    ax.imshow(np.clip(image, 0.0, 1.0), **kwargs)
  else:
    # Stereo pairs (smallNORB) and other channel counts: channels side by side.
    flat = np.concatenate([image[..., c] for c in range(channels)], axis=1)
    in_unit = flat.min() >= 0.0 and flat.max() <= 1.0
    ax.imshow(flat, cmap='gray', vmin=0.0 if in_unit else None,
              vmax=1.0 if in_unit else None, **kwargs)
  ax.set_xticks([])
  ax.set_yticks([])


def _class_name(k: int, class_names: Sequence[str] | None) -> str:
  return str(k) if class_names is None else str(class_names[k])


def reconstruction_grid(images: ArrayLike, reconstructions: ArrayLike,
                        path: str | os.PathLike | None = None, *,
                        labels: ArrayLike | None = None,
                        predictions: ArrayLike | None = None,
                        class_names: Sequence[str] | None = None):
  """Inputs on the top row, reconstructions below (Sabour et al. Fig. 3).

  Args:
    images: [N, H, W, C], float in [0, 1] or uint8.
    reconstructions: [N, H, W, C] or the decoder's flat [N, H*W*C].
    path: where to write the PNG (None: do not write).
    labels, predictions: optional int [N]; shown as column titles, a wrong
      prediction in red.
  Returns:
    The figure.
  """
  images = _as_float_images(images)
  if images.ndim != 4:
    raise ValueError(f'images must be [N, H, W, C], got shape {images.shape}.')
  reconstructions = np.asarray(reconstructions, np.float32)
  if reconstructions.size != images.size:
    raise ValueError(
        f'reconstructions {reconstructions.shape} do not match images '
        f'{images.shape}.')
  reconstructions = reconstructions.reshape(images.shape)
  n = images.shape[0]
  panel = 1.3 * max(1.0, images.shape[2] * images.shape[3] / images.shape[1])
  fig = _figure(max(2.5, panel * n), 2 * 1.3 + 0.6)
  axes = fig.subplots(2, n, squeeze=False)
  for i in range(n):
    _show_image(axes[0, i], images[i])
    _show_image(axes[1, i], reconstructions[i])
    if labels is not None:
      axes[0, i].set_title(f'label {_class_name(int(labels[i]), class_names)}',
                           fontsize=8)
    if predictions is not None:
      pred = int(predictions[i])
      wrong = labels is not None and pred != int(labels[i])
      axes[1, i].set_title(f'pred {_class_name(pred, class_names)}', fontsize=8,
                           color=_HIGHLIGHT if wrong else 'black')
  axes[0, 0].set_ylabel('input', fontsize=9)
  axes[1, 0].set_ylabel('reconstruction', fontsize=9)
  fig.subplots_adjust(left=0.06, right=0.99, bottom=0.02, top=0.88,
                      wspace=0.08, hspace=0.25)
  return _save(fig, path)


def _mosaic(tiles: np.ndarray, pad: int = 1, fill: float = 1.0) -> np.ndarray:
  """[R, S, H, W, C] -> one [R*(H+pad)-pad, S*(W+pad)-pad, C] image."""
  rows, cols, height, width, channels = tiles.shape
  out = np.full((rows * (height + pad) - pad, cols * (width + pad) - pad,
                 channels), fill, np.float32)
  for r in range(rows):
    for s in range(cols):
      top, left = r * (height + pad), s * (width + pad)
      out[top:top + height, left:left + width] = tiles[r, s]
  return out


def perturbation_grid(model: nnx.Module, image: ArrayLike,
                      path: str | os.PathLike | None = None,
                      steps: ArrayLike = PERTURBATION_STEPS, *,
                      class_names: Sequence[str] | None = None):
  """One row per capsule dimension, one column per offset (Sabour Fig. 4).

  Args:
    model: a CapsNet with a decoder.
    image: [H, W, C], float in [0, 1] or uint8.
    path: where to write the PNG (None: do not write).
    steps: [S] offsets added to each dimension of the winning capsule.
  Returns:
    The figure; ``perturbed_reconstructions`` gives the arrays.
  """
  steps = np.asarray(steps, np.float32)
  tiles = perturbed_reconstructions(model, image, steps)  # [D, S, H, W, C]
  dim, num_steps, height, width, channels = tiles.shape
  if channels not in (1, 3):
    tiles = np.concatenate([tiles[..., c:c + 1] for c in range(channels)],
                           axis=3)
    width, channels = width * channels, 1
  mosaic = _mosaic(tiles, pad=max(1, height // 14))
  out = _capsnet_forward(model, jnp.asarray(_check_image(image)[None]))
  winner = int(np.argmax(out['mask'][0]))
  scale = 0.018  # inches per pixel: a 28x28 digit is 50 pixels wide at dpi 100
  fig = _figure(0.8 + scale * mosaic.shape[1], 0.9 + scale * mosaic.shape[0])
  ax = fig.add_axes((0.1, 0.02, 0.88, 0.9))
  if channels == 3:
    ax.imshow(np.clip(mosaic, 0.0, 1.0))
  else:
    ax.imshow(mosaic[..., 0], cmap='gray', vmin=0.0, vmax=1.0)
  pad = max(1, height // 14)
  ax.set_xticks([s * (width + pad) + width / 2 for s in range(num_steps)])
  ax.set_xticklabels([f'{s:+.2f}' for s in steps], fontsize=7, rotation=90)
  ax.xaxis.tick_top()
  ax.set_yticks([d * (height + pad) + height / 2 for d in range(dim)])
  ax.set_yticklabels([str(d) for d in range(dim)], fontsize=7)
  ax.set_ylabel('capsule dimension')
  ax.tick_params(length=0)
  for spine in ax.spines.values():
    spine.set_visible(False)
  fig.suptitle(f'class {_class_name(winner, class_names)}: one dimension '
               'of its capsule offset per row', fontsize=9, y=0.995)
  return _save(fig, path)


def _class_heatmaps(image: np.ndarray, maps: np.ndarray, path, *, title: str,
                    colorbar_label: str, prediction: int | None,
                    scores: np.ndarray | None, score_name: str,
                    class_names: Sequence[str] | None):
  """The input, then one [h, w] heatmap per class on a shared colour scale."""
  num_classes = maps.shape[-1]
  cols = min(num_classes + 1, 6)
  rows = -(-(num_classes + 1) // cols)
  fig = _figure(1.9 * cols + 0.8, 1.95 * rows + 0.5)
  axes = fig.subplots(rows, cols, squeeze=False).ravel()
  _show_image(axes[0], image)
  axes[0].set_title('input', fontsize=9)
  # One colour scale for every class, stretched over the values present: the
  # differences between classes are small next to the values themselves.
  vmin, vmax = float(maps.min()), float(maps.max())
  if vmax <= vmin:
    vmax = vmin + 1e-6
  last = None
  for k in range(num_classes):
    ax = axes[k + 1]
    last = ax.imshow(maps[..., k], cmap=_HEATMAP_CMAP, vmin=vmin, vmax=vmax)
    ax.set_xticks([])
    ax.set_yticks([])
    label = _class_name(k, class_names)
    if scores is not None:
      label += f'  {score_name}={scores[k]:.2f}'
    predicted = prediction is not None and k == prediction
    ax.set_title(label + ('  (pred)' if predicted else ''), fontsize=8,
                 color=_HIGHLIGHT if predicted else 'black',
                 fontweight='bold' if predicted else 'normal')
    if predicted:
      for spine in ax.spines.values():
        spine.set_edgecolor(_HIGHLIGHT)
        spine.set_linewidth(2.5)
  for ax in axes[num_classes + 1:]:
    ax.axis('off')
  fig.subplots_adjust(left=0.02, right=0.88, bottom=0.03, top=0.86,
                      wspace=0.15, hspace=0.3)
  cax = fig.add_axes((0.9, 0.1, 0.015, 0.7))
  fig.colorbar(last, cax=cax).set_label(colorbar_label, fontsize=8)
  fig.suptitle(title, fontsize=9)
  return _save(fig, path)


def _grid_maps(values: np.ndarray, grid: Sequence[int],
               weights: ArrayLike | None, name: str) -> np.ndarray:
  """[I, K] (or [h, w, types, K]) -> [h, w, K]: weighted mean over types."""
  grid = tuple(int(g) for g in grid)
  if len(grid) != 3:
    raise ValueError(f'grid must be (h, w, types), got {grid!r}.')
  values = np.asarray(values, np.float32)
  num_in = int(np.prod(grid))
  if values.ndim == 4:
    values = values.reshape(-1, values.shape[-1])
  if values.ndim != 2 or values.shape[0] != num_in:
    raise ValueError(f'{name} must be [h*w*types, K] = [{num_in}, K] for grid '
                     f'{grid}, got shape {values.shape}.')
  values = values.reshape(grid + (values.shape[-1],))
  if weights is None:
    return values.mean(axis=2)
  weights = np.asarray(weights, np.float32)
  if weights.size != num_in:
    raise ValueError(f'weights must have {num_in} entries (one per input '
                     f'capsule), got shape {weights.shape}.')
  return (values * weights.reshape(grid + (1,))).mean(axis=2)


def coupling_figure(image: ArrayLike, coupling: ArrayLike, grid: Sequence[int],
                    path: str | os.PathLike | None = None, *,
                    lengths: ArrayLike | None = None,
                    prediction: int | None = None,
                    scores: ArrayLike | None = None,
                    class_names: Sequence[str] | None = None):
  """Where the primary capsules send their votes under dynamic routing.

  For each class k a heatmap over the primary capsule grid of c_ik averaged
  over the capsule types, each c_ik weighted by the length of capsule i when
  ``lengths`` are given (a short capsule contributes little whatever its
  coupling). ``capsnet_routing`` gives every argument but the image.

  Args:
    image: [H, W, C] input.
    coupling: [I, K] coupling coefficients, I = h * w * types ordered (row,
      column, type) as the primary capsules.
    grid: (h, w, types).
    path: where to write the PNG (None: do not write).
    lengths: optional [I] primary capsule lengths.
    prediction: optional predicted class (highlighted).
    scores: optional [K] class capsule lengths, shown in the titles.
  Returns:
    The figure.
  """
  image = _check_image(image)
  maps = _grid_maps(coupling, grid, lengths, 'coupling')
  if lengths is None:
    title, unit = 'coupling c_ik, mean over capsule types', 'mean c_ik'
  else:
    title = ('coupling c_ik weighted by primary capsule length |u_i|, mean '
             'over capsule types')
    unit = 'mean |u_i| c_ik'
  return _class_heatmaps(
      image, maps, path, title=title, colorbar_label=unit,
      prediction=prediction,
      scores=None if scores is None else np.asarray(scores),
      score_name='|v|', class_names=class_names)


def assignment_figure(image: ArrayLike, assignments: ArrayLike,
                      path: str | os.PathLike | None = None, *,
                      grid: Sequence[int] | None = None,
                      activations: ArrayLike | None = None,
                      prediction: int | None = None,
                      scores: ArrayLike | None = None,
                      class_names: Sequence[str] | None = None):
  """Class-layer EM routing: how each position's capsules split over classes.

  For each class k a heatmap over the ConvCaps2 grid of the assignment R_ik
  averaged over the capsule types, each weighted by the activation a_i of
  its input capsule when ``activations`` are given (the mass EM routing
  actually moves is R_ik a_i). ``em_class_routing`` gives every argument but
  the image.

  Args:
    image: [H, W, C] input.
    assignments: [h, w, types, K], or [I, K] with ``grid`` = (h, w, types),
      inputs ordered (row, column, type) as
      ``matrix_capsules.class_capsule_routing`` returns them.
    path: where to write the PNG (None: do not write).
    activations: optional [I] (or [h, w, types]) input capsule activations.
    prediction: optional predicted class (highlighted).
    scores: optional [K] class activations, shown in the titles.
  Returns:
    The figure.
  """
  image = np.asarray(image, np.float32)
  if image.ndim != 3:
    raise ValueError(f'image must be [H, W, C], got shape {image.shape}.')
  assignments = np.asarray(assignments, np.float32)
  if grid is None:
    if assignments.ndim != 4:
      raise ValueError(
          f'assignments must be [h, w, types, K], or [I, K] with grid=(h, w, '
          f'types), got shape {assignments.shape}.')
    grid = assignments.shape[:3]
  maps = _grid_maps(assignments, grid, activations, 'assignments')
  if activations is None:
    title, unit = 'EM assignments R_ik, mean over capsule types', 'mean R_ik'
  else:
    title = ('EM assignments R_ik weighted by input activation a_i, mean over '
             'capsule types')
    unit = 'mean a_i R_ik'
  return _class_heatmaps(
      image, maps, path, title=title, colorbar_label=unit,
      prediction=prediction,
      scores=None if scores is None else np.asarray(scores), score_name='a',
      class_names=class_names)


def routing_figure(model: nnx.Module, image: ArrayLike,
                   path: str | os.PathLike | None = None, *,
                   class_names: Sequence[str] | None = None):
  """Routing of one input: couplings (CapsNet) or class assignments (EM).

  Args:
    model: a CapsNet or a MatrixCapsNet.
    image: [H, W, C] model input (float).
  Returns:
    The figure of ``coupling_figure`` or ``assignment_figure``.
  """
  if hasattr(model, 'class_caps'):
    info = em_class_routing(model, image)
    return assignment_figure(
        image, info['assignments'], path, grid=info['grid'],
        activations=info['input_activations'], prediction=info['prediction'],
        scores=info['scores'], class_names=class_names)
  if hasattr(model, 'digit') and hasattr(model, 'primary'):
    info = capsnet_routing(model, image)
    return coupling_figure(
        image, info['coupling'], info['grid'], path,
        lengths=info['primary_lengths'], prediction=info['prediction'],
        scores=info['scores'], class_names=class_names)
  raise ValueError(
      f'{type(model).__name__} has no routing to draw: expected a CapsNet '
      f'(coupling coefficients) or a MatrixCapsNet (EM assignments).')


def pair_predictions_figure(images: ArrayLike, labels: ArrayLike,
                            scores: dict[str, ArrayLike],
                            path: str | os.PathLike | None = None, *,
                            threshold: float = 0.5, columns: int = 4,
                            class_names: Sequence[str] | None = None,
                            blank: ArrayLike | None = None, field: int = 14,
                            stride: int = 2):
  """Two-digit inputs with each model's two highest scores (Su's capsule post).

  Under each image, one line per model: its two top classes and their
  scores, green when they are the two true classes and both above
  ``threshold``, orange when only the classes are right, red otherwise.
  With ``blank`` (``data.blank_fields``), a red dot marks the centre of each
  ``field`` x ``field`` window (at ``stride``) that holds no ink.

  Args:
    images: [N, H, W, C] inputs in [0, 1] (56x28 or 28x56 pairs).
    labels: int [N, 2], the true classes.
    scores: model name -> [N, K] class scores.
    blank: optional bool [N, h, w], the blank windows.
  """
  images = _as_float_images(images)
  labels = np.asarray(labels)
  if images.ndim != 4 or labels.shape != (len(images), 2):
    raise ValueError(f'images must be [N, H, W, C] and labels [N, 2], got '
                     f'shapes {images.shape} and {labels.shape}.')
  if blank is not None:
    blank = np.asarray(blank, bool)
    if blank.ndim != 3 or len(blank) != len(images):
      raise ValueError(f'blank must be [{len(images)}, h, w], got shape '
                       f'{blank.shape}.')
  scores = {name: np.asarray(s) for name, s in scores.items()}
  for name, s in scores.items():
    if s.ndim != 2 or len(s) != len(images):
      raise ValueError(f'scores of {name!r} must be [{len(images)}, K], got '
                       f'shape {s.shape}.')
  columns = max(1, min(columns, len(images)))
  rows = -(-len(images) // columns)
  # Inches per row: the image at its aspect (stacked pairs are twice as
  # high as wide), and below it the title of the next row and a score line
  # per model, which are placed in points so that they never reach the
  # next row whatever the panel's height.
  panel = 1.5 * max(images.shape[1] / images.shape[2], 0.5)
  text_height = 0.4 + 0.17 * len(scores)
  fig = _figure(3.2 * columns, (panel + text_height) * rows)
  axes = fig.subplots(rows, columns, squeeze=False,
                      gridspec_kw={'hspace': text_height / panel})
  for ax in axes.flat[len(images):]:
    ax.axis('off')
  for n, ax in enumerate(axes.flat[:len(images)]):
    _show_image(ax, images[n])
    truth = sorted(int(k) for k in labels[n])
    title = 'true ' + ', '.join(_class_name(k, class_names) for k in truth)
    if blank is not None:
      rows_, cols_ = np.nonzero(blank[n])
      centre = (field - 1) / 2
      ax.plot(cols_ * stride + centre, rows_ * stride + centre, '.',
              color=_HIGHLIGHT, markersize=4)
      title += f'; {len(rows_)} blank'
    ax.set_title(title, fontsize=9)
    for line, (name, s) in enumerate(scores.items()):
      top = np.argsort(-s[n], kind='stable')[:2]
      right = sorted(top.tolist()) == truth
      colour = ('tab:green' if right and s[n, top[1]] > threshold else
                'tab:orange' if right else _HIGHLIGHT)
      text = ', '.join(f'{_class_name(int(k), class_names)} ({s[n, k]:.2f})'
                       for k in top)
      ax.annotate(f'{name}: {text}', (0.5, 0.0), xycoords='axes fraction',
                  xytext=(0, -3 - 11 * line), textcoords='offset points',
                  color=colour, fontsize=8, ha='center', va='top')
  return _save(fig, path)


def attack_accuracy_figure(epsilons: Sequence[float],
                           accuracies: dict[str, dict[str, Sequence[float]]],
                           path: str | os.PathLike | None = None, *,
                           title: str | None = None):
  """Accuracy against the attack budget, one panel per attack, a line per model.

  Args:
    epsilons: [E] L-infinity budgets.
    accuracies: attack name -> model name -> [E] accuracies in [0, 1].
  """
  epsilons = np.asarray(epsilons, np.float64)
  if not accuracies:
    raise ValueError('accuracies holds no attack.')
  for attack, rows in accuracies.items():
    for model, values in rows.items():
      if np.shape(values) != epsilons.shape:
        raise ValueError(f'{attack}/{model}: {np.shape(values)} accuracies for '
                         f'{len(epsilons)} epsilons.')
  fig = _figure(4.2 * len(accuracies), 3.6)
  axes = fig.subplots(1, len(accuracies), squeeze=False)[0]
  for ax, (attack, rows) in zip(axes, accuracies.items(), strict=True):
    for model, values in rows.items():
      ax.plot(epsilons, 100 * np.asarray(values), marker='o', label=model)
    ax.set_title(attack.upper())
    ax.set_xlabel('epsilon (pixels in [0, 1])')
    ax.set_ylabel('test accuracy (%)')
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  if title:
    fig.suptitle(title, fontsize=9)
  return _save(fig, path)


def two_colour(reconstructions: ArrayLike) -> np.ndarray:
  """[N, 2, S, S] -> RGB [N, S, S, 3]: the first digit red, the second green
  (where they overlap: yellow)."""
  r = np.asarray(reconstructions, np.float32)
  return np.clip(np.stack([r[:, 0], r[:, 1], np.zeros_like(r[:, 0])], -1),
                 0.0, 1.0)


def multimnist_figure(images: ArrayLike, reconstructions: ArrayLike,
                      labels: ArrayLike, predictions: ArrayLike,
                      path: str | os.PathLike | None = None):
  """Inputs above their two reconstructions in two colours (paper Fig. 5).

  Args:
    images: [N, S, S, 1] float in [0, 1].
    reconstructions: [N, 2, S*S] (or [N, 2, S, S]): the digits of
      ``predictions[:, 0]`` (red) and ``predictions[:, 1]`` (green).
    labels, predictions: int [N, 2]; titles "L:(a,b)" and "R:(a,b)", the
      latter highlighted when the pair is not the true pair.
    path: PNG to write (None: do not write).
  Returns:
    The matplotlib figure.
  """
  images = np.asarray(images, np.float32)
  if images.ndim != 4 or images.shape[-1] != 1:
    raise ValueError(f'images must be [N, S, S, 1], got {images.shape}.')
  n, size = images.shape[0], images.shape[1]
  reconstructions = np.asarray(reconstructions, np.float32)
  if reconstructions.size != n * 2 * size * size:
    raise ValueError(f'reconstructions {reconstructions.shape} are not two '
                     f'{size}x{size} digits for each of {n} images.')
  colour = two_colour(reconstructions.reshape(n, 2, size, size))
  labels, predictions = np.asarray(labels), np.asarray(predictions)
  fig = _figure(max(2.5, 1.3 * n), 3.2)
  axes = fig.subplots(2, n, squeeze=False)
  for i in range(n):
    axes[0, i].imshow(images[i, ..., 0], cmap='gray', vmin=0.0, vmax=1.0)
    axes[1, i].imshow(colour[i])
    wrong = set(predictions[i].tolist()) != set(labels[i].tolist())
    axes[0, i].set_title('L:({},{})'.format(*labels[i]), fontsize=8)
    axes[1, i].set_title('R:({},{})'.format(*predictions[i]), fontsize=8,
                         color='tab:red' if wrong else 'black')
    for ax in axes[:, i]:
      ax.set_xticks([])
      ax.set_yticks([])
  axes[0, 0].set_ylabel('input', fontsize=9)
  axes[1, 0].set_ylabel('red, green', fontsize=9)
  fig.subplots_adjust(left=0.06, right=0.99, bottom=0.02, top=0.88,
                      wspace=0.08, hspace=0.3)
  return _save(fig, path)


def affnist_figure(images: ArrayLike, labels: ArrayLike,
                   predictions: dict[str, ArrayLike],
                   path: str | os.PathLike | None = None):
  """Transformed test digits, titled with each model's prediction.

  Args:
    images: [N, 40, 40, 1] uint8 or float in [0, 1].
    labels: int [N].
    predictions: model name -> int [N]; a wrong prediction in red.
  """
  images = np.asarray(images)
  if np.issubdtype(images.dtype, np.integer):
    images = images.astype(np.float32) / 255.0
  n = images.shape[0]
  fig = _figure(max(2.5, 1.3 * n), 1.9 + 0.3 * len(predictions))
  axes = fig.subplots(1, n, squeeze=False)[0]
  for i, ax in enumerate(axes):
    ax.imshow(images[i, ..., 0], cmap='gray', vmin=0.0, vmax=1.0)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(f'label {int(labels[i])}', fontsize=8)
    lines = []
    for name, pred in predictions.items():
      pred = int(np.asarray(pred)[i])
      lines.append((f'{name}: {pred}', pred != int(labels[i])))
    for j, (text, wrong) in enumerate(lines):
      ax.text(0.5, -0.08 - 0.16 * j, text, transform=ax.transAxes,
              ha='center', va='top', fontsize=7,
              color='tab:red' if wrong else 'black')
  return _save(fig, path)


def confusion_figure(confusion: ArrayLike, class_names: Sequence[str],
                     path: str | os.PathLike | None = None, *,
                     title: str = ''):
  """A confusion matrix as a heat map: rows the true classes, columns the
  predicted ones, each row as fractions of its class (the counts written
  in the cells when there are at most 20 classes).

  Args:
    confusion: int [K, K] counts.
    class_names: K names (the axes' labels).
    path: PNG to write (None: do not write).
  Returns:
    The matplotlib figure.
  """
  confusion = np.asarray(confusion)
  k = len(class_names)
  if confusion.shape != (k, k):
    raise ValueError(f'confusion must be [{k}, {k}] for {k} class names, got '
                     f'{confusion.shape}.')
  rows = confusion.sum(axis=1, keepdims=True)
  fractions = confusion / np.maximum(rows, 1)
  side = min(1.2 + 0.45 * k, 16)
  fig = _figure(side + 1.2, side)
  ax = fig.subplots()
  shown = ax.imshow(fractions, cmap='Blues', vmin=0.0, vmax=1.0)
  fig.colorbar(shown, ax=ax, fraction=0.046, label='fraction of the true class')
  ticks = np.arange(k)
  ax.set_xticks(ticks, [str(n) for n in class_names], rotation=60,
                ha='right', fontsize=7)
  ax.set_yticks(ticks, [str(n) for n in class_names], fontsize=7)
  ax.set_xlabel('predicted')
  ax.set_ylabel('true')
  if k <= 20:
    for (i, j), count in np.ndenumerate(confusion):
      ax.text(j, i, str(count), ha='center', va='center', fontsize=6,
              color='white' if fractions[i, j] > 0.5 else 'black')
  if title:
    ax.set_title(title, fontsize=9)
  return _save(fig, path)


__all__ = (
    'CLASS_NAMES',
    'PERTURBATION_STEPS',
    'affnist_figure',
    'assignment_figure',
    'attack_accuracy_figure',
    'capsnet_routing',
    'confusion_figure',
    'coupling_figure',
    'em_class_routing',
    'model_outputs',
    'multimnist_figure',
    'pair_predictions_figure',
    'perturbation_grid',
    'perturbed_reconstructions',
    'reconstruction_grid',
    'routing_figure',
    'two_colour',
)
