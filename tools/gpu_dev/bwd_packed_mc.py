# a small grid of the packed CUDA backward (`varlen_attention`'s mode `cuda-cuda`, head dim 128)
# for compute-sanitizer (memcheck): two sides' offsets (the backward builds its own block table
# and dQ tile bases) and one offsets array (it takes the forward's work buffer), sequences of
# one token, longer than a key block, empty ones, padding tokens, a loss with and without an lse
# term (dlse given or none); `--kernel-regex kns='HopperBwd|PackedTable'`
import jax
import jax.numpy as jnp
import numpy as np

import attnaux


def grads(q_lens, kv_lens, shared, with_lse, options, most=701):
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_kv = cu_q if shared else np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (int(cu_q[-1]) + 9, 8, 128), jnp.bfloat16)
    k, v = (jax.random.normal(key, (int(cu_kv[-1]) + (9 if shared else 70), 2, 128),
                              jnp.bfloat16) for key in ks[1:])
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_q if shared else cu_kv, max_seqlen_q=most,
                max_seqlen_kv=most, **options)
    how = attnaux.explain(q, k, v, **args).packed

    def loss(q, k, v):
        out, aux = attnaux.varlen_attention(q, k, v, **args)
        lse = jnp.sum(jnp.where(jnp.isfinite(aux.lse), aux.lse, 0.0)) if with_lse else 0.0
        return jnp.sum(out.astype(jnp.float32)) + lse

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    print(shared, with_lse, options, how[:50],
          all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in g))


lens = (700, 1, 0, 385, 129, 64, 300)
for shared in (False, True):
    for with_lse in (True, False):
        for options in (dict(causal=True), dict(window=(70, 30))):
            grads(lens, (650, 300, 6, 513, 129, 0, 301), shared, with_lse, options)
