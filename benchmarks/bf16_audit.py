"""Which products a train step computes in which dtype on a GPU, from the
program JAX exports for CUDA (no GPU needed).

  python -m benchmarks.bf16_audit --model=capsnet_mnist --batch_size=64
  python -m benchmarks.bf16_audit --all --batch_size=64     # every family
  python -m benchmarks.bf16_audit --model=matrix_capsnet_mnist \\
      --model_option=implementation=pallas --ops

The train step is the family's own (``benchmarks.harness`` builds it as
``experiments.benchmark`` times it), in the compute dtype ``--dtype``
(bfloat16: mixed precision), exported with ``jax.export`` for
``platforms=['cuda']``. While it is traced, ``jax.default_backend()``
answers 'gpu', so that capsjax chooses what it chooses on a GPU: XLA's
direct convolutions, no CPU kernels, no window chunks, compiled (not
interpreted) Pallas kernels. The StableHLO text (``mlir_module()``) is
read for every ``stablehlo.convolution`` and ``stablehlo.dot_general``:
operand and result types, FLOPs (2 x output elements x the contracted
size; a convolution's contracted size is kernel taps x input channels per
group, zeros of a dilation included), the converts that feed it and read
its result, and the source lines that made it (the ``loc(...)`` call
stacks; innermost first).

A float32 product in a bfloat16 step is *justified* when a line of
capsjax's source on its call stack says why: the marker ``# float32:``
(``MARKER``) followed by the reason, on a line of the statement or in the
comment block right above it. Routing statistics are float32 by design
and say so there. ``unjustified`` lists the float32 products above
``MIN_FLOPS`` that no line justifies; ``tests/test_bf16_audit.py`` fails
on any. StableHLO is the program before XLA's optimisation: XLA may fuse
a convert into its product, but does not change a product's dtype.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import math
import os
import re
import sys
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from unittest import mock

import jax

MARKER = '# float32:'
# Float32 products below this many FLOPs a step are left alone (the loss,
# the optimiser, a [B, K] product): 1 MFLOP.
MIN_FLOPS = 1e6
FLOAT32_TYPES = ('f32', 'f64')
PRODUCTS = ('convolution', 'dot_general')
# The families of the shipped models, as the GPU session measures them.
FAMILIES = {
    'capsnet': 'capsnet_mnist',
    'em': 'matrix_capsnet_mnist',
    'efficient': 'efficient_capsnet_mnist',
    'su': 'two_digit_capsnet',
    'su_baseline': 'two_digit_baseline',
    'cnn': 'baseline_cnn_mnist',
}
# The custom calls a CUDA export of capsjax may hold: Pallas' Triton kernels.
_CUSTOM_CALLS = ('__gpu$xla.gpu.triton',)
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Ops a value passes through unchanged in dtype: a convert is looked for
# behind (and in front of) them.
_PASS_THROUGH = ('reshape', 'transpose', 'broadcast_in_dim', 'slice', 'pad')


@dataclasses.dataclass(frozen=True)
class Frame:
  """One frame of an op's call stack: file, first and last line, function."""
  path: str
  first: int
  last: int
  function: str = ''

  def __str__(self) -> str:
    path = os.path.relpath(self.path, _REPO) if self.in_repo else self.path
    return f'{path}:{self.first}'

  @property
  def in_repo(self) -> bool:
    path = os.path.abspath(self.path)
    return (path.startswith(_REPO + os.sep)
            and 'site-packages' not in path)


@dataclasses.dataclass
class Product:
  """A convolution or dot_general of the exported program.

  ``types``: (lhs, rhs, result) element types ('bf16', 'f32', ...);
  ``shapes``: their shapes; ``converts``: the converts around it, e.g.
  'lhs<-f32' (its lhs converted from float32), 'out->bf16' (its result
  converted to bfloat16); ``frames``: the call stack, innermost first;
  ``reason``: the ``MARKER`` comment that justifies a float32 product
  ('' if none); ``count``: identical products merged into this one (by
  ``merge``)."""
  kind: str
  types: tuple[str, str, str]
  shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
  flops: int
  dims: str
  converts: tuple[str, ...]
  frames: tuple[Frame, ...]
  name: str = ''
  reason: str = ''
  where: str = ''
  count: int = 1

  @property
  def float32(self) -> bool:
    """Whether an operand is float32 (or wider)."""
    return any(t in FLOAT32_TYPES for t in self.types[:2])

  @property
  def source(self) -> str:
    """The innermost frame in the repository ('?' when none)."""
    for frame in self.frames:
      if frame.in_repo:
        return str(frame)
    return str(self.frames[0]) if self.frames else '?'

  def key(self) -> tuple:
    return (self.kind, self.types, self.shapes, self.dims, self.converts,
            self.source, self.reason)


