import time, sys, numpy as np, jax, jax.numpy as jnp, torch
from capsjax import layers
torch.set_num_threads(2)
def bench(f, *args, n=7):
    jax.block_until_ready(f(*args)); ts=[]
    for _ in range(n):
        t=time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter()-t)
    return np.median(ts)

def _col_windows(x, kw):  # [B,H,W,C] -> [B,H,W-kw+1,kw*C]
    ow = x.shape[2] - kw + 1
    return jnp.concatenate([x[:, :, j:j+ow] for j in range(kw)], -1) if kw > 1 else x

def _shift_sum_rows(z, kh, f):  # [B,H,ow,kh*F] -> [B,H-kh+1,ow,F]: sum_i z[:, i:i+oh, :, i-th block]
    oh = z.shape[1] - kh + 1
    y = z[:, 0:oh, :, 0:f]
    for i in range(1, kh):
        y = y + z[:, i:i+oh, :, i*f:(i+1)*f]
    return y

def _kcat(kernel):  # [kh,kw,C,F] -> [(j,c),(i,f)]
    kh, kw, c, f = kernel.shape
    return kernel.transpose(1, 2, 0, 3).reshape(kw * c, kh * f)

@jax.custom_vjp
def rowconv(x, kernel):
    return layers._lax_conv(x, kernel)

def fwd(x, kernel):
    kh, kw, c, f = kernel.shape
    xw = _col_windows(x, kw)
    y = _shift_sum_rows(jnp.matmul(xw, _kcat(kernel)), kh, f)
    return y, (xw, kernel)

def bwd(res, dy):
    xw, kernel = res
    kh, kw, c, f = kernel.shape
    b, h, ow, _ = xw.shape
    # dyh[b,h,w,(i,f)] = dy[b,h-i,w,f]
    dyh = jnp.concatenate([jnp.pad(dy, ((0,0),(i,kh-1-i),(0,0),(0,0))) for i in range(kh)], -1)
    dkcat = jnp.einsum('bhwk,bhwn->kn', xw, dyh)
    dk = dkcat.reshape(kw, c, kh, f).transpose(2, 0, 1, 3)
    dxw = jnp.matmul(dyh, _kcat(kernel).T)  # [B,H,ow,kw*C]
    dx = sum(jnp.pad(dxw[..., j*c:(j+1)*c], ((0,0),(0,0),(j,kw-1-j),(0,0))) for j in range(kw))
    return dx, dk
rowconv.defvjp(fwd, bwd)

B = int(sys.argv[1])
for H, C, F in [(28, 1, 64), (26, 64, 64), (12, 64, 128), (10, 128, 128)]:
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((B,H,H,C),np.float32)); k = jnp.asarray(r.standard_normal((3,3,C,F),np.float32)*.1)
    def loss(conv):
        return jax.jit(jax.grad(lambda x, k: jnp.sum(jnp.sin(conv(x, k))), argnums=(0, 1)))
    g1 = loss(rowconv)(x, k); g2 = loss(layers._lax_conv)(x, k)
    for a, b_ in zip(g1, g2): np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=2e-3, atol=2e-3)
    res = {'train_patches': bench(loss(layers.patches_conv), x, k), 'train_rowvjp': bench(loss(rowconv), x, k)}
    tx = torch.randn(B, C, H, H, requires_grad=True); conv = torch.nn.Conv2d(C, F, 3)
    def t():
        y = torch.sin(conv(tx)).sum(); y.backward()
    t(); ts=[]
    for _ in range(7):
        s=time.perf_counter(); t(); ts.append(time.perf_counter()-s)
    res['torch_train'] = np.median(ts)
    print(H, C, F, ' '.join(f'{a}={v*1e3:.1f}' for a, v in res.items()), flush=True)
