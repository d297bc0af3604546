"""Plain PyTorch references of capsjax's models, for CPU speed comparisons.

    python -m experiments.benchmark --model=capsnet_mnist --compare=torch

Each reference has the architecture, the loss and the optimiser of the
capsjax model of the same name (same shapes, same FLOPs): it is what a
PyTorch user would write, not a port of capsjax's code. Only
``experiments.benchmark`` imports this module, and only with
``--compare=torch``; torch is the optional extra ``pip install -e
'.[bench]'``. The matrix-capsule (EM) models have no reference here.

Shape legend: B batch, I input capsules, J output capsules, D dimensions.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F


def squash(s: torch.Tensor, constant: float = 1.0, eps: float = 1e-7
           ) -> torch.Tensor:
  """|s|^2 / (constant + |s|^2) * s / |s| along the last axis."""
  norm2 = (s * s).sum(-1, keepdim=True)
  return norm2 / (constant + norm2) * s / torch.sqrt(norm2 + eps)


def dynamic_routing(u_hat: torch.Tensor, iterations: int, *,
                    accumulate: bool = True, squash_constant: float = 1.0,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
  """Sabour et al.'s routing: u_hat [B, I, J, D] -> v [B, J, D]."""
  logits = torch.zeros(u_hat.shape[:3], dtype=u_hat.dtype)
  for r in range(iterations):
    c = F.softmax(logits, dim=2)
    s = (c.unsqueeze(-1) * u_hat).sum(1)
    if bias is not None:
      s = s + bias
    v = squash(s, squash_constant)
    if r < iterations - 1:
      agreement = (u_hat * v.unsqueeze(1)).sum(-1)
      logits = logits + agreement if accumulate else agreement
  return v


class CapsNet(nn.Module):
  """Conv1 ReLU, PrimaryCaps (stride 2), DigitCaps (routing), decoder."""

  def __init__(self, *, input_shape: Sequence[int] = (28, 28, 1),
               num_classes: int = 10, conv1_channels: int = 256,
               primary_types: int = 32, primary_dim: int = 8,
               digit_dim: int = 16, num_iterations: int = 3,
               reconstruction: bool = True,
               decoder_widths: Sequence[int] = (512, 1024), **unused):
    super().__init__()
    height, width, channels = input_shape
    self.conv1 = nn.Conv2d(channels, conv1_channels, 9)
    self.primary = nn.Conv2d(conv1_channels, primary_types * primary_dim, 9,
                             stride=2)
    grid = ((height - 8 - 9) // 2 + 1) * ((width - 8 - 9) // 2 + 1)
    self.primary_dim, self.num_iterations = primary_dim, num_iterations
    num_primary = grid * primary_types
    self.weights = nn.Parameter(0.1 * torch.randn(
        num_primary, num_classes, digit_dim, primary_dim))
    self.bias = nn.Parameter(torch.full((num_classes, digit_dim), 0.1))
    self.decoder = None
    if reconstruction:
      sizes = (num_classes * digit_dim, *decoder_widths,
               height * width * channels)
      self.decoder = nn.ModuleList(
          [nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:], strict=True)])

  def forward(self, images: torch.Tensor, labels: torch.Tensor):
    x = F.relu(self.conv1(images))
    x = self.primary(x)  # [B, T*D, h, w]
    b = x.shape[0]
    x = x.view(b, -1, self.primary_dim, x.shape[2], x.shape[3])
    u = squash(x.permute(0, 1, 3, 4, 2).reshape(b, -1, self.primary_dim))
    u_hat = torch.einsum('bie,ijde->bijd', u, self.weights)
    v = dynamic_routing(u_hat, self.num_iterations, bias=self.bias)
    lengths = torch.sqrt((v * v).sum(-1) + 1e-7)
    out = {'lengths': lengths}
    if self.decoder is not None:
      mask = F.one_hot(labels, lengths.shape[-1]).to(v.dtype)
      h = (v * mask.unsqueeze(-1)).flatten(1)
      for i, layer in enumerate(self.decoder):
        h = layer(h)
        h = F.relu(h) if i < len(self.decoder) - 1 else torch.sigmoid(h)
      out['reconstructions'] = h
    return out


class BaselineCNN(nn.Module):
  """Three 5x5 ReLU convs, FC 328, FC 192, dropout, FC K logits."""

  def __init__(self, *, input_shape: Sequence[int] = (28, 28, 1),
               num_classes: int = 10,
               conv_channels: Sequence[int] = (256, 256, 128),
               kernel_size: int = 5, padding: str = 'SAME',
               fc_widths: Sequence[int] = (328, 192), **unused):
    super().__init__()
    height, width, channels = input_shape
    sizes = (channels, *conv_channels)
    pad = 'same' if padding == 'SAME' else 'valid'
    self.convs = nn.ModuleList([nn.Conv2d(a, b, kernel_size, padding=pad)
                                for a, b in zip(sizes[:-1], sizes[1:], strict=True)])
    if padding != 'SAME':
      height -= len(conv_channels) * (kernel_size - 1)
      width -= len(conv_channels) * (kernel_size - 1)
    widths = (height * width * conv_channels[-1], *fc_widths)
    self.hidden = nn.ModuleList([nn.Linear(a, b)
                                 for a, b in zip(widths[:-1], widths[1:], strict=True)])
    self.dropout = nn.Dropout(0.5)
    self.head = nn.Linear(fc_widths[-1], num_classes)

  def forward(self, images: torch.Tensor, labels: torch.Tensor):
    del labels
    x = images
    for conv in self.convs:
      x = F.relu(conv(x))
    x = x.flatten(1)
    for layer in self.hidden:
      x = F.relu(layer(x))
    return {'logits': self.head(self.dropout(x))}


