"""Worker process of tests/test_native_fuzz.py: runs generated cases of the
native code (oneDNN convolutions through ``conv2d``, the fused EM routing
kernel) against float64 references, one case at a time.

Protocol: one JSON case description a line on stdin, one JSON result a line
back ({"ok": bool, "message": str, "closest": the largest error / bound
of its values}), in order. The test runs
this in a subprocess so that a crash of native code ends this process only:
the test names the case it was running and starts a new worker for the rest.
Run as a script (its folder need not be a package), with the capsjax to test
on PYTHONPATH.

Kinds of case: 'conv' (``conv_check``), 'em' (``em_check``) and 'crash' (the
process kills itself by a signal, so that the test can show a crash becomes
one failing case).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import traceback

# The protocol's own stream, before anything can print: whatever jax, XLA or
# the native code write to stdout goes to stderr instead, and cannot be
# taken for a result.
_RESULTS = os.fdopen(os.dup(1), 'w')
os.dup2(2, 1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from capsjax import kernels  # noqa: E402
from capsjax.kernels.conv import lowerings  # noqa: E402
from capsjax.kernels.conv import onednn  # noqa: E402

F32_EPS = 2.0**-24  # float32's unit roundoff
# bfloat16's unit roundoff (8 significant bits): its final rounding's
# relative error is below it, and may come close.
BF16_EPS = 2.0**-8
ACCUMULATION = 2.0**-14  # float32 sums of <= 1024 terms: the same docstring
# Higham and Mary's probabilistic bound on a float32 sum of n terms, whatever
# the order: |error| <= LAMBDA sqrt(n) u (sum of |terms|), failing with
# probability below 2 n exp(-LAMBDA^2 / 2) per value (about 1e-17 at
# n = 50,000). The worst-case bound n u is too loose to notice a wrong
# kernel tap of a 9x9 kernel over 300 channels (about 1/(81 sqrt(300)) of
# the sum of |terms|, 7e-4, against n u = 1.4e-3); this one is 9e-5 there.
LAMBDA = 10.0


def _f32_sum_bound(terms: int) -> float:
  """A bound on a float32 sum's error relative to its sum of |terms|."""
  return LAMBDA * math.sqrt(max(terms, 1)) * F32_EPS


# ----------------------------------------------------------------------------
# Convolutions.


def _pads(size: int, kernel_size: int, stride: int, padding: str):
  return lowerings._conv_padding(size, kernel_size, stride, padding)  # pylint: disable=protected-access


def _out_shape(shape: dict):
  pads = (_pads(shape['h'], shape['kh'], shape['stride'], shape['padding']),
          _pads(shape['w'], shape['kw'], shape['stride'], shape['padding']))
  return onednn.output_shape(
      (shape['batch'], shape['h'], shape['w'], shape['c']),
      (shape['kh'], shape['kw'], shape['c'], shape['f']), shape['stride'],
      pads)


def _fits(shape: dict) -> bool:
  """Whether the kernel fits the padded input ('SAME' always pads enough)."""
  return shape['padding'] == 'SAME' or (shape['kh'] <= shape['h'] and
                                        shape['kw'] <= shape['w'])


def _reference(x, kernel, cotangent, stride, padding):
  """XLA's float64 convolution of float64 copies, and its two gradients."""
  with jax.enable_x64(True):
    def conv(x, kernel):
      return jax.lax.conv_general_dilated(
          x, kernel, (stride, stride), padding,
          dimension_numbers=('NHWC', 'HWIO', 'NHWC'))

    def run(x, kernel, cotangent):
      out, vjp = jax.vjp(conv, x, kernel)
      return (out, *vjp(cotangent))

    args = [np.asarray(a, np.float64) for a in (x, kernel, cotangent)]
    run = jax.jit(run)
    values = [np.asarray(a) for a in run(*args)]
    # The same sums of |terms|: the scale of each value's rounding error.
    sizes = [np.asarray(a) for a in run(*(np.abs(a) for a in args))]
  return values, sizes