# ----------------------------------------------------------------------------
# Exporting.


@contextlib.contextmanager
def as_on_gpu() -> Iterator[None]:
  """Inside: ``jax.default_backend()`` says 'gpu' (capsjax's choices are
  a GPU's) and locations carry full call stacks."""
  previous = jax.config.jax_include_full_tracebacks_in_locations
  jax.config.update('jax_include_full_tracebacks_in_locations', True)
  try:
    with mock.patch.object(jax, 'default_backend', lambda: 'gpu'):
      yield
  finally:
    jax.config.update('jax_include_full_tracebacks_in_locations', previous)


def export_text(fn: Callable, *args) -> str:
  """The StableHLO text of ``jax.jit(fn)(*args)`` exported for CUDA,
  traced ``as_on_gpu``."""
  with as_on_gpu():
    exported = jax.export.export(
        jax.jit(fn), platforms=['cuda'],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(name)
                         for name in _CUSTOM_CALLS])(*args)
    return exported.mlir_module()


def export_train_step(spec: str, *, batch_size: int = 8,
                      dtype: str = 'bfloat16',
                      options: dict[str, Any] | None = None) -> str:
  """The StableHLO text of ``spec``'s train step in ``dtype`` for CUDA
  (``spec`` as ``experiments.benchmark --model``; ``options`` model
  options)."""
  from benchmarks import harness  # pylint: disable=g-import-not-at-top
  config = harness.configure(spec, batch_size=batch_size, options=options)
  with as_on_gpu():  # the model's layers choose as on a GPU
    step, args = harness.train_step_and_inputs(config, dtype=dtype)
  return export_text(step, *args)


# ----------------------------------------------------------------------------
# Reading the StableHLO text.

_TENSOR = re.compile(r'tensor<((?:\d+x)*)([a-z]\w*)>')
_DEF = re.compile(r'^\s*(%[\w]+)(?::\d+)? = "?([\w.]+)"?(.*)$')
_FUNC = re.compile(r'func\.func (?:public |private )?@([\w.$-]+)\(')
_LOC_DEF = re.compile(r'^#(loc\d*) = (loc\(.*\))\s*$')
_TRAILING_LOC = re.compile(r'loc\((#loc\d*|"[^"]*"(?:\(#loc\d*\))?)\)\s*$')
_FILE_LOC = re.compile(r'^"([^"]+)":(\d+):\d+(?: to (\d+)?:\d+)?$')


def _tensor(text: str) -> tuple[tuple[int, ...], str]:
  """'tensor<8x28xbf16>' -> ((8, 28), 'bf16')."""
  match = _TENSOR.search(text)
  if not match:
    return (), '?'
  dims = tuple(int(d) for d in match.group(1).split('x') if d)
  return dims, match.group(2)


def _signature(rest: str) -> tuple[list[str], str]:
  """The operand types and the result type of an op's trailing
  ``: (A, B) -> R`` (or ``: T`` for same-typed ops)."""
  rest = _TRAILING_LOC.sub('', rest).rstrip()
  _, sep, tail = rest.rpartition(' : ')
  if not sep:
    return [], ''
  if '->' in tail:
    operands, _, result = tail.rpartition('->')
    return [m.group(0) for m in _TENSOR.finditer(operands)], result.strip()
  return [tail.strip()], tail.strip()


def _operands(rest: str) -> list[str]:
  """The SSA values an op reads, in order (before its type signature)."""
  head = _TRAILING_LOC.sub('', rest).rpartition(' : ')[0] or rest
  return re.findall(r'%[\w]+(?:#\d+)?', head)


