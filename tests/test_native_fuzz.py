"""Generated cases of the native code against float64 references, each run
so that a crash fails that case and not the suite.

Convolutions (``conv2d``, as dispatched and as oneDNN's where it is
available) against XLA's float64 convolution of float64 copies of the
inputs, output and both gradients: batch 1-33, spatial sizes 1-40,
channels 1-300, kernels 1-9 (square or not), strides 1-3, 'VALID' and
'SAME', float32 and bfloat16, plain inputs, strided slices and transposes
of larger arrays, inside jit, vmap and grad, eagerly on NumPy views, and
two different convolutions in one jitted step; compiled steps are called
again (twice, the pair four times), reusing oneDNN's primitives on
whichever threads XLA picks. Each case's work (batch *
H * W * C * F * Kh * Kw) is capped at ``WORK_CAP``. A 'VALID' kernel larger
than its input must raise a ValueError. The same cases run again with
oneDNN held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``: its gemm convolutions
take scratch memory that AVX-512 ones do not, where a segfault once hid),
where bfloat16 oneDNN calls must be refused with a clear error.

Fused EM routing kernel: conv capsule routing by the kernel against XLA's
(float64 and float32; values and every gradient) on small random layers,
zero activations and zero poses among them.

Bounds (tests/native_fuzz_worker.py): float32 values within Higham and
Mary's probabilistic bound of a float32 sum of n terms, 10 sqrt(n) 2^-24
times the sum of |terms| (the same convolution of |x|, |kernel|,
|cotangent| in float64): tight enough to see one wrong tap of a 9x9
kernel over 300 channels, which the worst-case n 2^-24 is not. bfloat16
as tests/test_onednn_bf16.py: 2^-8 of |reference| for the final rounding
plus float32 accumulation (at least 2^-14 of the sum of |terms|), plus
2^-8 per kernel tap for XLA's fallback lowerings, which round partial sums
to bfloat16.

The cases run in batches in a worker subprocess
(tests/native_fuzz_worker.py; JSON lines both ways) to share its jax import
and compilations. A worker that dies or hangs fails the case it was running,
named by its shape; a new worker runs the rest, and every failing case is
reported at the end. CAPSJAX_FUZZ_CASES=n runs n convolution cases and
n // 3 EM cases instead of the default 40 and 12; CAPSJAX_FUZZ_DRAW picks
another reproducible stream of cases. The unit tier runs the head of each
stream (a quarter of the convolutions, the pinned shapes and every mode
among them; a third of the EM cases, the degenerate inputs among them),
the slow tier the rest.
"""

import json
import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from capsjax.kernels import em_cpu
from capsjax.kernels.conv import onednn
from tests.conftest import unit_tier_keeps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, 'tests', 'native_fuzz_worker.py')

CONV_CASES = 40
EM_CASES = 12
# batch * H * W * C * F * Kh * Kw of one convolution: 2e7 multiply-adds at
# most for each of the three passes, tens of milliseconds here; compiling
# each new shape (under a second) is the main cost of a case.
WORK_CAP = 20_000_000
# A case's seconds before its worker is taken to hang (jit compilations on
# a busy 2-core machine included).
CASE_TIMEOUT = 300