def _inputs(rng, shape: dict, dtype, layout: str):
  """(what the function under test is given, how it gets x and the kernel
  from that inside, x, kernel): x [B, H, W, C] and the kernel [Kh, Kw, C, F]
  as plain arrays, or (``layout``) as a strided slice of a larger array or a
  transpose of an NCHW input and OIHW kernel."""
  b, h, w, c, f = (shape[n] for n in ('batch', 'h', 'w', 'c', 'f'))
  kh, kw = shape['kh'], shape['kw']
  # Unit-variance outputs: the kernel scaled by 1/sqrt(its fan in).
  scale = 1.0 / math.sqrt(kh * kw * c)

  def draw(dims, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(dims), dtype)

  if layout == 'slice':
    big_x = draw((b + 1, h + 3, 2 * w + 1, c + 2))
    big_k = draw((kh + 1, kw, c + 1, 2 * f), scale)
    take = lambda bx, bk: (bx[1:, 2:2 + h, 1:1 + 2 * w:2, 1:1 + c],
                           bk[1:, :, :c, ::2])
    operands = (big_x, big_k)
  elif layout == 'transpose':
    nchw, oihw = draw((b, c, h, w)), draw((f, c, kh, kw), scale)
    take = lambda xt, kt: (jnp.transpose(xt, (0, 2, 3, 1)),
                           jnp.transpose(kt, (2, 3, 1, 0)))
    operands = (nchw, oihw)
  else:
    operands = (draw((b, h, w, c)), draw((kh, kw, c, f), scale))
    take = lambda x, k: (x, k)
  x, kernel = take(*operands)
  return operands, take, np.asarray(x, np.float64), np.asarray(kernel,
                                                               np.float64)


def _numpy_views(operands, layout):
  """The operands as NumPy views (not contiguous copies) of what ``take``
  would compute, for the eager calls."""
  a, b = (np.asarray(o) for o in operands)
  if layout == 'transpose':
    return a.transpose(0, 2, 3, 1), b.transpose(2, 3, 1, 0)
  if layout == 'slice':
    c, f2 = a.shape[3] - 2, b.shape[3]
    return (a[1:, 2:a.shape[1] - 1, 1:a.shape[2]:2, 1:1 + c],
            b[1:, :, :c, :f2:2])
  return a, b


def _bound(dtype, terms: int, partial_sums: int):
  """(relative to |reference|, relative to the sum of |terms|)."""
  if jnp.dtype(dtype) == jnp.bfloat16:
    # tests/test_onednn_bf16.py: one final rounding, float32 accumulation,
    # and for XLA's fallback lowerings one bfloat16 rounding per partial sum.
    return BF16_EPS, (max(ACCUMULATION, _f32_sum_bound(terms)) +
                      partial_sums * BF16_EPS)
  return 0.0, _f32_sum_bound(terms)


# How close each compared array came to its bound (error / bound, largest
# entry), for the case's report: how much room the bounds leave.
_closest: list[float] = []


def _compare(name, got, reference, size, dtype, terms, partial_sums, shape):
  """'' if ``got`` is within the bound of ``reference``, else why not."""
  got = np.asarray(np.asarray(got, np.float32), np.float64)
  if got.shape != reference.shape:
    return f'{name}: shape {got.shape}, expected {reference.shape}'
  relative, accumulation = _bound(dtype, terms, partial_sums)
  bound = relative * np.abs(reference) + accumulation * size
  error = np.abs(got - reference)
  with np.errstate(divide='ignore', invalid='ignore'):
    ratio = np.where(error == 0, 0.0, error / bound)
  _closest.append(float(np.max(ratio, initial=0.0)))
  # Written so that NaN fails too.
  bad = ~(error <= bound)
  if np.any(bad):
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    return (f'{name} of {shape}: {int(bad.sum())} of {bad.size} values past '
            f'the bound, first at {index}: {got[index]!r} against '
            f'{reference[index]!r} (bound {bound[index]:.3g})')
  return ''


def _partial_sums(shape, dtype, impl_used: str) -> int:
  """bfloat16 roundings of partial sums XLA's fallback lowerings may make
  (a product per kernel tap, added in place); none for oneDNN, which
  accumulates in float32."""
  if jnp.dtype(dtype) != jnp.bfloat16 or impl_used == 'onednn':
    return 0
  return shape['kh'] * shape['kw']


def _terms(shape) -> tuple[int, int, int]:
  """Terms summed for one value of the output, input gradient, kernel
  gradient (the padding's zero terms included)."""
  _, out_h, out_w, _ = _out_shape(shape)
  taps = shape['kh'] * shape['kw']
  return (taps * shape['c'], taps * shape['f'],
          shape['batch'] * out_h * out_w)


def _expects_bf16_refusal(dtype, impl) -> bool:
  return (jnp.dtype(dtype) == jnp.bfloat16 and impl == 'onednn' and
          not onednn.native_bf16())


