"""The packed forward of `varlen_attention` and FlashAttention-3's varlen forward, three calls
each, for Nsight Compute (causal, 16 heads x 128, bf16, documents of equal lengths):

    ncu --clock-control none --set full --kernel-name regex:HopperFwdKernel --launch-skip 2 \\
        --launch-count 1 -o ours python3 tools/gpu_dev/ncu_varlen_fwd.py 8192/8
    ncu ... --kernel-name regex:device_kernel --launch-skip 1 ... -o fa3 ...   # FA3's kernel
    ncu -i ours.ncu-rep --page details --csv        # SM active cycles, instructions, stalls

(FA3's kernel is `cutlass::device_kernel<...FlashAttnFwdSm90...>`: ncu matches the base name.)
"""

import sys

import dew_flash_attn
import jax
import jax.numpy as jnp
import numpy as np

import attnaux

tokens, docs = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8192/8").split("/"))
most = tokens // docs
cu = jnp.asarray(np.arange(docs + 1) * most, jnp.int32)
q, k, v = (jax.random.normal(jax.random.fold_in(jax.random.key(0), i), (tokens, 16, 128),
                             jnp.bfloat16) for i in range(3))
args = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=most, max_seqlen_kv=most, causal=True)
ours = jax.jit(lambda q, k, v: attnaux.varlen_attention(q, k, v, **args))
fa3 = jax.jit(lambda q, k, v: dew_flash_attn.flash_mha_varlen(q, k, v, cu, most, is_causal=True))
for _ in range(3):
    jax.block_until_ready(ours(q, k, v))
    jax.block_until_ready(fa3(q, k, v))
