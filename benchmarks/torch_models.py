"""Plain PyTorch references of capsjax's models, for speed comparisons.

    python -m experiments.benchmark --model=capsnet_mnist --compare=torch

Each reference has the architecture, the loss and the optimiser of the
capsjax model of the same name (same shapes, same FLOPs): it is what a
PyTorch user would write, not a port of capsjax's code. Only
``benchmarks.harness`` imports this module, and only with
``--compare=torch``; torch is the optional extra ``pip install -e
'.[bench]'``. ``train_step_fn`` runs a reference on the CPU or a CUDA GPU
in one of PyTorch's modes (``TORCH_MODES``): eager or ``torch.compile``d
forward and backward, float32 or under bfloat16 autocast (mixed
precision: float32 parameters and Adam, the loss in float32). The
matrix-capsule reference covers the routing options the shipped EM configs
use (the paper's activation, within-window E-step); other options raise
rather than time a different model.

Shape legend: B batch, I input capsules, J (or O) output capsules, D
dimensions.
"""

from __future__ import annotations

import math
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
  logits = torch.zeros(u_hat.shape[:3], dtype=u_hat.dtype, device=u_hat.device)
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


def em_routing(votes: torch.Tensor, activations: torch.Tensor,
               beta_u: torch.Tensor, beta_a: torch.Tensor,
               inverse_temperatures: Sequence[float], *,
               normalize_cost: bool, variance_floor: float = 1e-4
               ) -> tuple[torch.Tensor, torch.Tensor]:
  """Hinton et al.'s EM routing: votes [N, I, O, D], activations [N, I] ->
  (poses [N, O, D], activations [N, O]); one iteration per lambda."""
  num_out, dim = votes.shape[2], votes.shape[3]
  log_r = votes.new_full(votes.shape[:3], -math.log(num_out))
  for t, lam in enumerate(inverse_temperatures):
    weights = log_r.exp() * activations.unsqueeze(-1)  # [N, I, O]
    mass = weights.sum(1)  # [N, O]
    weights = (weights / (mass.unsqueeze(1) + 1e-6)).unsqueeze(-1)
    mu = (weights * votes).sum(1)  # [N, O, D]
    sq = (votes - mu.unsqueeze(1)) ** 2
    log_var = torch.log((weights * sq).sum(1) + variance_floor)
    cost = (dim * beta_u + 0.5 * log_var.sum(-1)) * mass
    if normalize_cost:
      mean = cost.mean(-1, keepdim=True)
      std = torch.sqrt(((cost - mean) ** 2).mean(-1, keepdim=True) + 1e-12)
      cost = (cost - mean) / std
    logits = lam * (beta_a - cost)
    if t < len(inverse_temperatures) - 1:
      log_p = -0.5 * ((sq * torch.exp(-log_var).unsqueeze(1)).sum(-1)
                      + (log_var + math.log(2 * math.pi)).sum(-1).unsqueeze(1))
      log_r = torch.log_softmax(F.logsigmoid(logits).unsqueeze(1) + log_p, -1)
  return mu, torch.sigmoid(logits)


def _lambdas(inverse_temperature, iterations: int) -> list[float]:
  if inverse_temperature is None:  # the authors' schedule
    return [0.01 * (1 - 0.95 ** (t + 1)) for t in range(iterations)]
  if isinstance(inverse_temperature, (int, float)):
    return [float(inverse_temperature)] * iterations
  return [float(x) for x in inverse_temperature]


class _ConvCaps(nn.Module):
  """EM routing inside every K x K window: poses [B, H, W, C, 16],
  activations [B, H, W, C] -> [B, H', W', O, 16], [B, H', W', O]."""

  def __init__(self, in_types, out_types, kernel, stride, lambdas,
               normalize_cost, variance_floor, transform_std):
    super().__init__()
    self.kernel, self.stride = kernel, stride
    self.lambdas, self.normalize_cost = lambdas, normalize_cost
    self.variance_floor = variance_floor
    self.weights = nn.Parameter(transform_std * torch.randn(
        kernel * kernel * in_types, out_types, 4, 4))
    self.beta_u = nn.Parameter(torch.zeros(out_types))
    self.beta_a = nn.Parameter(torch.zeros(out_types))

  def forward(self, poses, acts):
    k, s = self.kernel, self.stride
    # unfold puts the window taps last: [B, H', W', C, 16, K, K].
    poses = poses.unfold(1, k, s).unfold(2, k, s)
    b, h, w = poses.shape[:3]
    poses = poses.permute(0, 1, 2, 5, 6, 3, 4).reshape(b, h, w, -1, 4, 4)
    acts = acts.unfold(1, k, s).unfold(2, k, s).permute(0, 1, 2, 4, 5, 3)
    votes = torch.einsum('bhwipq,ioqr->bhwiopr', poses, self.weights)
    num_in, num_out = votes.shape[3], votes.shape[4]
    mu, a = em_routing(votes.reshape(-1, num_in, num_out, 16),
                       acts.reshape(-1, num_in), self.beta_u, self.beta_a,
                       self.lambdas, normalize_cost=self.normalize_cost,
                       variance_floor=self.variance_floor)
    return mu.view(b, h, w, num_out, 16), a.view(b, h, w, num_out)