def _one_conv(shape, impl):
  """The convolution of ``impl``: None, the default choice
  (``kernels.conv2d``); else that lowering."""
  stride, padding = shape['stride'], shape['padding']
  if impl is None:
    return lambda x, k: kernels.conv2d(x, k, stride, padding)
  return lambda x, k: lowerings.conv2d(x, k, stride, padding, impl)


def _repeated(fn, *args, times=2):
  """The results of ``times`` calls of ``fn``: the later ones reuse the
  compiled code and oneDNN's cached primitives, maybe on other threads
  than the ones that made them (where oneDNN's per-thread scratchpad
  once segfaulted)."""
  return [fn(*args) for _ in range(times)]


def _check_results(shape, dtype, impl, runs, x64, k64, dy64):
  """Compares (out, gx, gk) of one convolution, from each of ``runs``,
  with the float64 ones."""
  refs, sizes = _reference(x64, k64, dy64, shape['stride'], shape['padding'])
  impl_used = impl or ('onednn' if onednn.computes(dtype) else 'xla')
  partial = _partial_sums(shape, dtype, impl_used)
  messages = []
  for run, results in enumerate(runs):
    for name, got, ref, size, terms in zip(
        ('output', 'input gradient', 'kernel gradient'), results, refs,
        sizes, _terms(shape), strict=True):
      name = f'{name} (call {run + 1})'
      if jnp.dtype(got.dtype) != jnp.dtype(dtype):
        messages.append(f'{name} is {got.dtype}, not {jnp.dtype(dtype)}')
      messages.append(_compare(name, got, ref, size, dtype, terms, partial,
                               shape))
  return [m for m in messages if m]


