"""Shared pytest configuration for the capsjax tests."""

import jax

# As equinox does: implicit rank promotion ([B, O] + [O]) is how a batch axis
# silently lines up with the wrong one, so every test runs with it raising.
jax.config.update('jax_numpy_rank_promotion', 'raise')