class _Locations:
  """The ``#locN = loc(...)`` table of a module, resolved to call stacks."""

  def __init__(self, text: str):
    self._table, self._frames = {}, {}
    for line in text.splitlines():
      match = _LOC_DEF.match(line)
      if match:
        self._table['#' + match.group(1)] = match.group(2)

  def frames(self, ref: str) -> tuple[Frame, ...]:
    """The call stack of a location (``#locN`` or its ``loc(...)``
    text), innermost first."""
    if ref not in self._frames:
      self._frames[ref] = self._resolve(ref)
    return self._frames[ref]

  def _resolve(self, ref: str) -> tuple[Frame, ...]:
    text = self._table.get(ref, ref)
    inner = text[4:-1] if text.startswith('loc(') else text
    if inner.startswith('callsite('):
      callee, _, caller = inner[len('callsite('):-1].partition(' at ')
      return self.frames(callee) + self.frames(caller)
    match = _FILE_LOC.match(inner)
    if match:
      first = int(match.group(2))
      return (Frame(match.group(1), first,
                    int(match.group(3) or first)),)
    named = re.match(r'^"([^"]*)"\((#loc\d*)\)$', inner)
    if named:
      frames = self.frames(named.group(2))
      if frames and not frames[0].function and not named.group(1).startswith(
          'jit('):
        frames = (dataclasses.replace(frames[0], function=named.group(1)),
                  ) + frames[1:]
      return frames
    return ()

  def name(self, ref: str) -> str:
    """The op's name path ('jit(step)/jvp(...)/dot_general'), if any."""
    text = self._table.get(ref, ref)
    match = re.match(r'^loc\("([^"]*)"', text)
    return match.group(1) if match else ''


def _labels(text: str) -> list[str]:
  return [s.strip() for s in text.split(',')]


def _window(dims: str, key: str, count: int, default: int) -> list:
  """A window attribute of a convolution ('stride', 'lhs_dilate', ...;
  'pad' gives the low paddings), ``default`` where absent."""
  if key == 'pad':
    match = re.search(r'pad = \[((?:\[-?\d+, -?\d+\],? ?)*)\]', dims)
    if not match:
      return [default] * count
    return [int(low) for low, _ in
            re.findall(r'\[(-?\d+), (-?\d+)\]', match.group(1))]
  match = re.search(key + r' = \[([\d, ]*)\]', dims)
  return ([int(v) for v in match.group(1).split(',')] if match
          else [default] * count)


def _conv_flops(shapes, dims: str) -> int:
  """2 x multiply-adds of a convolution, counting only the kernel taps
  that land on an input element (not on padding or on the holes of an
  lhs dilation: a strided convolution's input gradient)."""
  lhs, rhs, out = shapes
  match = re.search(r'\[([^\]]*)\]x\[([^\]]*)\]->\[([^\]]*)\]', dims)
  if not match:
    return 0
  lhs_labels, rhs_labels, out_labels = (_labels(g) for g in match.groups())
  spatial = sorted(label for label in lhs_labels if label.isdigit())
  n = len(spatial)
  strides, pads = _window(dims, 'stride', n, 1), _window(dims, 'pad', n, 0)
  lhs_dilate = _window(dims, 'lhs_dilate', n, 1)
  rhs_dilate = _window(dims, 'rhs_dilate', n, 1)
  taps = 1
  for axis, label in enumerate(spatial):
    size = lhs[lhs_labels.index(label)]
    kernel = rhs[rhs_labels.index(label)]
    positions = out[out_labels.index(label)]
    span, hole = (size - 1) * lhs_dilate[axis], lhs_dilate[axis]
    taps *= sum(1 for o in range(positions) for k in range(kernel)
                if 0 <= (index := o * strides[axis] + k * rhs_dilate[axis]
                         - pads[axis]) <= span and index % hole == 0)
  out_rest = math.prod(size for label, size in zip(out_labels, out,
                                                   strict=True)
                       if not label.isdigit())
  return 2 * out_rest * taps * rhs[rhs_labels.index('i')]


def _flops(kind: str, shapes, dims: str) -> int:
  """2 x multiply-adds: a dot_general's output elements x its contracted
  size; a convolution's by ``_conv_flops``."""
  if kind == 'convolution':
    return _conv_flops(shapes, dims)
  lhs, _, out = shapes
  match = re.search(r'contracting_dims = \[([\d, ]*)\] x', dims)
  axes = ([int(a) for a in match.group(1).split(',') if a.strip()]
          if match else [])
  return 2 * math.prod(out) * math.prod(lhs[a] for a in axes)


