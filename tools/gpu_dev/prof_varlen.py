"""Per-kernel timeline of varlen forward+backward (causal, 16 heads x 128, bf16): cuDNN's ragged backward, attnaux's CUDA backward (`_dispatch.GPU_VARLEN_CUDA_BACKWARD` off, on), FA3 varlen.

    python3 tools/gpu_dev/prof_varlen.py 8192/8 16384/16 [16384/64/loose]
"""
import glob, os, sys, tempfile  # noqa: E401
from collections import defaultdict
import jax, jax.numpy as jnp, numpy as np
import attnaux
from attnaux import _dispatch
import dew_flash_attn
H, D = 16, 128
def timeline(f, args, N=10):
    for _ in range(4): jax.block_until_ready(f(*args))
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        outs = [f(*args) for _ in range(N)]; jax.block_until_ready(outs)
    pd = jax.profiler.ProfileData.from_file(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
    evs = []
    for plane in pd.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if "tream" in line.name: evs.extend((e.start_ns, e.duration_ns, e.name) for e in line.events)
    evs.sort(); t0, t1 = evs[0][0], max(a + b for a, b, _ in evs)
    per = defaultdict(int)
    for _, du, n in evs: per[n[:70]] += du
    return (t1 - t0) / N / 1e3, sum(per.values()) / N / 1e3, sorted(per.items(), key=lambda x: -x[1])[:7]
for spec in sys.argv[1:]:
    T, docs, bound = (spec.split("/") + ["tight"])[:3]
    T, docs = int(T), int(docs); L = T // docs
    mx = L if bound == "tight" else T
    cu = jnp.asarray(np.arange(docs + 1) * L, jnp.int32)
    key = jax.random.key(0)
    q, k, v, w = (jax.random.normal(jax.random.fold_in(key, i), (T, H, D), jnp.bfloat16) for i in range(4))
    ours = lambda q, k, v: attnaux.varlen_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mx, max_seqlen_kv=mx, causal=True)[0]
    fa3 = lambda q, k, v: dew_flash_attn.flash_mha_varlen(q, k, v, cu, mx, is_causal=True)
    def fb(fn):
        return jax.jit(lambda q, k, v, w: jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w), argnums=(0, 1, 2))(q, k, v))
    for name, flag in (("cudnn-bwd", False), ("cuda-bwd", True), ("fa3", None)):
        if flag is not None:
            _dispatch.GPU_VARLEN_CUDA_BACKWARD = flag; jax.clear_caches()
            print("  explain:", attnaux.explain(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mx, max_seqlen_kv=mx, causal=True).packed[:70])
        fn = fa3 if flag is None else ours
        fs, fbusy, _ = timeline(jax.jit(fn), (q, k, v))
        bs, bbusy, top = timeline(fb(fn), (q, k, v, w))
        print(f"== {spec} {name}: fwd span {fs:.1f} busy {fbusy:.1f} | fwd+bwd span {bs:.1f} busy {bbusy:.1f} us", flush=True)
        for n, du in top: print(f"     {du/10/1e3:7.1f} {n}")
