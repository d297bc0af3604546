"""Session 14: does this jaxlib hand a convolution to oneDNN? Compiles Su's
second 3x3 layer under the XLA_FLAGS the process was started with and
prints the compiled HLO's convolution line (a oneDNN fusion would show as
a fusion of kind __onednn_fusion), then times its forward and gradient.
run.sh-style: for f in FLAGS...; XLA_FLAGS="$f" python this"""
import time
import jax, jax.numpy as jnp


def conv(x, k):
  return jax.lax.conv_general_dilated(x, k, (1, 1), 'VALID',
                                      dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


x = jnp.ones((128, 26, 26, 64)); k = jnp.ones((3, 3, 64, 64)) * 0.01
forward = jax.jit(conv).lower(x, k).compile()
print([l.strip()[:160] for l in forward.as_text().splitlines()
       if 'fusion' in l or 'convolution' in l or 'custom' in l][:4])
grad = jax.jit(jax.grad(lambda x, k: jnp.sum(conv(x, k) ** 2), argnums=(0, 1)))
for fn, name in ((forward, 'forward'), (grad, 'gradients')):
  jax.block_until_ready(fn(x, k)); t = time.perf_counter()
  for _ in range(5): jax.block_until_ready(fn(x, k))
  print(f'{name}: {(time.perf_counter() - t) / 5 * 1e3:.1f} ms')