def products(text: str) -> list[Product]:
  """Every convolution and dot_general of a StableHLO module's text."""
  locations = _Locations(text)
  found, defs, users = [], {}, collections.defaultdict(list)
  function = ''
  lines = text.splitlines()
  for line in lines:
    match = _FUNC.search(line)
    if match:
      function = match.group(1)
      continue
    match = _DEF.match(line)
    if not match:
      continue
    name, op, rest = match.groups()
    op = op.removeprefix('stablehlo.')
    key = (function, name)
    defs[key] = (op, rest)
    for operand in _operands(rest):
      users[(function, operand.split('#')[0])].append(key)
    if op not in PRODUCTS:
      continue
    operand_types, result = _signature(rest)
    (lhs_shape, lhs_type), (rhs_shape, rhs_type) = (
        _tensor(t) for t in (operand_types + ['', ''])[:2])
    out_shape, out_type = _tensor(result)
    shapes = (lhs_shape, rhs_shape, out_shape)
    loc = _TRAILING_LOC.search(rest)
    ref = loc.group(1) if loc else ''
    ref = ref if ref.startswith('#') else f'loc({ref})'
    found.append(dict(
        key=key, kind=op, types=(lhs_type, rhs_type, out_type),
        shapes=shapes, dims=rest.split(' : ')[0],
        operands=_operands(rest)[:2], frames=locations.frames(ref),
        name=locations.name(ref)))
  result = []
  for item in found:
    function = item['key'][0]
    converts = []
    for side, operand in zip(('lhs', 'rhs'), item['operands'], strict=False):
      source = _convert_behind(defs, function, operand)
      if source:
        converts.append(f'{side}<-{source}')
    converts += [f'out->{t}' for t in _converts_after(defs, users,
                                                      item['key'])]
    result.append(Product(
        kind=item['kind'], types=item['types'], shapes=item['shapes'],
        flops=_flops(item['kind'], item['shapes'], item['dims']),
        dims=item['dims'], converts=tuple(converts), frames=item['frames'],
        name=item['name']))
  return result


def _convert_behind(defs, function: str, value: str, depth: int = 4) -> str:
  """The element type a value was converted from ('' if no convert),
  looking through ops that keep the dtype."""
  for _ in range(depth):
    op, rest = defs.get((function, value.split('#')[0]), ('', ''))
    if op == 'convert':
      operand_types, _ = _signature(rest)
      return _tensor(operand_types[0])[1] if operand_types else '?'
    if op not in _PASS_THROUGH:
      return ''
    operands = _operands(rest)
    if not operands:
      return ''
    value = operands[0]
  return ''


def _converts_after(defs, users, key, depth: int = 4) -> list[str]:
  """The element types a result is converted to, through ops that keep
  the dtype."""
  found, frontier = [], [key]
  for _ in range(depth):
    following = []
    for node in frontier:
      for user in users.get(node, ()):
        op, rest = defs[user]
        if op == 'convert':
          found.append(_tensor(_signature(rest)[1])[1])
        elif op in _PASS_THROUGH:
          following.append(user)
    frontier = following
  return sorted(set(found))


# ----------------------------------------------------------------------------
# Justifications.


@functools.cache
def _source_lines(path: str) -> tuple[str, ...]:
  try:
    with open(path, encoding='utf-8') as f:
      return tuple(f.read().splitlines())
  except OSError:
    return ()


def frame_reason(frame: Frame) -> str:
  """The ``MARKER`` reason on the frame's statement (its lines, or the
  comment block right above them); '' if none."""
  lines = _source_lines(frame.path)
  if not lines:
    return ''
  first, last = frame.first, max(frame.first, frame.last)
  candidates = list(range(first, min(last, len(lines)) + 1))
  above = first - 1
  while above >= 1 and lines[above - 1].lstrip().startswith('#'):
    candidates.append(above)
    above -= 1
  for number in candidates:
    line = lines[number - 1]
    index = line.find(MARKER)
    if index >= 0:
      return line[index + len(MARKER):].strip() or '(no reason given)'
  return ''


