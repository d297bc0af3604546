"""Builds capsjax's C++ XLA FFI handlers with the machine's compiler.

A source is compiled once per (source, jaxlib version, compiler flags,
extra key) into the user's cache (``$CAPSJAX_CACHE_DIR``, else
``~/.cache/capsjax``); the file appears atomically, so concurrent processes
may build it side by side. A build says so in one line on stderr.

Two switches, read when a library is first built or loaded in a process:

- ``CAPSJAX_NATIVE_ARCH``: the instruction set the fused EM kernel is
  compiled for, as gcc's ``-march`` names it (default ``native``, this
  CPU's; ``x86-64-v2``, ``x86-64-v3`` (AVX2) or ``x86-64-v4`` (AVX-512)
  build the portable baselines the tests also run).
- ``CAPSJAX_SANITIZE``: gcc's ``-fsanitize`` list, e.g.
  ``address,undefined``: both native libraries are built with
  AddressSanitizer and UndefinedBehaviorSanitizer (any report aborts the
  process). Python is not built with them, so the sanitizer's runtime must
  be loaded first: ``tools/sanitized_tests.sh`` runs the native test files
  that way.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax


def cache_dir() -> pathlib.Path:
  root = os.environ.get('CAPSJAX_CACHE_DIR')
  return (pathlib.Path(root) if root else
          pathlib.Path.home() / '.cache' / 'capsjax')


def arch() -> str:
  """gcc's ``-march`` for the EM kernel: ``$CAPSJAX_NATIVE_ARCH`` or
  'native'."""
  return os.environ.get('CAPSJAX_NATIVE_ARCH') or 'native'


def sanitizers() -> str:
  """``$CAPSJAX_SANITIZE`` (gcc's -fsanitize list), '' when unset."""
  return os.environ.get('CAPSJAX_SANITIZE', '').strip()


def _sanitizer_flags() -> list[str]:
  checks = sanitizers()
  if not checks:
    return []
  # Every report fatal, so that a test run with one cannot pass.
  return [f'-fsanitize={checks}', '-fno-sanitize-recover=all',
          '-fno-omit-frame-pointer', '-g']


def build(source: pathlib.Path, prefix: str, flags: list[str],
          key: list[str] = ()) -> pathlib.Path:
  """The shared library of ``source`` compiled with ``flags`` (and the
  sanitizers of ``$CAPSJAX_SANITIZE``; the cached one when it exists).
  Raises RuntimeError without a compiler or when the compilation fails."""
  flags = [*flags, *_sanitizer_flags()]
  digest = hashlib.sha256(b'\0'.join([
      source.read_bytes(), importlib.metadata.version('jaxlib').encode(),
      *(str(part).encode() for part in (*flags, *key))])).hexdigest()[:16]
  target = cache_dir() / f'{prefix}{digest}.so'
  if target.exists():
    return target
  compiler = os.environ.get('CXX') or shutil.which('g++') or shutil.which('c++')
  if not compiler:
    raise RuntimeError('no C++ compiler (g++, c++ or $CXX) on PATH')
  if not shutil.which(compiler):
    raise RuntimeError(f'the C++ compiler $CXX={compiler!r} does not exist; '
                       f'set CXX to one that does, or unset it')
  target.parent.mkdir(parents=True, exist_ok=True)
  # A first use waits for the compiler (seconds): say why, once.
  print(f'capsjax: compiling {source.name} for this machine (once; cached '
        f'in {target.parent})', file=sys.stderr, flush=True)
  with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
    built = pathlib.Path(tmp) / target.name
    command = [compiler, '-std=c++17', '-shared', '-fPIC', '-w',
               f'-I{jax.ffi.include_dir()}', str(source), *flags, '-o',
               str(built)]
    result = subprocess.run(command, capture_output=True, text=True,
                            check=False)
    if result.returncode:
      raise RuntimeError(f'compiling {source.name} failed:\n'
                         f'{result.stderr[-2000:]}')
    os.replace(built, target)
  return target