def conv_check(case: dict) -> tuple[list[str], str]:
  """(what is wrong, a note) for one 'conv' case.

  case: 'shape' {batch, h, w, c, f, kh, kw, stride, padding}, 'dtype',
  'impl' (None or 'onednn'), 'mode' ('jit', 'grad', 'vmap', 'eager' or
  'pair' with a second 'shape2'), 'layout' ('plain', 'slice',
  'transpose') and 'draw' (the random stream).
  """
  rng = np.random.default_rng(case['draw'])
  shape, dtype, impl = case['shape'], jnp.dtype(case['dtype']), case['impl']
  mode, layout = case['mode'], case['layout']
  if not _fits(shape):
    x = jnp.zeros((shape['batch'], shape['h'], shape['w'], shape['c']), dtype)
    kernel = jnp.zeros((shape['kh'], shape['kw'], shape['c'], shape['f']),
                       dtype)
    try:
      out = jax.jit(_one_conv(shape, impl))(x, kernel)
    except ValueError as error:
      if 'kernel' in str(error):
        return [], 'refused: the kernel exceeds the input'
      raise
    return [f'a kernel larger than the input gave {out.shape} instead of a '
            f'ValueError'], ''
  if _expects_bf16_refusal(dtype, impl):
    x = jnp.zeros((shape['batch'], shape['h'], shape['w'], shape['c']), dtype)
    kernel = jnp.zeros((shape['kh'], shape['kw'], shape['c'], shape['f']),
                       dtype)
    try:
      jax.jit(_one_conv(shape, impl))(x, kernel)
    except ValueError as error:
      if 'no bfloat16 instructions' in str(error):
        return [], 'refused: no bfloat16 kernels on this CPU'
      raise
    return ['oneDNN computed bfloat16 on a CPU without bfloat16 kernels'], ''

  conv = _one_conv(shape, impl)
  operands, take, x64, k64 = _inputs(rng, shape, dtype, layout)
  dy = jnp.asarray(rng.standard_normal(_out_shape(shape)), dtype)
  dy64 = np.asarray(dy, np.float64)

  if mode == 'vmap':
    # Two instances, each its own input, kernel and cotangent.
    second, _, x64b, k64b = _inputs(rng, shape, dtype, layout)
    dyb = jnp.asarray(rng.standard_normal(_out_shape(shape)), dtype)
    stacked = [jnp.stack(pair) for pair in zip(operands, second, strict=True)]

    def one(a, b, dy):
      out, vjp = jax.vjp(lambda a, b: conv(*take(a, b)), a, b)
      return out, *vjp(dy)

    runs = _repeated(jax.jit(jax.vmap(one)), *stacked, jnp.stack([dy, dyb]))
    # The gradients come back in the operands' layout: ``take`` is linear
    # and picks each entry at most once, so it maps them to x's and the
    # kernel's too.
    messages = []
    for i, (xi, ki, dyi) in enumerate(((x64, k64, dy64),
                                       (x64b, k64b,
                                        np.asarray(dyb, np.float64)))):
      instance = [(out[i], *take(ga[i], gb[i])) for out, ga, gb in runs]
      messages += [f'vmap instance {i}: {m}' for m in _check_results(
          shape, dtype, impl, instance, xi, ki, dyi)]
    return messages, ''
  if mode == 'pair':
    # Two different convolutions in one jitted step, independent of each
    # other so that XLA may run them on different threads.
    shape2 = case['shape2']
    conv2 = _one_conv(shape2, impl)
    x2 = jnp.asarray(rng.standard_normal(
        (shape2['batch'], shape2['h'], shape2['w'], shape2['c'])), dtype)
    k2 = jnp.asarray(rng.standard_normal(
        (shape2['kh'], shape2['kw'], shape2['c'], shape2['f'])) /
        math.sqrt(shape2['kh'] * shape2['kw'] * shape2['c']), dtype)
    dy2 = jnp.asarray(rng.standard_normal(_out_shape(shape2)), dtype)

    def step(a, b, x2, k2, dy, dy2):
      f = lambda a, b, x2, k2: (conv(*take(a, b)), conv2(x2, k2))
      outs, vjp = jax.vjp(f, a, b, x2, k2)
      return outs, vjp((dy, dy2))

    # Called more often than the other modes: which thread runs which
    # convolution changes from call to call.
    runs = _repeated(jax.jit(step), *operands, x2, k2, dy, dy2, times=4)
    first = [(out, *take(ga, gb)) for (out, _), (ga, gb, _, _) in runs]
    second = [(out2, gx2, gk2) for (_, out2), (_, _, gx2, gk2) in runs]
    return (_check_results(shape, dtype, impl, first, x64, k64, dy64)
            + [f'second convolution {shape2}: {m}' for m in _check_results(
                shape2, dtype, impl, second,
                np.asarray(x2, np.float64), np.asarray(k2, np.float64),
                np.asarray(dy2, np.float64))]), ''
  if mode == 'eager':
    # No jit: NumPy views straight into conv2d, gradients by jax.vjp.
    x_view, k_view = _numpy_views(operands, layout)
    out, vjp = jax.vjp(conv, x_view, k_view)
    runs = [(out, *vjp(dy))]
  elif mode == 'grad':
    def loss(a, b):
      return jnp.sum(conv(*take(a, b)).astype(jnp.float32) *
                     dy.astype(jnp.float32))
    outs = _repeated(jax.jit(lambda a, b: conv(*take(a, b))), *operands)
    grads = _repeated(jax.jit(jax.grad(loss, argnums=(0, 1))), *operands)
    runs = [(out, *take(*g)) for out, g in zip(outs, grads, strict=True)]
  else:  # 'jit'
    def run(a, b, dy):
      out, vjp = jax.vjp(lambda a, b: conv(*take(a, b)), a, b)
      return out, vjp(dy)
    runs = [(out, *take(ga, gb))
            for out, (ga, gb) in _repeated(jax.jit(run), *operands, dy)]
  return _check_results(shape, dtype, impl, runs, x64, k64, dy64), ''


# ----------------------------------------------------------------------------
# The fused EM routing kernel.


def _em_inputs(case: dict, dtype):
  rng = np.random.default_rng(case['draw'])
  b, h, w = case['batch'], case['h'], case['w']
  k, cin, cout = case['k'], case['in_types'], case['out_types']
  poses = rng.normal(size=(b, h, w, cin, 4, 4))
  acts = rng.uniform(0.05, 1.0, size=(b, h, w, cin))
  weights = rng.normal(size=(k, k, cin, cout, 4, 4)) * 0.5
  beta_u = rng.normal(size=cout) * 0.3
  beta_a = rng.normal(size=cout) * case['beta_a_scale']
  degenerate = case.get('degenerate')
  if degenerate == 'zero_activations':
    acts = np.zeros_like(acts)
  elif degenerate == 'some_zero_activations':
    acts = np.where(rng.uniform(size=acts.shape) < 0.5, 0.0, acts)
  elif degenerate == 'zero_poses':
    poses = np.zeros_like(poses)
  return tuple(np.asarray(a, dtype) for a in (poses, acts, weights, beta_u,
                                               beta_a))


def _em_loss_and_grads(inputs, impl, options, stride):
  def loss(poses, acts, *params):
    out_poses, out_acts, assignments = kernels.conv_capsule_routing(
        poses, acts, *params, stride=stride, implementation=impl, **options)
    return (jnp.sum(jnp.sin(out_poses) * out_acts[..., None, None]) +
            jnp.sum(jnp.cos(assignments)), (out_poses, out_acts, assignments))

  value = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4),
                                     has_aux=True))(*inputs)
  return [np.asarray(a, np.float64) for a in jax.tree.leaves(value)]