def justify(found: list[Product]) -> list[Product]:
  """Each float32 product with its ``reason`` and ``where`` (the first
  repository frame on its stack that carries the marker)."""
  for product in found:
    if not product.float32:
      continue
    for frame in product.frames:
      if frame.in_repo:
        reason = frame_reason(frame)
        if reason:
          product.reason, product.where = reason, str(frame)
          break
  return found


def merge(found: list[Product]) -> list[Product]:
  """Identical products (kind, types, shapes, converts, source) as one,
  with ``count`` and the FLOPs summed; largest FLOPs first."""
  merged: dict[tuple, Product] = {}
  for product in found:
    key = product.key()
    if key in merged:
      merged[key].count += product.count
      merged[key].flops += product.flops
    else:
      merged[key] = dataclasses.replace(product)
  return sorted(merged.values(), key=lambda p: -p.flops)


def unjustified(found: list[Product], min_flops: float = MIN_FLOPS
                ) -> list[Product]:
  """The float32 products of more than ``min_flops`` (each, before
  merging) that no source line justifies."""
  return [p for p in found
          if p.float32 and p.flops / p.count > min_flops and not p.reason]


def audit_text(text: str) -> list[Product]:
  """``products`` of a module, justified and merged."""
  return merge(justify(products(text)))


# ----------------------------------------------------------------------------
# Reports.


def _shape(shape: tuple[int, ...], dtype: str) -> str:
  return 'x'.join(map(str, shape)) + f' {dtype}'


def table(found: list[Product], min_flops: float = 0.0) -> str:
  """A text table of merged products of at least ``min_flops``."""
  lines = [f"{'kind':<11} {'n':>3} {'MFLOP':>9}  {'lhs':<22} {'rhs':<22} "
           f"{'result':<22} {'converts':<18} source; float32 reason"]
  for p in found:
    if p.flops < min_flops:
      continue
    note = ''
    if p.float32:
      note = f'; float32: {p.reason} ({p.where})' if p.reason else (
          '; FLOAT32, NOT JUSTIFIED')
    lines.append(
        f'{p.kind[:11]:<11} {p.count:>3} {p.flops / 1e6:>9.2f}  '
        f'{_shape(p.shapes[0], p.types[0]):<22} '
        f'{_shape(p.shapes[1], p.types[1]):<22} '
        f'{_shape(p.shapes[2], p.types[2]):<22} '
        f"{','.join(p.converts) or '-':<18} {p.source}{note}")
  return '\n'.join(lines)


def summary(found: list[Product]) -> dict[str, float]:
  """FLOPs a step by operand dtype: 'total', 'bf16' (both operands
  bfloat16), 'f32_justified', 'f32_unjustified' (over ``MIN_FLOPS``),
  'f32_small' (unjustified but under it), 'other'."""
  out = collections.Counter()
  small = {id(p) for p in found if p.float32 and not p.reason} - {
      id(p) for p in unjustified(found)}
  for p in found:
    out['total'] += p.flops
    if p.types[0] == p.types[1] == 'bf16':
      out['bf16'] += p.flops
    elif p.float32 and p.reason:
      out['f32_justified'] += p.flops
    elif id(p) in small:
      out['f32_small'] += p.flops
    elif p.float32:
      out['f32_unjustified'] += p.flops
    else:
      out['other'] += p.flops
  return dict(out)


def op_counts(text: str) -> dict[str, Any]:
  """What the exported module holds, before XLA's fusion: ops in 'main'
  (top level, nested regions included), ops in all functions, while
  loops, calls, custom calls, products, and the ops per op name."""
  counts = collections.Counter()
  main_ops = all_ops = 0
  for function, op, _ in _op_lines(text):
    all_ops += 1
    main_ops += function == 'main'
    counts[op] += 1
  return {'main_ops': main_ops, 'all_ops': all_ops,
          'converts': convert_elements(text),
          'while': counts['stablehlo.while'], 'calls': counts['func.call'],
          'custom_calls': counts['stablehlo.custom_call'],
          'products': counts['stablehlo.dot_general']
          + counts['stablehlo.convolution'],
          'functions': len(_FUNC.findall(text)), 'by_op': dict(counts)}