class MatrixCapsNet(nn.Module):
  """ReLU Conv1 A@5x5/2, primary capsules B (1x1), ConvCaps C (3/2), ConvCaps
  D (3/1), class capsules (shared transforms, coordinate addition)."""

  def __init__(self, *, input_shape: Sequence[int] = (32, 32, 1),
               num_classes: int = 5, A: int = 32, B: int = 32, C: int = 32,
               D: int = 32, em_routing='paper', em_routing_overrides=None,
               caps1_iterations: int = 0,
               coordinate_addition: bool = True, conv1_kernel: int = 5,
               conv1_stride: int = 2, caps1_kernel: int = 3,
               caps1_stride: int = 2, caps2_kernel: int = 3,
               caps2_stride: int = 1,
               class_inverse_temperature=None, class_lambda_scale: float = 1.0,
               transform_std: float | None = None, init: str = 'paper',
               **unused):
    super().__init__()
    # capsjax's routing options (a preset's name and overrides, as the
    # configs give them), read here as plain values.
    from capsjax import routing  # noqa: PLC0415 (jax only where EM is built)
    em = routing.em_routing_with(em_routing, em_routing_overrides)
    if (em.activation_form != 'paper' or em.normalize_across_positions or
        em.released or em.center_momentum or init != 'paper'):
      raise ValueError('the PyTorch EM reference has the paper activation, '
                       'within-window E-step, no centre momentum and the '
                       "'paper' init only (the shipped configs' options).")
    num_iterations, inverse_temperature = (em.num_iterations,
                                           em.inverse_temperature)
    normalize_cost, variance_epsilon = em.normalize_cost, em.variance_epsilon
    height, width, channels = input_shape
    std = 0.5 if transform_std is None else transform_std
    lambdas = _lambdas(inverse_temperature, num_iterations)
    self.conv1 = nn.Conv2d(channels, A, conv1_kernel, stride=conv1_stride)
    self.primary = nn.Conv2d(A, B * 17, 1)
    self.num_primary = B
    self.caps1 = _ConvCaps(
        B, C, caps1_kernel, caps1_stride,
        _lambdas(inverse_temperature, caps1_iterations or num_iterations),
        normalize_cost, variance_epsilon, std)
    self.caps2 = _ConvCaps(C, D, caps2_kernel, caps2_stride, lambdas,
                           normalize_cost, variance_epsilon, std)
    self.class_lambdas = (
        [class_lambda_scale * x for x in lambdas]
        if class_inverse_temperature is None else
        _lambdas(class_inverse_temperature, num_iterations))
    self.normalize_cost = normalize_cost
    self.variance_floor = variance_epsilon
    self.coordinate_addition = coordinate_addition
    self.class_weights = nn.Parameter(std * torch.randn(D, num_classes, 4, 4))
    self.beta_u = nn.Parameter(torch.zeros(num_classes))
    self.beta_a = nn.Parameter(torch.zeros(num_classes))

  def forward(self, images: torch.Tensor, labels: torch.Tensor):
    del labels
    x = F.relu(self.conv1(images))
    x = self.primary(x).permute(0, 2, 3, 1)  # [B, H, W, 17 B]
    b = self.num_primary
    poses = x[..., :16 * b].unflatten(-1, (b, 16))
    acts = torch.sigmoid(x[..., 16 * b:])
    poses, acts = self.caps1(poses, acts)
    poses, acts = self.caps2(poses, acts)
    batch, h, w, d = acts.shape
    votes = torch.einsum('bhwcpq,coqr->bhwcopr', poses.unflatten(-1, (4, 4)),
                         self.class_weights).flatten(-2)
    if self.coordinate_addition:  # the scaled centre of each position
      offsets = torch.zeros(h, w, 1, 1, 16, device=votes.device)
      rows = torch.arange(h, device=votes.device)
      cols = torch.arange(w, device=votes.device)
      offsets[..., 0] = ((rows + 0.5) / h).view(h, 1, 1, 1)
      offsets[..., 1] = ((cols + 0.5) / w).view(1, w, 1, 1)
      votes = votes + offsets
    _, a = em_routing(votes.reshape(batch, h * w * d, votes.shape[-2], 16),
                      acts.reshape(batch, -1), self.beta_u, self.beta_a,
                      self.class_lambdas, normalize_cost=self.normalize_cost,
                      variance_floor=self.variance_floor)
    return {'activations': a}


def _margin_loss(lengths, labels, negative_weight=0.5):
  one_hot = F.one_hot(labels, lengths.shape[-1]).to(lengths.dtype)
  return (one_hot * F.relu(0.9 - lengths) ** 2 + negative_weight * (
      1 - one_hot) * F.relu(lengths - 0.1) ** 2).sum(-1)


