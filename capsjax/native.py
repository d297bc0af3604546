"""Builds capsjax's C++ XLA FFI handlers with the machine's compiler.

A source is compiled once per (source, jaxlib version, compiler flags,
extra key) into the user's cache (``$CAPSJAX_CACHE_DIR``, else
``~/.cache/capsjax``); the file appears atomically, so concurrent processes
may build it side by side.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax


def cache_dir() -> pathlib.Path:
  root = os.environ.get('CAPSJAX_CACHE_DIR')
  return (pathlib.Path(root) if root else
          pathlib.Path.home() / '.cache' / 'capsjax')


def build(source: pathlib.Path, prefix: str, flags: list[str],
          key: list[str] = ()) -> pathlib.Path:
  """The shared library of ``source`` compiled with ``flags`` (the cached
  one when it exists). Raises RuntimeError without a compiler or when the
  compilation fails."""
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
