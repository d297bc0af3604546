"""Run the test suite: what CI runs, or all of it with the slow tier.

    python tools/run_tests.py                  # what CI runs (README's test command)
    python tools/run_tests.py --all            # and the slow tier beside it
    python tools/run_tests.py --all --serial   # every part, one after another

The suite has four parts:

- ``unit``: every test but the slow tier, on two pytest-xdist workers
  (what a contributor runs after each change, ``pytest -n 2 -m "not
  slow"``);
- ``avx2``: the native code's test files again, with oneDNN held to AVX2
  and the EM kernel built for x86-64-v2, as on an AVX2-only CPU, and the
  tests of builds and kernels for other CPUs (tests/test_native_isa.py,
  whose subprocesses are the slow tier's otherwise);
- ``slow`` (``--all``): the long integration tests (training runs on 1, 2
  and 8 devices and in two processes, experiments end to end), on two
  workers;
- ``timed`` (``--all``): the reproduction suite's smoke run (the ``alone``
  marker), whose CapsNet and EM models must learn within a time limit.

CI runs ``unit`` and then ``avx2``. With ``--all`` the timed part runs at
the normal priority while the others run one after the other beside it,
in a session of their own at ``nice`` 19. On a
2-core machine the smoke run alone keeps only part of the CPU busy (each
of its experiments starts a process and compiles, mostly on one core); the
others take the rest, while the smoke models' training keeps nearly all of
the CPU it asks for (Linux gives a nice-0 session or thread about 70 times
the share of a nice-19 one), and with it its time limits. Side by side and
one after another on a 2-core machine: results/ci/README.md. The other
parts' output comes as it is written, the timed part's once it has ended
(it is kept in a log meanwhile); the exit status is 1 if any part failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE_TEST_FILES = ('tests/test_onednn.py', 'tests/test_onednn_bf16.py',
                     'tests/test_cpu_convolutions.py',
                     'tests/test_em_kernel.py', 'tests/test_native_isa.py')
PYTEST = (sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider')
# name -> (pytest arguments, extra environment)
PARTS = {
    'timed': (('-m', 'alone', '-rP', '--durations=0'), {}),
    'unit': (('-n', '2', '-m', 'not slow', '--durations=40'), {}),
    'slow': (('-n', '2', '-m', 'slow and not alone', '--durations=20'), {}),
    'avx2': (('-n', '2', '--durations=20', *NATIVE_TEST_FILES),
             {'ONEDNN_MAX_CPU_ISA': 'AVX2',
              'CAPSJAX_NATIVE_ARCH': 'x86-64-v2'}),
}
BACKGROUND_NICENESS = 19


def _lower_priority(niceness: int) -> None:
  """In the child before it runs: its own session at ``niceness``. Where
  the kernel schedules by session ("autogroup", the default of many Linux
  distributions) a process's nice counts only against its own session, and
  each experiment of the smoke run is a session of its own: so the nice of
  the new session itself is set too."""
  os.setsid()
  try:
    with open('/proc/self/autogroup', 'w') as f:
      f.write(str(niceness))
  except OSError:  # no autogroup scheduling: the process's nice is enough
    pass
  os.nice(niceness)


def _start(name: str, niceness: int, started: list[subprocess.Popen],
           log_path: str | None = None) -> tuple:
  """Starts part ``name`` (appended to ``started``): its output to the
  terminal as it comes, or to ``log_path`` (printed by ``_finish``)."""
  args, extra_env = PARTS[name]
  log = open(log_path, 'w') if log_path else None
  process = subprocess.Popen(
      PYTEST + args, cwd=REPO, env=dict(os.environ, **extra_env), stdout=log,
      stderr=subprocess.STDOUT if log else None,
      preexec_fn=(lambda: _lower_priority(niceness)) if niceness else None)
  started.append(process)
  print(f'[{name}] started: pytest {" ".join(args)}'
        f'{f" at nice {niceness}" if niceness else ""}'
        f'{f", its output to {log_path}" if log else ""}', flush=True)
  return process, log, time.monotonic()


def _finish(name: str, started: tuple) -> int:
  process, log, start = started
  returncode = process.wait()
  seconds = time.monotonic() - start
  print(f'\n===== [{name}] exit status {returncode} in {seconds:.1f} s '
        '=====', flush=True)
  if log:
    log.close()
    with open(log.name) as f:
      sys.stdout.write(f.read())
    sys.stdout.flush()
  return returncode


def run(serial: bool, log_dir: str, everything: bool = True) -> int:
  os.makedirs(log_dir, exist_ok=True)
  start = time.monotonic()
  statuses, started = {}, []
  try:
    if everything:
      _run_parts(serial, log_dir, statuses, started)
    else:
      for name in ('unit', 'avx2'):
        statuses[name] = _finish(name, _start(name, 0, started))
  except KeyboardInterrupt:
    # Ctrl-C reached the timed part (the terminal's process group); the
    # others are sessions of their own.
    for process in started:
      with contextlib.suppress(ProcessLookupError):  # ended meanwhile
        if os.getpgid(process.pid) == process.pid:
          os.killpg(process.pid, signal.SIGINT)
    for process in started:
      try:
        process.wait(timeout=60)
      except subprocess.TimeoutExpired:
        process.kill()
    print(f'\nInterrupted; the timed part\'s log: {log_dir}/timed.log',
          flush=True)
    return 130
  print(f'\nTests finished in {time.monotonic() - start:.1f} s: ' +
        ', '.join(f'{name} {"passed" if status == 0 else "FAILED"}'
                  for name, status in statuses.items()) +
        '.', flush=True)
  return 0 if all(status == 0 for status in statuses.values()) else 1


def _run_parts(serial: bool, log_dir: str, statuses: dict,
               started: list[subprocess.Popen]) -> None:
  if serial:
    for name in ('unit', 'avx2', 'slow', 'timed'):
      statuses[name] = _finish(name, _start(name, 0, started))
    return
  # The timed part's output waits in its log, so as not to interleave.
  timed = _start('timed', 0, started, os.path.join(log_dir, 'timed.log'))
  for name in ('unit', 'avx2', 'slow'):
    statuses[name] = _finish(name, _start(name, BACKGROUND_NICENESS, started))
  statuses['timed'] = _finish('timed', timed)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--all', action='store_true',
                      help='also the slow tier and the timed smoke run')
  parser.add_argument('--serial', action='store_true',
                      help='with --all: run the parts one after another')
  parser.add_argument('--log_dir', default=None,
                      help='where the timed part writes its log (default: a '
                      'new temporary directory)')
  args = parser.parse_args()
  return run(args.serial,
             args.log_dir or tempfile.mkdtemp(prefix='capsjax-tests-'),
             everything=args.all)


if __name__ == '__main__':
  sys.exit(main())
