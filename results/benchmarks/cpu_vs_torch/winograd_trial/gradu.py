import sys; sys.argv=[sys.argv[0]]
exec(open('/tmp/wino/proto.py').read().split("shapes = [")[0])
n,th,tw,c,f=128,12,12,64,64
v = jax.random.normal(jax.random.key(2),(16,n*th*tw,c)); g = jax.random.normal(jax.random.key(3),(16,n*th*tw,f))
def tm(name, fn, *a):
  fn=jax.jit(fn); ms=[bench(fn,a) for _ in range(3)]; print(name, ['%.1f'%m for m in ms], flush=True)
tm('einsum pnc,pnf->pcf', lambda v,g: jnp.einsum('pnc,pnf->pcf', v, g), v, g)
tm('transpose then matmul', lambda v,g: jnp.matmul(v.transpose(0,2,1), g), v, g)
tm('chunks 8', lambda v,g: jnp.einsum('pknc,pknf->pcf', v.reshape(16,8,-1,c), g.reshape(16,8,-1,f)), v, g)
tm('chunk-batched then sum 8', lambda v,g: jnp.einsum('pknc,pknf->pkcf', v.reshape(16,8,-1,c), g.reshape(16,8,-1,f)).sum(1), v, g)
tm('chunk-batched then sum 64', lambda v,g: jnp.einsum('pknc,pknf->pkcf', v.reshape(16,64,-1,c), g.reshape(16,64,-1,f)).sum(1), v, g)
tm('per-p dots', lambda v,g: jnp.stack([v[p].T @ g[p] for p in range(16)]), v, g)
tm('g^T v (pfn,pnc)', lambda v,g: jnp.einsum('pnf,pnc->pfc', g, v), v, g)
vt = v.transpose(0,2,1)
tm('v stored [p,c,n] @ g', lambda vt,g: jnp.matmul(vt, g), vt, g)
