# a small grid of the packed CUDA forward (`varlen_attention`'s forward on a Hopper GPU) for
# compute-sanitizer (memcheck, racecheck): head dims 64, 128 and 256, causal top-left and
# bottom-right, window, GQA, sequences ending inside a key block (whose V rows past the end the
# kernel zeroes), empty sequences, padding tokens holding NaN; enough tiles that CTAs take several
# from the counter; each forward once more under `jax.vjp`, where the kernel also writes the
# per-sequence statistics of cuDNN's backward. The block table's kernel (PackedTableKernel) runs
# before each: `--kernel-regex kns='HopperFwd|PackedTable'`
import jax
import jax.numpy as jnp
import numpy as np

import attnaux

q_lens, kv_lens = (700, 1, 0, 385, 129, 64, 900), (700, 300, 6, 513, 129, 0, 901)
cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
cu_kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
for d, options in ((128, dict(causal=True)), (128, dict(window=(70, 30))),
                   (64, dict(causal="bottom_right")), (256, dict(causal=True)),
                   (256, dict(causal=True, window=(200, 0)))):
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (cu_q[-1] + 9, 14, d), jnp.bfloat16).at[cu_q[-1]:].set(jnp.nan)
    k = jax.random.normal(ks[1], (cu_kv[-1] + 70, 2, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (cu_kv[-1] + 70, 2, d), jnp.bfloat16).at[cu_kv[-1]:].set(jnp.nan)
    out, aux = attnaux.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                        max_seqlen_q=900, max_seqlen_kv=901, **options)
    print(d, options, attnaux.explain(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                      max_seqlen_q=900, max_seqlen_kv=901, **options).packed[:40],
          float(jnp.abs(out.astype(jnp.float32)).sum()), bool(jnp.isnan(out).any()))
    def loss(q, k, v, options=options):
        out, aux = attnaux.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                            max_seqlen_q=900, max_seqlen_kv=901, **options)
        finite = jnp.where(jnp.isfinite(aux.lse), aux.lse, 0.0)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(finite)
    grads = jax.grad(loss, argnums=(0, 1, 2))(jnp.nan_to_num(q), k, jnp.nan_to_num(v))
    print("  grads finite:", all(bool(jnp.isfinite(g).all()) for g in grads))