_EM_NAMES = ('loss', 'out poses', 'out activations', 'assignments',
             'gradient of poses', 'gradient of activations',
             'gradient of weights', 'gradient of beta_u', 'gradient of beta_a')


def em_check(case: dict) -> tuple[list[str], str]:
  """(what is wrong, a note) for one 'em' case: conv capsule routing by the
  fused kernel against XLA's, values and all five gradients.

  float64: the two agree to 1e-9 relative (tests/test_em_kernel.py).
  float32: the kernel is compared with XLA's float64 routing of the same
  float32 values, within 2e-5 of each array's largest entry (the float32
  kernel measured within 2e-6 in tests/test_em_kernel.py) or, where the
  routing is ill-conditioned, within 10 times XLA's own float32 error
  (measured up to 2.5 times: the two sum in different orders, and three
  iterations amplify the difference).
  """
  dtype = np.dtype(case['dtype'])
  options = dict(case['options'], num_iterations=case['iterations'])
  if isinstance(options.get('inverse_temperature'), list):
    # One per iteration (JSON has no tuples).
    options['inverse_temperature'] = tuple(options['inverse_temperature'])
  inputs = _em_inputs(case, dtype)
  stride = case['stride']
  messages = []
  if dtype == np.float64:
    with jax.enable_x64(True):
      got = _em_loss_and_grads(inputs, 'native', options, stride)
      want = _em_loss_and_grads(inputs, 'xla', options, stride)
  else:
    got = _em_loss_and_grads(inputs, 'native', options, stride)
    with jax.enable_x64(True):
      want = _em_loss_and_grads(tuple(np.asarray(a, np.float64)
                                      for a in inputs), 'xla', options,
                                stride)
  xla32 = None
  for i, (name, g, w) in enumerate(zip(_EM_NAMES, got, want, strict=True)):
    if g.shape != w.shape:
      messages.append(f'{name}: shape {g.shape}, expected {w.shape}')
      continue
    if not np.all(np.isfinite(g)):
      messages.append(f'{name}: not finite where XLA gives '
                      f'{"finite" if np.all(np.isfinite(w)) else "non-finite"}'
                      ' values')
      continue
    scale = float(np.max(np.abs(w), initial=0.0))
    error = float(np.max(np.abs(g - w), initial=0.0))
    if dtype == np.float64:
      bound = 1e-12 + 1e-9 * np.abs(w)
      _closest.append(float(np.max(np.abs(g - w) / bound, initial=0.0)))
      ok = _closest[-1] <= 1
    else:
      bound = 2e-5 * scale
      if error > bound:
        if xla32 is None:
          xla32 = _em_loss_and_grads(inputs, 'xla', options, stride)
        bound = max(bound, 10 * float(np.max(np.abs(xla32[i] - w),
                                             initial=0.0)))
        print(f'{name}: kernel off by {error:.3g}, XLA float32 by '
              f'{bound / 10:.3g} (largest value {scale:.3g})', file=sys.stderr)
      _closest.append(error / bound if error else 0.0)
      ok = error <= bound
    if not ok:
      messages.append(f'{name}: kernel off by {error:.3g} (largest value '
                      f'{scale:.3g})')
  assignments = got[3]
  # Each child's assignments over the parents sum to 1.
  if not np.allclose(assignments.sum(-1), 1.0, atol=1e-5):
    messages.append('assignments do not sum to 1 over the parents')
  return messages, ''


# ----------------------------------------------------------------------------


def run_case(case: dict) -> dict:
  kind = case['kind']
  if kind == 'crash':
    # As a segfault in native code would end the process.
    os.kill(os.getpid(), getattr(signal, case.get('signal', 'SIGSEGV')))
  check = {'conv': conv_check, 'em': em_check}[kind]
  _closest.clear()
  try:
    messages, note = check(case)
  except Exception:  # pylint: disable=broad-except
    return {'ok': False, 'message': traceback.format_exc(limit=4)}
  return {'ok': not messages, 'message': '; '.join(messages) or note,
          'closest': max(_closest, default=0.0)}


def main():
  for line in sys.stdin:
    if not line.strip():
      continue
    result = run_case(json.loads(line))
    _RESULTS.write(json.dumps(result) + '\n')
    _RESULTS.flush()


if __name__ == '__main__':
  main()
