"""tools/run_tests.py, the test command CI runs (the unit tier, then the
native files as on an AVX2 CPU) and with --all the whole suite: the timed
part at the caller's priority, the others beside it at a lower one, every
failure reported."""

import importlib.util
import os
import sys
import time

import pytest

from tests import conftest

spec = importlib.util.spec_from_file_location(
    'run_tests', os.path.join(conftest.REPO, 'tools', 'run_tests.py'))
run_tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_tests)

# A stand-in for pytest (a part's process: a few milliseconds where a real
# pytest takes a second to start) that records where it ran: its nice, its
# session and its session's autogroup nice (where the kernel has
# autogroups), and prints a pytest-like summary.
_RECORDER = '''
import os, sys, time
name = os.environ['PART']
out = os.environ['OUT']
# '/autogroup-N nice K' where the kernel has autogroups; some kernels
# (sandboxes among them) have no file, or an empty one.
try:
  fields = open('/proc/self/autogroup').read().split()
except OSError:
  fields = []
autogroup = fields[-1] if len(fields) == 3 and fields[1] == 'nice' else 'none'
with open(os.path.join(out, name + '.started'), 'w') as f:
  f.write(f'{os.nice(0)} {os.getsid(0)} {autogroup}')
if name == 'timed':  # still running when the unit part starts
  deadline = time.monotonic() + 60
  while not os.path.exists(os.path.join(out, 'unit.started')):
    if time.monotonic() > deadline:
      print('the parts ran one after the other; 1 failed')
      sys.exit(1)
    time.sleep(0.05)
failed = name == os.environ.get('FAIL')
print('1 failed' if failed else '1 passed')
sys.exit(1 if failed else 0)
'''


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
  recorder = tmp_path / 'recorder.py'
  recorder.write_text(_RECORDER)
  out = tmp_path / 'out'
  out.mkdir()
  monkeypatch.setattr(run_tests, 'PYTEST', (sys.executable, str(recorder)))
  monkeypatch.setattr(run_tests, 'PARTS', {
      name: ((), {'PART': name, 'OUT': str(out)})
      for name in ('timed', 'unit', 'avx2', 'slow')})
  return out


def _recorded(out, name):
  nice, session, autogroup = (out / f'{name}.started').read_text().split()
  return int(nice), int(session), autogroup


def test_the_timed_part_runs_beside_the_others_at_a_higher_priority(
    fake_parts, tmp_path, capfd):
  assert run_tests.run(False, str(tmp_path / 'logs')) == 0
  own = os.nice(0)
  timed = _recorded(fake_parts, 'timed')
  assert timed[0] == own and timed[1] == os.getsid(0)
  for name in ('unit', 'avx2', 'slow'):
    nice, session, autogroup = _recorded(fake_parts, name)
    assert nice == min(19, own + run_tests.BACKGROUND_NICENESS), name
    assert session not in (os.getsid(0), timed[1]), name
    if autogroup != 'none':  # the session's own share lowered too
      assert int(autogroup) == run_tests.BACKGROUND_NICENESS, name
  printed = capfd.readouterr().out
  assert 'unit passed, avx2 passed, slow passed, timed passed' in printed
  for name in ('timed', 'unit', 'avx2', 'slow'):
    assert f'[{name}] exit status 0' in printed
  # Each part's pytest summary printed: the background parts' as it came,
  # the timed part's from its log.
  assert printed.count('1 passed') == 4
  assert '1 passed' in (tmp_path / 'logs' / 'timed.log').read_text()


@pytest.mark.parametrize('failing', ['unit', 'timed'])
def test_a_failing_part_fails_the_run_and_the_others_still_run(
    fake_parts, tmp_path, monkeypatch, capfd, failing):
  monkeypatch.setenv('FAIL', failing)
  start = time.monotonic()
  assert run_tests.run(False, str(tmp_path / 'logs')) == 1
  assert time.monotonic() - start < 120
  printed = capfd.readouterr().out
  assert f'{failing} FAILED' in printed
  assert f'[{failing}] exit status 1' in printed
  for name in ('timed', 'unit', 'avx2', 'slow'):
    assert (fake_parts / f'{name}.started').exists(), name


def test_serial_runs_every_part_at_the_callers_priority(fake_parts, tmp_path):
  # The timed part last, so it finds the unit part's record.
  assert run_tests.run(True, str(tmp_path / 'logs')) == 0
  for name in ('unit', 'avx2', 'slow', 'timed'):
    assert _recorded(fake_parts, name)[:2] == (os.nice(0), os.getsid(0))


def test_ci_runs_the_unit_tier_then_the_native_files(fake_parts, tmp_path,
                                                     capfd):
  """Without --all: unit and avx2, one after the other, at the caller's
  priority; neither the slow tier nor the timed run."""
  assert run_tests.run(False, str(tmp_path / 'logs'), everything=False) == 0
  for name in ('unit', 'avx2'):
    assert _recorded(fake_parts, name)[:2] == (os.nice(0), os.getsid(0))
  for name in ('slow', 'timed'):
    assert not (fake_parts / f'{name}.started').exists(), name
  assert 'unit passed, avx2 passed.' in capfd.readouterr().out


def test_the_unit_tier_leaves_out_the_slow_tier():
  assert run_tests.PARTS['unit'][0][:4] == ('-n', '2', '-m', 'not slow')
  assert 'slow and not alone' in run_tests.PARTS['slow'][0]


def test_the_readme_runs_it_and_the_native_files_exist():
  readme = open(os.path.join(conftest.REPO, 'README.md')).read()
  command = readme.split('<!-- test-command -->')[1].split('```')[1]
  assert command.strip().endswith('python tools/run_tests.py')
  for path in run_tests.NATIVE_TEST_FILES:
    assert os.path.isfile(os.path.join(conftest.REPO, path)), path
