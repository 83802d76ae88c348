"""The packed forward's kernels against FlashAttention-3 varlen's, forward alone, one build a
process (causal, 16 heads x 128, bf16; `jax.profiler` timelines, `timeline.py`): each shape's
busy time a call and its largest kernel's, in us. Builds take turns by running it once a build,
the build's `_kernels_cuda` copied into `src/attnaux/` before each run:

    for v in base new base new; do cp .gpu/var/$v.so src/attnaux/_kernels_cuda*.so; \\
        python3 tools/gpu_dev/varlen_fwd_ab.py $v; done

The first argument labels the lines; the shapes are tokens / documents of equal lengths.
"""

import os
import sys

import dew_flash_attn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline import timeline  # noqa: E402

import attnaux  # noqa: E402

SHAPES = ((8192, 8), (16384, 16), (16384, 64))


def main(tag):
    for tokens, docs in SHAPES:
        most = tokens // docs
        cu = jnp.asarray(np.arange(docs + 1) * most, jnp.int32)
        key = jax.random.key(0)
        q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (tokens, 16, 128), jnp.bfloat16)
                   for i in range(3))
        args = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=most, max_seqlen_kv=most,
                    causal=True)
        ours = jax.jit(lambda q, k, v, args=args: attnaux.varlen_attention(q, k, v, **args)[0])
        fa3 = jax.jit(lambda q, k, v, cu=cu, most=most: dew_flash_attn.flash_mha_varlen(
            q, k, v, cu, most, is_causal=True))
        _, busy, top = timeline(ours, (q, k, v))
        _, fa3_busy, fa3_top = timeline(fa3, (q, k, v))
        print(f"{tag} {tokens}/{docs}: attnaux busy {busy:.1f} main {top[0][1]:.1f} | fa3 busy "
              f"{fa3_busy:.1f} main {fa3_top[0][1]:.1f} | fa3 / attnaux busy "
              f"{fa3_busy / busy:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "build")