def _case_counts() -> tuple[int, int]:
  conv = int(os.environ.get('CAPSJAX_FUZZ_CASES', CONV_CASES))
  em = EM_CASES if conv == CONV_CASES else max(conv // 3, 1)
  return conv, em


def _stream() -> int:
  return int(os.environ.get('CAPSJAX_FUZZ_DRAW', 20250127))


# ----------------------------------------------------------------------------
# Cases.


def _log_int(rng, low: int, high: int) -> int:
  """An integer in [low, high], log-uniform: small sizes as often as large."""
  return int(min(high, max(low, round(math.exp(
      rng.uniform(math.log(low), math.log(high + 1)) - 0.5)))))


def _work(shape) -> int:
  return math.prod(shape[n] for n in ('batch', 'h', 'w', 'c', 'f', 'kh',
                                      'kw'))


def _conv_shape(rng, must_fit=False, **fixed) -> dict:
  """A random convolution within WORK_CAP; ``fixed`` sizes are kept."""
  kh = int(rng.integers(1, 10))
  kw = kh if rng.uniform() < 0.7 else int(rng.integers(1, 10))
  shape = dict(batch=_log_int(rng, 1, 33), h=_log_int(rng, 1, 40),
               w=_log_int(rng, 1, 40), c=_log_int(rng, 1, 300),
               f=_log_int(rng, 1, 300), kh=kh, kw=kw,
               stride=int(rng.integers(1, 4)),
               padding=str(rng.choice(['VALID', 'SAME'])))
  shape.update(fixed)
  if shape['padding'] == 'VALID' and 'h' not in fixed and (
      must_fit or rng.uniform() < 0.85):
    # Mostly kernels that fit; the rest must be refused.
    shape['h'] = max(shape['h'], shape['kh'])
    shape['w'] = max(shape['w'], shape['kw'])
  while _work(shape) > WORK_CAP:
    # Halve the largest size not pinned, keeping a fitting kernel fitting.
    floors = dict(batch=1, c=1, f=1, h=1, w=1, kh=1, kw=1)
    if shape['padding'] == 'VALID' and shape['kh'] <= shape['h']:
      floors['h'] = shape['kh']
    if shape['padding'] == 'VALID' and shape['kw'] <= shape['w']:
      floors['w'] = shape['kw']
    free = [n for n in ('batch', 'c', 'f', 'h', 'w')
            if n not in fixed and shape[n] > floors[n]]
    free = free or [n for n in ('kh', 'kw') if n not in fixed and
                    shape[n] > 1]
    if not free:
      break
    name = max(free, key=lambda n: shape[n] / floors[n])
    shape[name] = max(floors[name], shape[name] // 2)
  return shape


# Corners of the ranges, pinned so that every run has them.
_PINNED = [
    dict(c=300, kh=9, kw=9),
    dict(c=300, f=300, kh=3, kw=3, h=5, w=4, batch=1),
    dict(h=1, w=1, padding='SAME', kh=9, kw=9),
    dict(batch=33, stride=3),
    dict(kh=1, kw=1, stride=3, h=40, w=40),
    dict(h=40, w=37, kh=9, kw=8, stride=2, padding='SAME', c=3),
    dict(kh=7, kw=2, h=3, w=9, padding='VALID'),  # taller than the input
]
_MODES = ('jit', 'grad', 'vmap', 'eager', 'pair')
_LAYOUTS = ('plain', 'slice', 'transpose')


def conv_cases(count: int, stream: int) -> list[dict]:
  """``count`` reproducible convolution cases (the worker's conv_check)."""
  rng = np.random.default_rng(stream)
  impls = [None, 'onednn'] if onednn.available() else [None]
  cases = []
  for i in range(count):
    shape = _conv_shape(rng, **(_PINNED[i] if i < len(_PINNED) else {}))
    case = dict(kind='conv', shape=shape, draw=stream + i,
                dtype='bfloat16' if rng.uniform() < 0.3 else 'float32',
                impl=impls[i % len(impls)], mode=_MODES[i % len(_MODES)],
                layout=_LAYOUTS[int(rng.integers(len(_LAYOUTS)))])
    if case['mode'] == 'pair':
      case['shape2'] = _conv_shape(rng, must_fit=True)
    cases.append(case)
  return cases


_EM_OPTIONS = [
    {},
    dict(normalize_cost=True, inverse_temperature=1.0),
    dict(activation_form='authors', center_momentum=0.1,
         variance_epsilon=5e-4),
    dict(inverse_temperature=0.3),
]
_DEGENERATE = ['zero_activations', 'zero_activations',
               'some_zero_activations', 'zero_poses']


def em_cases(count: int, stream: int) -> list[dict]:
  """``count`` reproducible conv capsule routing cases (em_check)."""
  rng = np.random.default_rng(stream + 1)
  cases = []
  for i in range(count):
    k = int(rng.integers(1, 4))
    options = dict(_EM_OPTIONS[int(rng.integers(len(_EM_OPTIONS)))])
    iterations = int(rng.integers(1, 4))
    if options.get('activation_form') == 'authors':
      options['inverse_temperature'] = [
          float(t) for t in rng.uniform(0.2, 2.0, iterations)]
    cases.append(dict(
        kind='em', draw=stream + i, batch=int(rng.integers(1, 3)),
        h=k + int(rng.integers(0, 5)), w=k + int(rng.integers(0, 5)), k=k,
        stride=int(rng.integers(1, 4)), in_types=int(rng.integers(1, 5)),
        out_types=int(rng.integers(1, 6)), iterations=iterations,
        options=options, dtype=('float64', 'float32')[i % 2],
        # The authors' logit has -5000 beta_a: small betas keep it
        # informative (tests/test_em_kernel.py).
        beta_a_scale=1e-3 if 'activation_form' in options else 0.3,
        degenerate=_DEGENERATE[i] if i < len(_DEGENERATE) else None))
  return cases


def describe(case: dict) -> str:
  """The case in a line, enough to rerun it alone."""
  if case['kind'] == 'conv':
    s = case['shape']
    text = (f"conv x[{s['batch']},{s['h']},{s['w']},{s['c']}] "
            f"k[{s['kh']},{s['kw']},{s['c']},{s['f']}] stride {s['stride']} "
            f"{s['padding']} {case['dtype']} impl={case['impl']} "
            f"{case['mode']} {case['layout']}")
    if 'shape2' in case:
      s = case['shape2']
      text += (f" + x[{s['batch']},{s['h']},{s['w']},{s['c']}] "
               f"k[{s['kh']},{s['kw']},{s['c']},{s['f']}] stride "
               f"{s['stride']} {s['padding']}")
    return text
  if case['kind'] == 'em':
    return (f"em poses[{case['batch']},{case['h']},{case['w']},"
            f"{case['in_types']}] k {case['k']} stride {case['stride']} -> "
            f"{case['out_types']} types, {case['iterations']} iterations "
            f"{case['dtype']} {case['options']} {case['degenerate']}")
  return f"{case['kind']} {case}"


# ----------------------------------------------------------------------------
# Running them, crash-isolated.


def _signal_name(returncode: int) -> str:
  if returncode is not None and returncode < 0:
    try:
      return f'killed by {signal.Signals(-returncode).name}'
    except ValueError:
      pass
  return f'exit status {returncode}'


class _Worker:
  """One worker subprocess, its stderr kept in a file for crash reports."""

  def __init__(self, env):
    self.stderr = tempfile.TemporaryFile(mode='w+')
    self.process = subprocess.Popen(
        [sys.executable, WORKER], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
    self.selector = selectors.DefaultSelector()
    self.selector.register(self.process.stdout, selectors.EVENT_READ)

  def run(self, case: dict) -> dict | None:
    """The worker's result, or None when it died or hung on the case."""
    try:
      self.process.stdin.write(json.dumps(case) + '\n')
      self.process.stdin.flush()
    except BrokenPipeError:
      return None
    # One line comes back per case, so nothing waits in the reader's buffer
    # when select says there is nothing to read.
    if not self.selector.select(CASE_TIMEOUT):
      self.process.kill()
      return None
    line = self.process.stdout.readline()
    return json.loads(line) if line else None

  def death(self) -> str:
    """Why the worker is gone, and the end of what it wrote to stderr."""
    try:
      returncode = self.process.wait(timeout=30)
      why = _signal_name(returncode)
    except subprocess.TimeoutExpired:
      self.process.kill()
      why = f'no answer within {CASE_TIMEOUT} s'
    self.stderr.seek(0)
    tail = self.stderr.read()[-1500:].strip()
    return f'worker {why}' + (f'; its stderr ends: {tail}' if tail else '')

  def close(self):
    if self.process.poll() is None:
      self.process.stdin.close()
      try:
        self.process.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
    self.process.stdout.close()
    self.selector.close()
    self.stderr.close()


def run_cases(cases: list[dict], extra_env: dict | None = None
              ) -> list[dict]:
  """Every case's result {'case', 'ok', 'message'}, in order: the cases run
  in one worker process while it lives; a case that kills it (or hangs it
  past CASE_TIMEOUT) fails with the worker's end and the next case starts
  a new one."""
  env = dict(os.environ, **(extra_env or {}))
  # Every compilation into the suite's cache, however short: the same cases
  # run again with oneDNN held to AVX2, and their programs are the same.
  env['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
  # The worker runs as a script: the capsjax under test comes from
  # PYTHONPATH, this checkout's unless the caller's names another.
  env['PYTHONPATH'] = os.pathsep.join(
      p for p in (env.get('PYTHONPATH'), REPO) if p)
  results = []
  worker = None
  try:
    for case in cases:
      if worker is None:
        worker = _Worker(env)
      result = worker.run(case)
      if result is None:
        result = dict(ok=False, message=worker.death())
        worker.close()
        worker = None
      results.append(dict(result, case=case))
  finally:
    if worker is not None:
      worker.close()
  return results


def _assert_all_pass(results, what):
  # How much room the bounds leave, by dtype (bfloat16's final rounding
  # alone may take nearly all of its bound).
  for dtype in sorted({r['case'].get('dtype') for r in results} - {None}):
    closest = max(r.get('closest', 0.0) for r in results
                  if r['case'].get('dtype') == dtype)
    print(f'{what} {dtype}: the closest value came to {closest:.2g} of its '
          f'bound')
  failures = [f"{describe(r['case'])}: {r['message']}" for r in results
              if not r['ok']]
  assert not failures, (f'{len(failures)} of {len(results)} {what} cases '
                        f'failed:\n' + '\n'.join(failures))


# ----------------------------------------------------------------------------
# Tests.


# The head of each stream in the unit tier, the rest in the slow tier.
PARTS = unit_tier_keeps(['head', 'rest'], 'head')


def _part(cases: list[dict], part: str, head: int) -> list[dict]:
  return cases[:head] if part == 'head' else cases[head:]


def _conv_part(part: str) -> list[dict]:
  count, _ = _case_counts()
  # A quarter: the 7 pinned corners and each mode twice (of 40).
  return _part(conv_cases(count, _stream()), part, max(1, count // 4))


def _em_part(part: str) -> list[dict]:
  _, count = _case_counts()
  # A third: the 4 degenerate inputs (of 12).
  return _part(em_cases(count, _stream()), part, max(1, count // 3))


@pytest.mark.parametrize('part', PARTS)
def test_conv_cases_match_float64(part):
  start = time.perf_counter()
  results = run_cases(_conv_part(part))
  print(f'{len(results)} convolution cases in '
        f'{time.perf_counter() - start:.1f} s')
  _assert_all_pass(results, 'convolution')


@pytest.mark.skipif(not onednn.available(),
                    reason=f'oneDNN is {onednn.status()}')
@pytest.mark.parametrize('part', PARTS)
def test_conv_cases_match_float64_with_onednn_held_to_avx2(part):
  start = time.perf_counter()
  # Read by oneDNN when it loads: it has to be in the worker's environment.
  results = run_cases(_conv_part(part), {'ONEDNN_MAX_CPU_ISA': 'AVX2'})
  print(f'{len(results)} convolution cases (AVX2) in '
        f'{time.perf_counter() - start:.1f} s')
  _assert_all_pass(results, 'convolution (oneDNN held to AVX2)')


@pytest.mark.skipif(not em_cpu.available(),
                    reason=f'EM kernel {em_cpu.status()}')
@pytest.mark.parametrize('part', PARTS)
def test_em_kernel_cases_match_xla(part):
  start = time.perf_counter()
  results = run_cases(_em_part(part))
  print(f'{len(results)} EM cases in {time.perf_counter() - start:.1f} s')
  _assert_all_pass(results, 'EM routing')


def test_a_crashing_case_fails_alone_and_the_next_runs():
  small = dict(kind='conv', shape=dict(batch=1, h=4, w=4, c=2, f=3, kh=2,
                                       kw=2, stride=1, padding='SAME'),
               draw=0, dtype='float32', impl=None, mode='jit',
               layout='plain')
  crash = dict(kind='crash', signal='SIGSEGV', note='the deliberate one')
  results = run_cases([small, crash, dict(small, draw=1),
                       dict(crash, signal='SIGABRT'), small])
  assert [r['ok'] for r in results] == [True, False, True, False, True]
  assert 'killed by SIGSEGV' in results[1]['message']
  assert 'killed by SIGABRT' in results[3]['message']
  with pytest.raises(AssertionError) as failure:
    _assert_all_pass(results, 'convolution')
  # The report names each failing case, and only those.
  report = str(failure.value)
  assert '2 of 5 convolution cases failed' in report
  assert "'note': 'the deliberate one'" in report and 'SIGSEGV' in report
  assert 'conv x[' not in report
