"""The prepared GPU session: its script parses, and the step profiler it
runs prints a sensible table on this CPU."""

import os
import re
import shutil
import subprocess

import pytest

from benchmarks import profile_step

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which('bash') is None, reason='needs bash')
@pytest.mark.parametrize('script', ['benchmarks/gpu_session.sh',
                                    'tools/gpu_train.sh'])
def test_gpu_scripts_parse(script):
  result = subprocess.run(['bash', '-n', os.path.join(_ROOT, script)],
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which('bash') is None, reason='needs bash')
def test_gpu_train_refuses_before_starting_anything(tmp_path):
  script = os.path.join(_ROOT, 'tools', 'gpu_train.sh')
  env = dict(os.environ, CPU_DRY_RUN='1', OUT=str(tmp_path / 'out'))
  for args, message in (([], 'usage: gpu_train.sh MAX_SECONDS NAME'),
                        (['60'], '1 to 6 run names'),
                        (['60', 'capsnet_mnist_annealed'], 'no .data/mnist')):
    result = subprocess.run(['bash', script, *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, check=False)
    assert result.returncode != 0 and message in result.stderr, result
  assert not (tmp_path / 'out').exists()


@pytest.mark.slow  # a profile of a train step: the GPU session's
def test_profile_step_table_on_cpu():
  result = profile_step.profile('capsnet_mnist:smoke', batch_size=2, steps=2,
                                warmup=1)
  assert result['ops'], result
  assert result['step_s'] > 0 and result['span_ns'] > 0
  text = profile_step.table(result, top=10)
  rows = [line for line in text.splitlines()
          if re.match(r'\s*\d+\s+\d+\.\d+\s+\d+\.\d+%', line)]
  assert 1 <= len(rows) <= 10, text
  shares = [float(line.split()[2].rstrip('%')) for line in rows]
  names = [line.split(None, 5)[5] for line in rows]
  assert all(name.strip() for name in names), text
  # Shares are of the step (or of the summed op time where threads
  # overlap), so the top rows cannot exceed the whole.
  assert 0 < sum(shares) <= 100.5, text
  assert shares == sorted(shares, reverse=True), text
