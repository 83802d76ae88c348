"""Per-kernel timeline of `varlen_attention` forward+backward (causal, 16 heads x 128, bf16):
attnaux's CUDA forward and backward (`_dispatch.GPU_VARLEN_CUDA_BACKWARD` on), then
FlashAttention-3's varlen.

    python3 tools/gpu_dev/prof_varlen.py 8192/8 16384/16 [16384/64/loose]

(tokens / documents of equal lengths; `loose`: `max_seqlen_*` the number of tokens.) Prints each
candidate's span and busy time a call (us) and its kernels' time a call, largest first
(forward, then forward+backward).
"""

import sys

import dew_flash_attn
import jax
import jax.numpy as jnp
import numpy as np
from timeline import timeline

import attnaux
from attnaux import _dispatch

HEADS, DIM = 16, 128


def profile(spec):
    """Prints the three candidates' timelines at `spec` (tokens/documents[/loose])."""
    tokens, docs, bound = (spec.split("/") + ["tight"])[:3]
    tokens, docs = int(tokens), int(docs)
    most = tokens // docs if bound == "tight" else tokens
    cu = jnp.asarray(np.arange(docs + 1) * (tokens // docs), jnp.int32)
    key = jax.random.key(0)
    q, k, v, w = (jax.random.normal(jax.random.fold_in(key, i), (tokens, HEADS, DIM),
                                    jnp.bfloat16) for i in range(4))
    args = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=most, max_seqlen_kv=most,
                causal=True)

    def ours(q, k, v):
        return attnaux.varlen_attention(q, k, v, **args)[0]

    def fa3(q, k, v):
        return dew_flash_attn.flash_mha_varlen(q, k, v, cu, most, is_causal=True)

    def with_grad(fn):
        def loss(q, k, v, w):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * w)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    for name, flag in (("cuda-bwd", True), ("fa3", None)):
        if flag is not None:
            _dispatch.GPU_VARLEN_CUDA_BACKWARD = flag
            jax.clear_caches()
            print("  explain:", attnaux.explain(q, k, v, **args).packed[:70])
        fn = fa3 if flag is None else ours
        fwd_span, fwd_busy, fwd_top = timeline(jax.jit(fn), (q, k, v))
        both_span, both_busy, top = timeline(with_grad(fn), (q, k, v, w))
        print(f"== {spec} {name}: fwd span {fwd_span:.1f} busy {fwd_busy:.1f} | fwd+bwd "
              f"span {both_span:.1f} busy {both_busy:.1f} us", flush=True)
        for kernel, us, _ in fwd_top:
            print(f"  fwd {us:7.1f} {kernel}")
        for kernel, us, _ in top:
            print(f"     {us:7.1f} {kernel}")


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        profile(spec)