def _op_lines(text: str) -> Iterator[tuple[str, str, str]]:
  """(function, op name, location reference) of every op of a module
  (returns aside), nested regions included."""
  function = ''
  for line in text.splitlines():
    header = _FUNC.search(line)
    if header:
      function = header.group(1)
      continue
    match = re.match(r'^\s*(?:%[\w]+(?::\d+)? = )?"?((?:stablehlo|func|chlo|'
                     r'mhlo|tt)\.[\w.]+)', line)
    if not match or match.group(1) in ('func.return', 'stablehlo.return'):
      continue
    loc = _TRAILING_LOC.search(line.rstrip())
    ref = loc.group(1) if loc else ''
    yield function, match.group(1), (
        ref if ref.startswith('#') or not ref else f'loc({ref})')


def ops_by_layer(text: str) -> dict[str, int]:
  """Ops of a module by what made them. Ops of 'main': the innermost frame
  in capsjax/layers/ (the layer's method, e.g. 'ConvCapsules.__call__'),
  'optimizer' for the update (``state.apply_gradients``), else the
  innermost frame's function in capsjax ('?' without one; the ops of an
  unrolled routing loop's body carry that body's own stack: em_m_step,
  ...). Ops of the module's other functions (JAX's outlined helpers, each
  counted once however often it is called; their locations can come from
  an earlier trace in the process): '@' and the function's name, its
  numbering dropped ('@_where', '@threefry2x32'). Largest first."""
  locations = _Locations(text)
  counts = collections.Counter()
  for function, _, ref in _op_lines(text):
    if function != 'main':
      counts['@' + re.sub(r'_\d+$', '', function)] += 1
      continue
    frames = [f for f in locations.frames(ref) if f.in_repo] if ref else []
    layer = next((f for f in frames
                  if f'{os.sep}capsjax{os.sep}layers{os.sep}' in f.path), None)
    if any(f.function == 'apply_gradients' for f in frames):
      key = 'optimizer'
    elif layer is not None:
      key = layer.function or str(layer)
    else:
      key = (frames[0].function or str(frames[0])) if frames else '?'
    counts[key] += 1
  return dict(counts.most_common())


def convert_elements(text: str) -> dict[str, int]:
  """Elements converted a step, by 'from->to' element type (the casts of
  mixed precision and those around float32 statistics)."""
  out = collections.Counter()
  for line in text.splitlines():
    match = _DEF.match(line)
    if match and match.group(2) == 'stablehlo.convert':
      operand_types, result = _signature(match.group(3))
      if operand_types:
        shape, source = _tensor(operand_types[0])
        out[f'{source}->{_tensor(result)[1]}'] += math.prod(shape)
  return dict(out.most_common())


_HLO_INSTRUCTION = re.compile(
    r'^\s*(?:ROOT )?%([\w.-]+) = (.+?) ([a-z][\w-]*)\((.*)$')
_HLO_COMPUTATION = re.compile(r'^(?:ENTRY )?%([\w.-]+) ')


def compiled_ops(hlo_text: str) -> dict[str, Any]:
  """What a compiled program runs (``compiled.as_text()``, after XLA's
  fusion), outside the fused computations: 'instructions', 'fusions' (each
  one kernel on a GPU), 'layout_fusions' (fusions named for a transpose or
  copy), 'copies' and 'transposes' (unfused), 'while' loops,
  'custom_calls' by target, and 'convolutions': each cuDNN convolution's
  target, dim_labels and operand and result shapes with their layouts."""
  fused = set(re.findall(r'calls=%([\w.-]+)', hlo_text))
  counts = collections.Counter()
  targets = collections.Counter()
  convolutions = []
  computation = ''
  for line in hlo_text.splitlines():
    header = _HLO_COMPUTATION.match(line)
    if header:
      computation = header.group(1)
      continue
    match = _HLO_INSTRUCTION.match(line)
    if not match or computation in fused:
      continue
    name, result, opcode, rest = match.groups()
    if opcode in ('parameter', 'constant', 'get-tuple-element', 'tuple',
                  'bitcast'):
      continue
    counts['instructions'] += 1
    counts[opcode] += 1
    if opcode == 'fusion' and re.search(r'transpose|copy', name):
      counts['layout_fusions'] += 1
    if opcode == 'custom-call':
      target = re.search(r'custom_call_target="([^"]+)"', rest)
      target = target.group(1) if target else '?'
      targets[target] += 1
      if 'conv' in target.lower():
        labels = re.search(r'dim_labels=([\w>-]+)', rest)
        operands = re.findall(r'[a-z]+\d*\[[\d,]*\]\{[\d,]*\}',
                              rest.split('),')[0])
        convolutions.append(' '.join(
            [target, labels.group(1) if labels else '?',
             ' '.join(operands), '->',
             re.findall(r'[a-z]+\d*\[[\d,]*\]\{[\d,]*\}', result)[0]
             if '{' in result else result]))
  return {'instructions': counts['instructions'],
          'fusions': counts['fusion'],
          'layout_fusions': counts['layout_fusions'],
          'copies': counts['copy'], 'transposes': counts['transpose'],
          'while': counts['while'], 'custom_calls': dict(targets),
          'convolutions': convolutions}


