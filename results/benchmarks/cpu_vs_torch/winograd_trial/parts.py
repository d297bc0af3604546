import sys; sys.argv=[sys.argv[0]]
exec(open('/tmp/wino/proto.py').read().split("shapes = [")[0])
n,h,w,c,f = 128,26,26,64,64
x = jax.random.normal(jax.random.key(0),(n,h,w,c)); k = jax.random.normal(jax.random.key(1),(3,3,c,f))*.1
th=tw=12
v = jax.random.normal(jax.random.key(2),(16,n*th*tw,c)); u = jax.random.normal(jax.random.key(3),(16,c,f))
def tm(name, fn, *a):
  fn=jax.jit(fn); ms=[bench(fn,a) for _ in range(3)]; print(name, ['%.1f'%m for m in ms], flush=True)
tm('wino fwd', winograd_conv, x, k)
tm('lax fwd', layers._lax_conv, x, k)
tm('bmm fwd', jnp.matmul, v, u)
tm('bmm fwd+bwd', jax.grad(lambda v,u: jnp.sum(jnp.sin(jnp.matmul(v,u))), argnums=(0,1)), v, u)
tm('bmm grad_u only (v^T g)', lambda v,g: jnp.einsum('pnc,pnf->pcf', v, g), v, jnp.matmul(v,u))
tm('bmm grad_v only (g u^T)', lambda g,u: jnp.einsum('pnf,pcf->pnc', g, u), jnp.matmul(v,u), u)
# same products as one flat matmul per p (unbatched loop)
tm('16 separate dots fwd', lambda v,u: jnp.stack([v[p]@u[p] for p in range(16)]), v, u)
tm('sin pass 75MB', jnp.sin, v)
tm('wino fwd+bwd', jax.grad(lambda x,k: jnp.sum(jnp.sin(winograd_conv(x,k))), argnums=(0,1)), x, k)