def loss(outputs: dict[str, torch.Tensor], images: torch.Tensor,
         labels: torch.Tensor, reconstruction_weight: float) -> torch.Tensor:
  """The loss capsjax trains the same model with (the spread loss at its
  smallest margin for the EM models; its weight decay is in the step)."""
  if 'activations' in outputs:
    a = outputs['activations']
    target = a.gather(1, labels.unsqueeze(1))
    gaps = F.relu(0.2 - (target - a)) ** 2
    return (gaps * (1 - F.one_hot(labels, a.shape[-1]).to(a.dtype))).sum(
        -1).mean()
  if 'logits' in outputs:
    return F.cross_entropy(outputs['logits'], labels)
  if 'lengths' in outputs:
    total = _margin_loss(outputs['lengths'], labels)
    if 'reconstructions' in outputs:
      error = ((outputs['reconstructions'] - images.flatten(1)) ** 2).sum(-1)
      total = total + reconstruction_weight * error
    return total.mean()
  return _margin_loss(outputs['scores'], labels, 0.25).mean()


# PyTorch's modes, as (torch.compile the forward and backward pass,
# bfloat16 autocast).
TORCH_MODES: dict[str, tuple[bool, bool]] = {
    'eager_float32': (False, False),
    'compile_float32': (True, False),
    'eager_bfloat16': (False, True),
    'compile_bfloat16': (True, True),
}


MODELS: dict[str, Callable[..., nn.Module]] = {
    'capsnet': CapsNet,
    'baseline_cnn': BaselineCNN,
    'two_digit_baseline': TwoDigitBaseline,
    'two_digit_capsnet': TwoDigitCapsNet,
    'matrix_capsnet': MatrixCapsNet,
}


def _as_float32(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
  """The model's floating outputs in float32 (autocast leaves some in
  bfloat16); the loss is then float32, as capsjax's mixed precision's."""
  return {k: v.float() if v.is_floating_point() else v
          for k, v in outputs.items()}


def train_step_fn(model_name: str, options: dict, batch_size: int,
                  image_shape: Sequence[int], num_classes: int,
                  learning_rate: float, reconstruction_weight: float,
                  num_threads: int, seed: int = 0,
                  weight_decay: float = 0.0,
                  mode: str = 'eager_float32',
                  device: str = 'cpu') -> Callable[[], float]:
  """A callable doing one full train step (forward, backward, Adam) on a
  fixed random batch on ``device`` ('cpu' or 'cuda') in ``mode``
  (``TORCH_MODES``); returns the loss, which waits for the device. With
  'compile_*' the first call compiles (``torch.compile``'s errors surface
  there)."""
  if model_name not in MODELS:
    raise ValueError(f'no PyTorch reference of {model_name!r}; references: '
                     f'{", ".join(sorted(MODELS))}.')
  if mode not in TORCH_MODES:
    raise ValueError(f'mode must be one of {", ".join(TORCH_MODES)}, got '
                     f'{mode!r}.')
  if device not in ('cpu', 'cuda'):
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}.")
  if device == 'cuda' and not torch.cuda.is_available():
    raise ValueError('device cuda: this PyTorch sees no CUDA GPU '
                     f'(torch {torch.__version__}); compare on the CPU.')
  compiled, bfloat16 = TORCH_MODES[mode]
  torch.set_num_threads(num_threads)
  torch.manual_seed(seed)
  height, width, channels = image_shape
  if model_name in ('capsnet', 'baseline_cnn'):
    options = options | {'input_shape': (height, width, channels)}
  elif model_name == 'matrix_capsnet':
    # The crop the model sees (smallNORB is stored at 48x48); the registry
    # name's default options have none: the images' shape.
    height, width, channels = options.get('input_shape', image_shape)
    options = options | {'input_shape': (height, width, channels)}
  model = MODELS[model_name](**options).to(device)
  # The L2 penalty of capsjax's EM step: matrices and kernels, not biases.
  penalized = [p for p in model.parameters() if p.ndim > 1]
  model.train()
  optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
  images = torch.rand(batch_size, channels, height, width, device=device)
  labels = torch.randint(0, num_classes, (batch_size,), device=device)
  labels_images = images.permute(0, 2, 3, 1)  # reconstruction targets, HWC

  def loss_of(images, labels, labels_images):
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bfloat16):
      outputs = model(images, labels)
    value = loss(_as_float32(outputs), labels_images, labels,
                 reconstruction_weight)
    if weight_decay:
      value = value + weight_decay * sum((p * p).sum() for p in penalized)
    return value

  if compiled:
    loss_of = torch.compile(loss_of)

  def step() -> float:
    optimizer.zero_grad(set_to_none=True)
    value = loss_of(images, labels, labels_images)
    value.backward()
    optimizer.step()
    return float(value.detach())

  return step
