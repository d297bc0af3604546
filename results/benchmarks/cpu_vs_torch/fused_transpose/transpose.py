"""Session 12: conv1's output of the paper CapsNet at batch 128,
relu(patches @ K + b) [128, 20, 20, 256], transposed to [256, 20, 20, 128]
as the kernel gradient of PrimaryCaps needs it: with the bias and ReLU
fused into the transpose (what XLA does in the train step) and alone.
Run under different XLA_FLAGS by fused_transpose.sh."""
import os, time, numpy as np, jax, jax.numpy as jnp
import capsjax  # noqa: F401  (its XLA flag)


def bench(f, *args, n=7):
  jax.block_until_ready(f(*args)); ts = []
  for _ in range(n):
    t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
  return np.median(ts) * 1e3


r = np.random.default_rng(0)
y = jnp.asarray(r.standard_normal((128, 20, 20, 256), np.float32))
b = jnp.asarray(r.standard_normal((256,), np.float32))
fused = jax.jit(lambda y, b: jax.nn.relu(y + b).transpose(3, 1, 2, 0))
plain = jax.jit(lambda y: y.transpose(3, 1, 2, 0))
print(os.environ.get('XLA_FLAGS'), f'fused {bench(fused, y, b):.1f} ms, plain {bench(plain, y):.1f} ms', flush=True)


def materialized(x):
  """x unchanged, but as the output of an in-place dynamic_update_slice
  (its first row written back), which XLA does not fuse into a consumer."""
  return jax.lax.dynamic_update_slice(x, x[:1], (0,) * x.ndim)


def rewritten(y, b):
  """relu(y + b), its first image written again by a dynamic_update_slice
  (XLA cannot prove the update a no-op, so it keeps the in-place update)."""
  x = jax.nn.relu(y + b)
  return jax.lax.dynamic_update_slice(x, jax.nn.relu(y[:1] + b), (0,) * x.ndim)


dus = jax.jit(lambda y, b: materialized(jax.nn.relu(y + b)).transpose(3, 1, 2, 0))
both = jax.jit(lambda y, b: (lambda x: (x, materialized(x).transpose(3, 1, 2, 0)))(jax.nn.relu(y + b)))
both_fused = jax.jit(lambda y, b: (lambda x: (x, x.transpose(3, 1, 2, 0)))(jax.nn.relu(y + b)))
np.testing.assert_array_equal(np.asarray(dus(y, b)), np.asarray(fused(y, b)))
print(f'fused after a self-DUS {bench(dus, y, b):.1f} ms; x and its transpose: fused {bench(both_fused, y, b):.1f} ms, after a self-DUS {bench(both, y, b):.1f} ms', flush=True)

dus2 = jax.jit(lambda y, b: rewritten(y, b).transpose(3, 1, 2, 0))
np.testing.assert_array_equal(np.asarray(dus2(y, b)), np.asarray(fused(y, b)))
print(f'after a DUS of a recomputed first image {bench(dus2, y, b):.1f} ms', flush=True)
t = dus2.lower(y, b).compile().as_text(); print([l.split('=')[0].strip() for l in t[t.index('ENTRY'):].splitlines() if 'fusion(' in l or 'copy(' in l])


def through_cond(x, token):
  """x unchanged, passed through a conditional on a runtime predicate
  (token == token): XLA does not fuse across a conditional's boundary."""
  return jax.lax.cond(token == token, lambda x: x, lambda x: x + 0.0, x)


cond_t = jax.jit(lambda y, b: through_cond(jax.nn.relu(y + b), b[0]).transpose(3, 1, 2, 0))
np.testing.assert_array_equal(np.asarray(cond_t(y, b)), np.asarray(fused(y, b)))
print(f'after a conditional {bench(cond_t, y, b):.1f} ms', flush=True)
t = cond_t.lower(y, b).compile().as_text(); print([l.split('=')[0].strip() for l in t[t.index('ENTRY'):].splitlines() if 'fusion(' in l or 'copy(' in l or 'conditional' in l])
