"""Session 12: backward-pass variants for the paper CapsNet's PrimaryCaps
convolution (9x9, stride 2, 256 -> 256 channels on 20x20), batch 64.

The shipped path (session 11) differentiates it as patches @ kernel:
strided patches build + P @ K + P^T @ dy + dy @ K^T + col2im. The
variants here keep XLA's direct strided forward and compute each gradient
tap by tap, never materialising the [B*36, 81*256] patches.
"""
import sys, time, numpy as np, jax, jax.numpy as jnp
from experiments import launcher  # noqa: F401
from capsjax import layers

S = 2


def bench(f, *args, n=5):
  jax.block_until_ready(f(*args)); ts = []
  for _ in range(n):
    t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
  return np.median(ts) * 1e3


def window(x, i, j, oh, ow, s):
  return x[:, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s]


# --- kernel gradient -------------------------------------------------------
def dk_taps(x, dy, kh, kw, s):
  """81 products window(x, i, j)^T @ dy, stacked into [Kh, Kw, C, F]."""
  oh, ow = dy.shape[1:3]
  taps = [jnp.einsum('bhwc,bhwf->cf', window(x, i, j, oh, ow, s), dy)
          for i in range(kh) for j in range(kw)]
  return jnp.stack(taps).reshape(kh, kw, x.shape[-1], dy.shape[-1])


def dk_s2d_taps(xs, dy, qh, qw):
  """25 products over the space-to-depth input, [qh, qw, s*s*C, F]."""
  oh, ow = dy.shape[1:3]
  taps = [jnp.einsum('bhwc,bhwf->cf', xs[:, a:a + oh, b:b + ow], dy)
          for a in range(qh) for b in range(qw)]
  return jnp.stack(taps).reshape(qh, qw, xs.shape[-1], dy.shape[-1])


def dk_taps_t(x, dy, kh, kw, s):
  """81 products dy^T @ window(x, i, j): dy transposed once, each window
  the product's right operand in its own layout (no transposed copy)."""
  oh, ow = dy.shape[1:3]
  dyt = dy.reshape(-1, dy.shape[-1]).T
  taps = [dyt @ window(x, i, j, oh, ow, s).reshape(-1, x.shape[-1])
          for i in range(kh) for j in range(kw)]
  return jnp.stack(taps).reshape(kh, kw, dy.shape[-1], x.shape[-1]).transpose(0, 1, 3, 2)


def dk_s2d_taps_t(xs, dy, qh, qw):
  """25 products dy^T @ window of the space-to-depth input."""
  oh, ow = dy.shape[1:3]
  dyt = dy.reshape(-1, dy.shape[-1]).T
  taps = [dyt @ xs[:, a:a + oh, b:b + ow].reshape(-1, xs.shape[-1])
          for a in range(qh) for b in range(qw)]
  return jnp.stack(taps).reshape(qh, qw, dy.shape[-1], xs.shape[-1]).transpose(0, 1, 3, 2)


def dk_rows(x, dy, kh, kw, s):
  """9 products, one per kernel row: the row's 9 windows concatenated."""
  oh, ow = dy.shape[1:3]
  rows = []
  for i in range(kh):
    p = jnp.concatenate([window(x, i, j, oh, ow, s) for j in range(kw)], -1)
    rows.append(jnp.einsum('bhwk,bhwf->kf', p, dy))
  return jnp.stack(rows).reshape(kh, kw, x.shape[-1], dy.shape[-1])


# --- input gradient --------------------------------------------------------
def dx_taps_pad(dy, k, in_hw, s):
  """81 products dy @ K_ij^T, each placed by an interior-padded lax.pad."""
  kh, kw, c, _ = k.shape
  oh, ow = dy.shape[1:3]
  h, w = in_hw
  total = 0
  for i in range(kh):
    for j in range(kw):
      t = jnp.einsum('bhwf,cf->bhwc', dy, k[i, j])
      total = total + jax.lax.pad(t, 0.0, ((0, 0, 0), (i, h - i - s * (oh - 1) - 1, s - 1),
                                           (j, w - j - s * (ow - 1) - 1, s - 1), (0, 0, 0)))
  return total