def report(spec: str, text: str, *, top: int = 0) -> tuple[str, int]:
  """(the report of one exported step, the count of unjustified float32
  products)."""
  found = audit_text(text)
  bad = unjustified(found)
  totals = summary(found)
  counts = op_counts(text)
  total = totals.get('total', 0) or 1
  lines = [
      f'== {spec}: {len(found)} distinct products, '
      f"{totals.get('total', 0) / 1e9:.3f} GFLOP a step; bf16 "
      f"{100 * totals.get('bf16', 0) / total:.1f}%, float32 justified "
      f"{100 * totals.get('f32_justified', 0) / total:.1f}%, float32 "
      f"unjustified {100 * totals.get('f32_unjustified', 0) / total:.1f}% "
      f'({len(bad)} products over {MIN_FLOPS / 1e6:g} MFLOP), float32 small '
      f"{100 * totals.get('f32_small', 0) / total:.2f}%",
      f"   StableHLO (before fusion): {counts['main_ops']} ops in main, "
      f"{counts['all_ops']} in {counts['functions']} functions, "
      f"{counts['while']} while loops, {counts['custom_calls']} custom "
      f"calls, {counts['products']} products",
      '   elements converted: ' + ', '.join(
          f'{k} {v / 1e6:.2f}M' for k, v in counts['converts'].items()
          if v >= 1e4),
      table(found[:top] if top else found),
  ]
  return '\n'.join(lines), len(bad)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--model', default='capsnet_mnist:smoke',
                      help='as experiments.benchmark --model (comma-separated '
                      'for several)')
  parser.add_argument('--all', action='store_true',
                      help=f'every family: {", ".join(FAMILIES.values())}')
  parser.add_argument('--batch_size', type=int, default=8)
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--model_option', action='append', default=[],
                      help='KEY=VALUE, as experiments.benchmark')
  parser.add_argument('--top', type=int, default=0,
                      help='rows of each table (0: all)')
  parser.add_argument('--ops', action='store_true',
                      help='also the ops (before fusion) by the layer that '
                      'made them')
  parser.add_argument('--save', default='',
                      help='folder for each exported module (NAME.mlir)')
  args = parser.parse_args(argv)
  from benchmarks import harness  # pylint: disable=g-import-not-at-top
  options = harness.parse_options(args.model_option)
  specs = list(FAMILIES.values()) if args.all else [
      s.strip() for s in args.model.split(',') if s.strip()]
  failures = 0
  for spec in specs:
    text = export_train_step(spec, batch_size=args.batch_size,
                             dtype=args.dtype, options=options)
    if args.save:
      os.makedirs(args.save, exist_ok=True)
      with open(os.path.join(args.save, spec.replace(':', '_') + '.mlir'),
                'w', encoding='utf-8') as f:
        f.write(text)
    out, bad = report(f'{spec} batch {args.batch_size} {args.dtype}'
                      + ''.join(f' {k}={v}' for k, v in options.items()),
                      text, top=args.top)
    print(out, flush=True)
    if args.ops:
      print('   ops by layer: ' + ', '.join(
          f'{k} {v}' for k, v in ops_by_layer(text).items()), flush=True)
    failures += bad
  return 1 if failures else 0


if __name__ == '__main__':
  sys.exit(main())
