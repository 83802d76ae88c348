"""Per-kernel GPU timeline of forward+backward (jax.profiler): attnaux's CUDA backward
(`hopper_candidate(cuda_backward=True)`), cuDNN and FlashAttention-3, `benchmarks/gpu_hopper.py`'s
candidates. After `source tools/gpu_dev/pre.sh`:
`python3 tools/gpu_dev/prof_bwd.py 8x1024x16x128c,4x2048x16x128 [cuda,cudnn,fa3]` (a trailing
c: causal)."""

import sys

import jax
import jax.numpy as jnp
from timeline import timeline

sys.path.insert(0, "benchmarks")
import gpu_hopper as gh  # noqa: E402


def profile(shape, candidates):
    """Prints each candidate's forward+backward timeline at `shape` (b x s x h x d[c])."""
    causal = shape.endswith("c")
    b, s, h, d = (int(x) for x in shape.rstrip("c").split("x"))
    key = jax.random.key(0)
    q, k, v, w = (jax.random.normal(jax.random.fold_in(key, i), (b, s, h, d), jnp.bfloat16)
                  for i in range(4))
    for name, fn in candidates.items():
        def loss(q, k, v, w, fn=fn):
            return jnp.sum(fn(q, k, v, causal).astype(jnp.float32) * w)
        span, busy, kernels = timeline(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                                       (q, k, v, w), top=9, width=90)
        print(f"== {shape} {name}: span/call {span:.1f} us, busy/call {busy:.1f} us", flush=True)
        for kernel, us, launches in kernels:
            print(f"   {us:8.1f} us x{launches:.0f}  {kernel}")


if __name__ == "__main__":
    candidates = {"cuda": gh.hopper_candidate(cuda_backward=True), "cudnn": gh.cudnn_attention,
                  "fa3": gh.CANDIDATES["fa3"]}
    if len(sys.argv) > 2:
        candidates = {k: v for k, v in candidates.items() if k in sys.argv[2].split(",")}
    for shape in sys.argv[1].split(","):
        profile(shape, candidates)