def dx_s2d_matmul(dy, ks, s2d_hw):
  """One product dy @ Ks^T [B, oh, ow, qh*qw*4C], then 25 shifted blocks
  added (edge pads in the space-to-depth grid)."""
  qh, qw, c4, f = ks.shape
  oh, ow = dy.shape[1:3]
  hs, ws = s2d_hw
  dp = jnp.einsum('bhwf,kf->bhwk', dy, ks.reshape(-1, f)).reshape(*dy.shape[:3], qh, qw, c4)
  total = 0
  for a in range(qh):
    for b in range(qw):
      total = total + jnp.pad(dp[:, :, :, a, b], ((0, 0), (a, hs - a - oh), (b, ws - b - ow), (0, 0)))
  return total


def dx_s2d_taps(dy, ks, s2d_hw):
  """25 products dy @ Ks_ab^T, each placed by an edge pad."""
  qh, qw, c4, f = ks.shape
  oh, ow = dy.shape[1:3]
  hs, ws = s2d_hw
  total = 0
  for a in range(qh):
    for b in range(qw):
      t = jnp.einsum('bhwf,cf->bhwc', dy, ks[a, b])
      total = total + jnp.pad(t, ((0, 0), (a, hs - a - oh), (b, ws - b - ow), (0, 0)))
  return total


