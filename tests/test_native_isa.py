"""Native code on other CPUs than the test machine's, in subprocesses.

``ONEDNN_MAX_CPU_ISA=AVX2`` makes oneDNN pick the kernels it runs on an
AVX2-only CPU (its gemm convolutions, which keep im2col columns in a
scratchpad); ``CAPSJAX_NATIVE_ARCH`` builds the fused EM kernel for another
instruction set than this CPU's. Both are read when a process starts, hence
the subprocesses: the slow tier's, and CI's AVX2 part runs them
(tools/run_tests.py).
"""

import json
import os
import subprocess
import sys

import pytest

from capsjax.kernels.conv import onednn
from tests import conftest
from tests.conftest import REPO
from tests.helpers import make_cifar10_release

pytestmark = pytest.mark.slow


def _run(args, env_updates, cwd=REPO, timeout=600):
  env = dict(conftest.training_env(), **env_updates)
  return subprocess.run([sys.executable, *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=timeout,
                        check=False)


@pytest.mark.skipif(not onednn.wheels_installed(),
                    reason="oneDNN's wheels are not installed")
def test_cifar10_smoke_trains_with_avx2_kernels(tmp_path):
  """The CIFAR-10 smoke CapsNet's train steps under AVX2 kernels. Before
  the handlers owned their scratchpads this run died with a segfault at its
  first step, every time: oneDNN's gemm convolution, created on one XLA
  thread, read the per-thread scratchpad of the thread that executed it."""
  data = tmp_path / 'cifar'
  make_cifar10_release(data, n_per_batch=40, n_test=40)
  workdir = tmp_path / 'run'
  result = _run(['-m', 'experiments.train', f'--workdir={workdir}',
                 '--config=experiments/configs/capsnet_cifar10.py:smoke',
                 f'--config.data_dir={data}', '--config.validation_size=40',
                 '--config.num_train_steps=4', '--config.eval_every_steps=4'],
                {'ONEDNN_MAX_CPU_ISA': 'AVX2'})
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-3000:]
  summary = json.loads((workdir / 'summary.json').read_text())
  assert summary['steps'] == 4
  # The header and the summary name the kernels that ran.
  assert 'oneDNN (float32 by avx2 kernels' in summary['conv_backend']
  assert summary['conv_backend'] in output
  # no conv capsules in a CapsNet
  assert 'conv_capsule_routing' not in summary['implementations']


def _em_status(cache, env):
  code = ('from capsjax.kernels import em_cpu; print(em_cpu.status())')
  return _run(['-c', code], dict(env, CAPSJAX_CACHE_DIR=str(cache)))


def test_em_kernel_builds_for_a_portable_baseline_and_says_so(tmp_path):
  """CAPSJAX_NATIVE_ARCH builds the kernel for that instruction set; the
  first build says so in one line, a cached one says nothing."""
  first = _em_status(tmp_path, {'CAPSJAX_NATIVE_ARCH': 'x86-64-v2'})
  assert first.returncode == 0, first.stderr[-2000:]
  if 'not available' in first.stdout:
    pytest.skip(first.stdout)
  assert 'built for -march=x86-64-v2' in first.stdout
  assert 'capsjax: compiling em_routing.cc' in first.stderr
  again = _em_status(tmp_path, {'CAPSJAX_NATIVE_ARCH': 'x86-64-v2'})
  assert 'built for -march=x86-64-v2' in again.stdout
  assert 'compiling' not in again.stderr
  native = _em_status(tmp_path, {'CAPSJAX_NATIVE_ARCH': ''})
  assert 'built for -march=native' in native.stdout
  assert 'capsjax: compiling em_routing.cc' in native.stderr
  assert len(os.listdir(tmp_path)) == 2  # one library per instruction set
