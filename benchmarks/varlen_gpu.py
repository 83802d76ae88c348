"""GPU benchmark: packed sequences, `attnaux.varlen_attention` vs FlashAttention-3's varlen.

    python benchmarks/varlen_gpu.py           # the shapes of issue 22 (bf16, 16 heads x 128)
    python benchmarks/varlen_gpu.py --quick   # one shape

Side by side in one run, for each (tokens, documents) with equal-length documents, causal,
forward and forward+backward (`jax.vjp` of the output with a fixed cotangent):

- `varlen`: `attnaux.varlen_attention` (GPU `flash`: cuDNN's ragged layout, out + lse + max);
- `varlen+lse`: the same with a loss on `aux.lse` too (forward+backward only);
- `batched`: `attnaux.attention` on the same documents as a batch `[n, T/n]`;
- `segments`: `attnaux.attention` on one row with segment ids (the path before varlen);
- `fa3 varlen`: FlashAttention-3's `flash_mha_varlen` from the `dew-flash-attn-cu13` wheel (its
  `dew_flash_attn` package importable; skipped otherwise).

Timing as `benchmarks/gpu_flash.py`: jitted, warm-ups, rounds of back-to-back calls with the
candidates taking turns, the median of the rounds' means. Prints ms and the ratio of each to FA3.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import attnaux

sys.path.insert(0, os.path.dirname(__file__))
from gpu_flash import timed  # noqa: E402

try:
    import dew_flash_attn
except ImportError:  # pragma: no cover - the wheel is optional
    dew_flash_attn = None

SHAPES = [(16384, 16), (16384, 64), (8192, 8), (16384, 4)]  # (tokens, documents)
HEADS, DIM = 16, 128


def _candidates(tokens, docs):
    length = tokens // docs
    cu = jnp.asarray(np.arange(docs + 1) * length, jnp.int32)
    ids = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), length)[None]
    packed = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=length, max_seqlen_kv=length,
                  causal=True)

    def varlen(q, k, v):
        out, aux = attnaux.varlen_attention(q, k, v, **packed)
        return out, aux.lse

    def batched(q, k, v):
        b = lambda x: x.reshape(docs, length, *x.shape[1:])  # noqa: E731
        out, aux = attnaux.attention(b(q), b(k), b(v), causal=True, backend="flash")
        return out.reshape(q.shape[0], *out.shape[2:]), aux.lse

    def segments(q, k, v):
        out, aux = attnaux.attention(q[None], k[None], v[None], causal=True, q_segment_ids=ids,
                                     kv_segment_ids=ids, backend="flash")
        return out[0], aux.lse

    fns = {"varlen": varlen, "batched": batched, "segments": segments}
    if dew_flash_attn is not None:
        def fa3(q, k, v):
            return dew_flash_attn.flash_mha_varlen(q, k, v, cu, length, is_causal=True), None
        fns["fa3 varlen"] = fa3
    return fns


def _forward(fn):
    return jax.jit(lambda q, k, v: fn(q, k, v)[0])


def _backward(fn, with_lse=False):
    def step(q, k, v, w):
        def loss(q, k, v):
            out, lse = fn(q, k, v)
            total = jnp.sum(out.astype(jnp.float32) * w)
            if with_lse:
                total += 1e-4 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) ** 2)
            return total
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return jax.jit(step)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; "
          f"FA3: {'yes' if dew_flash_attn is not None else 'not installed'}")
    print("| tokens | docs | pass | " + " | ".join(
        ["varlen", "varlen+lse", "batched", "segments", "fa3 varlen"]) + " | varlen / fa3 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tokens, docs in SHAPES[:1] if args.quick else SHAPES:
        key = jax.random.key(0)
        q, k, v, w = (jax.random.normal(jax.random.fold_in(key, i), (tokens, HEADS, DIM),
                                        jnp.bfloat16) for i in range(4))
        w = w.astype(jnp.float32)
        fns = _candidates(tokens, docs)
        fwd = timed({n: _forward(f) for n, f in fns.items()}, (q, k, v))
        bwd_fns = {n: _backward(f) for n, f in fns.items()}
        bwd_fns["varlen+lse"] = _backward(fns["varlen"], with_lse=True)
        bwd = timed(bwd_fns, (q, k, v, w))
        for name, times in (("fwd", fwd), ("fwd+bwd", bwd)):
            cells = [f"{times[n] * 1e3:.3f}" if n in times else "-"
                     for n in ("varlen", "varlen+lse", "batched", "segments", "fa3 varlen")]
            ratio = (f"{times['fa3 varlen'] / times['varlen']:.2f}x"
                     if "fa3 varlen" in times else "-")
            print(f"| {tokens} | {docs} | {name} | " + " | ".join(cells) + f" | {ratio} |")
    print("(ms, median of rounds; varlen / fa3 = FA3 time / varlen time: > 1 means faster)")


if __name__ == "__main__":
    main()
