"""The private JAX APIs capsjax reads, in one place.

JAX offers no public way to ask whether its backends have started (after
which XLA_FLAGS is read and fixed). ``tests/test_jax_private.py`` checks
each name here against the installed JAX, so a JAX that moves or renames it
fails that test by name instead of changing capsjax's behaviour silently.
"""

from __future__ import annotations

import sys

# The module and the function in it that say whether backends exist.
XLA_BRIDGE = 'jax._src.xla_bridge'
BACKENDS_ARE_INITIALIZED = 'backends_are_initialized'


def backends_started() -> bool:
  """Whether JAX has created its backends (and so read XLA_FLAGS). Imports
  nothing: without the module loaded, no backend can have started."""
  bridge = sys.modules.get(XLA_BRIDGE)
  return bool(bridge is not None and
              getattr(bridge, BACKENDS_ARE_INITIALIZED)())
