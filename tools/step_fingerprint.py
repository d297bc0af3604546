"""Fingerprint of a config's compiled train step, to show that a refactor
compiles to the same program (and so cannot change speed or numerics).

    python tools/step_fingerprint.py capsnet_mnist:smoke baseline_cnn_mnist

Run it in two checkouts (``PYTHONPATH`` set to each) and compare the lines.
The fingerprint hashes XLA's optimised HLO of the jitted train step (batch
8, float32, as ``benchmarks.harness`` builds it) after removing what
names the source rather than the computation: the debug sections (file
names, stack frames), metadata and instruction numbering; the instructions
are sorted, so the same multiset of operations, shapes, layouts, fusions and
custom calls gives the same hash.
"""

from __future__ import annotations

import hashlib
import re
import sys

import jax

from benchmarks import harness

_DEBUG_SECTIONS = ('FileNames', 'FunctionNames', 'FileLocations',
                   'StackFrames')


def normalized_lines(hlo_text: str) -> list[str]:
  """The HLO's instructions without debug sections, metadata and numbering,
  sorted."""
  lines, skipping = [], False
  for line in hlo_text.splitlines():
    if line in _DEBUG_SECTIONS:
      skipping = True
      continue
    if skipping and line.startswith(('%', 'ENTRY', 'HloModule')):
      skipping = False
    if not skipping:
      lines.append(line)
  text = '\n'.join(lines)
  text = re.sub(r', metadata=\{[^}]*\}', '', text)
  text = re.sub(r', stack_frame_id=\d+', '', text)
  text = re.sub(r'(%[A-Za-z_][\w-]*?)\.\d+\b', r'\1', text)
  return sorted(line.strip() for line in text.splitlines() if line.strip())


def fingerprint(spec: str, batch: int = 8) -> tuple[str, int]:
  """(hash, number of instructions) of ``spec``'s compiled train step."""
  step, example = harness.train_step_and_inputs(
      harness.configure(spec, batch_size=batch))
  compiled = jax.jit(step).lower(*example).compile()
  lines = normalized_lines(compiled.as_text())
  return hashlib.sha256('\n'.join(lines).encode()).hexdigest()[:16], len(lines)


def main(specs: list[str]) -> int:
  if not specs:
    print(__doc__)
    return 2
  for spec in specs:
    digest, count = fingerprint(spec)
    print(f'{spec} {digest} {count} instructions', flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