def col2im_parity(dp, kh, kw, s, h, w):
  """The windows' gradients dp [B, oh, ow, Kh, Kw, C] added back into the
  input [B, H, W, C]: kernel offsets split as i = s*a + p, the sum over
  (a, b) of edge-padded blocks in the space-to-depth grid, one fusion."""
  bsz, oh, ow, _, _, c = dp.shape
  qh, qw = -(-kh // s), -(-kw // s)
  dp = jnp.pad(dp, ((0, 0),) * 3 + ((0, qh * s - kh), (0, qw * s - kw), (0, 0)))
  dp = dp.reshape(bsz, oh, ow, qh, s, qw, s, c)
  hs, ws = oh + qh - 1, ow + qw - 1
  total = 0
  for a in range(qh):
    for b in range(qw):
      total = total + jnp.pad(dp[:, :, :, a, :, b], ((0, 0), (a, hs - a - oh), (b, ws - b - ow), (0, 0), (0, 0), (0, 0)))
  # [B, hs, ws, s, s, C] -> [B, hs*s, ws*s, C]
  x = total.transpose(0, 1, 3, 2, 4, 5).reshape(bsz, hs * s, ws * s, c)
  return jnp.pad(x[:, :h, :w], ((0, 0), (0, max(h - hs * s, 0)), (0, max(w - ws * s, 0)), (0, 0)))


def col2im_dus(dps, hs, ws):
  """dps [B, oh, ow, qh, qw, K] added into [B, hs, ws, K] block by block,
  each block a read-add-write of a dynamic_update_slice (in place)."""
  bsz, oh, ow, qh, qw, k = dps.shape
  out = jnp.zeros((bsz, hs, ws, k), dps.dtype)
  for a in range(qh):
    for b in range(qw):
      start = (0, a, b, 0)
      cur = jax.lax.dynamic_slice(out, start, (bsz, oh, ow, k))
      out = jax.lax.dynamic_update_slice(out, cur + dps[:, :, :, a, b], start)
  return out


def dx_taps_dus(dy, k, s, hs, ws):
  """Kh*Kw products dy @ K_ij^T [B, oh, ow, C], each added in place into
  its box of the space-to-depth grid [B, hs, ws, s*s*C]: rows i = s*a + p
  and columns j = s*b + q land at (a, b), channel block (p, q)."""
  kh, kw, c, f = k.shape
  bsz, oh, ow, _ = dy.shape
  out = jnp.zeros((bsz, hs, ws, s * s * c), dy.dtype)
  for i in range(kh):
    for j in range(kw):
      t = jnp.einsum('bhwf,cf->bhwc', dy, k[i, j])
      start = (0, i // s, j // s, ((i % s) * s + j % s) * c)
      cur = jax.lax.dynamic_slice(out, start, t.shape)
      out = jax.lax.dynamic_update_slice(out, cur + t, start)
  return out


def dx_s2d_taps_dus(dy, ks, hs, ws):
  """25 products dy @ Ks_ab^T [B, oh, ow, s*s*C], each added in place."""
  qh, qw, c4, f = ks.shape
  bsz, oh, ow, _ = dy.shape
  out = jnp.zeros((bsz, hs, ws, c4), dy.dtype)
  for a in range(qh):
    for b in range(qw):
      t = jnp.einsum('bhwf,cf->bhwc', dy, ks[a, b])
      cur = jax.lax.dynamic_slice(out, (0, a, b, 0), t.shape)
      out = jax.lax.dynamic_update_slice(out, cur + t, (0, a, b, 0))
  return out


def dx_grouped_dus(dy, k, s, hs, ws):
  """The taps of each space-to-depth offset (a, b) in one product
  dy @ [K_(sa+p, sb+q)]^T over the valid parities (p, q), added in place
  into its box: 25 products and 29 adds for 9x9 stride 2 (81 + 81 as
  single taps), no zero taps."""
  kh, kw, c, f = k.shape
  bsz, oh, ow, _ = dy.shape
  out = jnp.zeros((bsz, hs, ws, s * s * c), dy.dtype)
  for a in range(-(-kh // s)):
    for b in range(-(-kw // s)):
      ps = [p for p in range(s) if s * a + p < kh]
      qs = [q for q in range(s) if s * b + q < kw]
      kern = jnp.concatenate([k[s * a + p, s * b + q] for p in ps for q in qs], 0)
      tap = jnp.einsum('bhwf,cf->bhwc', dy, kern)
      pieces = ([(ps[0] * s * c, tap)] if len(qs) == s else
                [(p * s * c, tap[..., i * len(qs) * c:(i + 1) * len(qs) * c]) for i, p in enumerate(ps)])
      for chan, piece in pieces:
        start = (0, a, b, chan)
        cur = jax.lax.dynamic_slice(out, start, piece.shape)
        out = jax.lax.dynamic_update_slice(out, cur + piece, start)
  return out


def depth_to_space(xs, s, h, w, c):
  b, hs, ws, _ = xs.shape
  x = xs.reshape(b, hs, ws, s, s, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, hs * s, ws * s, c)
  return x[:, :h, :w]


def main(batch=int(__import__("os").environ.get("BATCH", 64))):
  r = np.random.default_rng(0)
  x = jnp.asarray(r.standard_normal((batch, 20, 20, 256), np.float32))
  k = jnp.asarray(r.standard_normal((9, 9, 256, 256), np.float32) * .01)
  dy = jnp.asarray(r.standard_normal((batch, 6, 6, 256), np.float32))
  xs, ks = layers._space_to_depth(x, k, S)
  s2d_hw = xs.shape[1:3]
  # references: XLA's autodiff of the direct conv (float32), compared below
  _, vjp = jax.vjp(lambda x, k: layers._lax_conv(x, k, S), x, k)
  ref_dx, ref_dk = jax.jit(vjp)(dy)
  cands = {
      'dk: 81 taps': (jax.jit(lambda x, dy: dk_taps(x, dy, 9, 9, S)), (x, dy), 'dk'),
      'dk: 9 kernel rows': (jax.jit(lambda x, dy: dk_rows(x, dy, 9, 9, S)), (x, dy), 'dk'),
      'dk: 25 s2d taps': (jax.jit(lambda xs, dy: dk_s2d_taps(xs, dy, 5, 5)[:, :, :, :].reshape(5, 5, 2, 2, 256, 256)
                                  .transpose(0, 2, 1, 3, 4, 5).reshape(10, 10, 256, 256)[:9, :9]), (xs, dy), 'dk'),
      'dk: 81 taps, dy^T @ window': (jax.jit(lambda x, dy: dk_taps_t(x, dy, 9, 9, S)), (x, dy), 'dk'),
      'dk: 25 s2d taps, dy^T @ window': (jax.jit(lambda xs, dy: dk_s2d_taps_t(xs, dy, 5, 5).reshape(5, 5, 2, 2, 256, 256)
                                  .transpose(0, 2, 1, 3, 4, 5).reshape(10, 10, 256, 256)[:9, :9]), (xs, dy), 'dk'),
      'dx: s2d matmul alone': (jax.jit(lambda dy, ks: jnp.einsum('bhwf,kf->bhwk', dy, ks.reshape(-1, 256))), (dy, ks), None),
      'dk: XLA autodiff of the s2d conv': (jax.jit(lambda xs, ks, dy: jax.vjp(lambda k: layers._lax_conv(xs, k), ks)[1](dy)[0]), (xs, ks, dy), None),
      'dk: XLA autodiff of the direct conv': (jax.jit(lambda x, k, dy: jax.vjp(lambda k: layers._lax_conv(x, k, S), k)[1](dy)[0]), (x, k, dy), 'dk'),
      'dx: XLA autodiff of the direct conv': (jax.jit(lambda x, k, dy: jax.vjp(lambda x: layers._lax_conv(x, k, S), x)[1](dy)[0]), (x, k, dy), 'dx'),
      'dx: XLA autodiff of the s2d conv': (jax.jit(lambda xs, ks, dy: depth_to_space(jax.vjp(lambda xs: layers._lax_conv(xs, ks), xs)[1](dy)[0], S, 20, 20, 256)), (xs, ks, dy), 'dx'),
      'dx: dy @ K^T + col2im by parity': (jax.jit(lambda dy, k: col2im_parity(jnp.einsum('bhwf,ijcf->bhwijc', dy, k), 9, 9, S, 20, 20)), (dy, k), 'dx'),
      'dx: col2im by parity alone': (jax.jit(lambda dp: col2im_parity(dp, 9, 9, S, 20, 20)), (jnp.zeros((batch, 6, 6, 9, 9, 256)),), None),
      'dx: s2d col2im by in-place blocks alone': (jax.jit(lambda dps: col2im_dus(dps, 10, 10)), (jnp.zeros((batch, 6, 6, 5, 5, 1024)),), None),
      'dx: s2d col2im by 25 pads alone': (jax.jit(lambda dps: sum(jnp.pad(dps[:, :, :, a, b], ((0, 0), (a, 4 - a), (b, 4 - b), (0, 0))) for a in range(5) for b in range(5))), (jnp.zeros((batch, 6, 6, 5, 5, 1024)),), None),
      'dx: s2d matmul + in-place blocks': (jax.jit(lambda dy, ks: depth_to_space(col2im_dus(jnp.einsum('bhwf,kf->bhwk', dy, ks.reshape(-1, 256)).reshape(batch, 6, 6, 5, 5, 1024), 10, 10), S, 20, 20, 256)), (dy, ks), 'dx'),
      'dx: 81 tap dots, in-place s2d boxes': (jax.jit(lambda dy, k: depth_to_space(dx_taps_dus(dy, k, S, 10, 10), S, 20, 20, 256)), (dy, k), 'dx'),
      'dx: 25 s2d tap dots, in-place blocks': (jax.jit(lambda dy, ks: depth_to_space(dx_s2d_taps_dus(dy, ks, 10, 10), S, 20, 20, 256)), (dy, ks), 'dx'),
      'dx: 25 grouped tap dots, 29 in-place boxes': (jax.jit(lambda dy, k: depth_to_space(dx_grouped_dus(dy, k, S, 10, 10), S, 20, 20, 256)), (dy, k), 'dx'),
      'dx: 81 taps, interior pads': (jax.jit(lambda dy, k: dx_taps_pad(dy, k, (20, 20), S)), (dy, k), 'dx'),
      'dx: s2d one matmul + 25 pads': (jax.jit(lambda dy, ks: depth_to_space(dx_s2d_matmul(dy, ks, s2d_hw), S, 20, 20, 256)), (dy, ks), 'dx'),
      'dx: s2d 25 taps + pads': (jax.jit(lambda dy, ks: depth_to_space(dx_s2d_taps(dy, ks, s2d_hw), S, 20, 20, 256)), (dy, ks), 'dx'),
      'fwd: direct strided': (jax.jit(lambda x, k: layers._lax_conv(x, k, S)), (x, k), None),
  }
  only = sys.argv[1:]
  for name, (f, args, which) in cands.items():
    if only and not any(o in name for o in only):
      continue
    if which:
      got = f(*args); ref = ref_dk if which == 'dk' else ref_dx
      err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
    else:
      err = 0.0
    print(f'{name:34s} {bench(f, *args):8.1f} ms   max rel err {err:.1e}', flush=True)


if __name__ == '__main__':
  main()