class _SuTrunk(nn.Module):
  """Conv 3x3 ReLU x2, AvgPool 2x2, Conv 3x3 ReLU x2 (VALID)."""

  def __init__(self, in_channels: int, widths: Sequence[int]):
    super().__init__()
    sizes = (in_channels, *widths)
    self.convs = nn.ModuleList([nn.Conv2d(a, b, 3)
                                for a, b in zip(sizes[:-1], sizes[1:], strict=True)])

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    for i, conv in enumerate(self.convs):
      x = F.relu(conv(x))
      if i == 1:
        x = F.avg_pool2d(x, 2)
    return x


class TwoDigitBaseline(nn.Module):
  """Su's trunk, global average pool, Dense 128 ReLU, Dense K sigmoid."""

  def __init__(self, *, input_channels: int = 1, num_classes: int = 10,
               trunk_widths: Sequence[int] = (64, 64, 128, 128),
               hidden_width: int = 128, **unused):
    super().__init__()
    self.trunk = _SuTrunk(input_channels, trunk_widths)
    self.hidden = nn.Linear(trunk_widths[-1], hidden_width)
    self.head = nn.Linear(hidden_width, num_classes)

  def forward(self, images: torch.Tensor, labels: torch.Tensor):
    del labels
    x = self.trunk(images).mean((2, 3))
    return {'scores': torch.sigmoid(self.head(F.relu(self.hidden(x))))}


class TwoDigitCapsNet(nn.Module):
  """Su's trunk, every position a capsule, shared-weight capsules routed
  without accumulation (squash constant 0.5); score = length."""

  def __init__(self, *, input_channels: int = 1, num_classes: int = 10,
               trunk_widths: Sequence[int] = (64, 64, 128, 128),
               capsule_dim: int = 16, num_iterations: int = 3, **unused):
    super().__init__()
    self.trunk = _SuTrunk(input_channels, trunk_widths)
    self.weights = nn.Parameter(0.05 * torch.randn(
        num_classes, trunk_widths[-1], capsule_dim))
    self.num_iterations = num_iterations

  def forward(self, images: torch.Tensor, labels: torch.Tensor):
    del labels
    x = self.trunk(images)
    x = x.flatten(2).transpose(1, 2)  # [B, h*w, C]
    u_hat = torch.einsum('bic,jcd->bijd', x, self.weights)
    v = dynamic_routing(u_hat, self.num_iterations, accumulate=False,
                        squash_constant=0.5)
    return {'scores': torch.sqrt((v * v).sum(-1) + 1e-7)}


def _margin_loss(lengths, labels, negative_weight=0.5):
  one_hot = F.one_hot(labels, lengths.shape[-1]).to(lengths.dtype)
  return (one_hot * F.relu(0.9 - lengths) ** 2 + negative_weight * (
      1 - one_hot) * F.relu(lengths - 0.1) ** 2).sum(-1)


def loss(outputs: dict[str, torch.Tensor], images: torch.Tensor,
         labels: torch.Tensor, reconstruction_weight: float) -> torch.Tensor:
  """The loss capsjax's dynamic-routing family trains the same model with."""
  if 'logits' in outputs:
    return F.cross_entropy(outputs['logits'], labels)
  if 'lengths' in outputs:
    total = _margin_loss(outputs['lengths'], labels)
    if 'reconstructions' in outputs:
      error = ((outputs['reconstructions'] - images.flatten(1)) ** 2).sum(-1)
      total = total + reconstruction_weight * error
    return total.mean()
  return _margin_loss(outputs['scores'], labels, 0.25).mean()


MODELS: dict[str, Callable[..., nn.Module]] = {
    'capsnet': CapsNet,
    'baseline_cnn': BaselineCNN,
    'two_digit_baseline': TwoDigitBaseline,
    'two_digit_capsnet': TwoDigitCapsNet,
}


def train_step_fn(model_name: str, options: dict, batch_size: int,
                  image_shape: Sequence[int], num_classes: int,
                  learning_rate: float, reconstruction_weight: float,
                  num_threads: int, seed: int = 0) -> Callable[[], float]:
  """A callable doing one full train step (forward, backward, Adam) on a
  fixed random batch in float32 on the CPU; returns the loss."""
  if model_name not in MODELS:
    raise ValueError(f'no PyTorch reference of {model_name!r}; references: '
                     f'{", ".join(sorted(MODELS))}.')
  torch.set_num_threads(num_threads)
  torch.manual_seed(seed)
  height, width, channels = image_shape
  if model_name in ('capsnet', 'baseline_cnn'):
    options = options | {'input_shape': (height, width, channels)}
  model = MODELS[model_name](**options)
  model.train()
  optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
  images = torch.rand(batch_size, channels, height, width)
  labels = torch.randint(0, num_classes, (batch_size,))
  labels_images = images.permute(0, 2, 3, 1)  # reconstruction targets, HWC

  def step() -> float:
    optimizer.zero_grad(set_to_none=True)
    value = loss(model(images, labels), labels_images, labels,
                 reconstruction_weight)
    value.backward()
    optimizer.step()
    return float(value)

  return step
