"""GPU benchmark behind `auto`'s choice between `flash` (cuDNN) and `probs` at short sequences.

    python benchmarks/gpu_auto_table.py

bf16, q_seq = kv_seq in {128, 256, 512}, batch x heads in {4 x 8, 16 x 16, 64 x 16}, head dim 64
and 128, no mask / causal / a boolean mask (`[B, 1, S, S]`, random, every row sees a key): the
forward and forward+backward (`jax.vjp` of out with a fixed cotangent, so P is saved by `probs`)
of `flash`, `probs` and `reference`, side by side in one run (`gpu_flash.timed`: median of rounds,
the candidates taking turns). Prints one markdown row per shape: ms of each, and which is
fastest; `docs/backends.md` carries the table and the rule derived from it
(`attnaux._dispatch.gpu_prefers_probs`).
"""

import itertools
import os
import sys

import jax
import jax.numpy as jnp

import attnaux

sys.path.insert(0, os.path.dirname(__file__))
from gpu_flash import timed  # noqa: E402

BACKENDS = ("flash", "probs", "reference")


def main():
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; bf16")
    print("| b x h | s | d | mask | fwd ms flash / probs / reference | fastest fwd "
          "| fwd+bwd ms flash / probs / reference | fastest fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|")
    for (b, h), s, d, mask in itertools.product(((4, 8), (16, 16), (64, 16)), (128, 256, 512),
                                                (64, 128), ("none", "causal", "mask")):
        key = jax.random.key(s + d)
        q, k, v, w = (jax.random.normal(jax.random.fold_in(key, i), (b, s, h, d), jnp.bfloat16)
                      for i in range(4))
        options = {}
        if mask == "causal":
            options["causal"] = True
        elif mask == "mask":
            m = jax.random.bernoulli(jax.random.fold_in(key, 9), 0.7, (b, 1, s, s))
            options["mask"] = m.at[..., 0].set(True)

        def attend(q, k, v, backend, options=options):
            return attnaux.attention(q, k, v, backend=backend, **options)[0]

        fwd = {n: jax.jit(lambda q, k, v, n=n: attend(q, k, v, n)) for n in BACKENDS}
        fb = {n: jax.jit(lambda q, k, v, n=n, w=w: jax.vjp(lambda *a: attend(*a, n), q, k, v)[1](w))
              for n in BACKENDS}
        t_f = timed(fwd, (q, k, v), rounds=5, round_s=0.02)
        t_fb = timed(fb, (q, k, v), rounds=5, round_s=0.02)

        def cells(t):
            return (" / ".join(f"{t[n] * 1e3:.3f}" for n in BACKENDS),
                    min(BACKENDS, key=t.get))
        (f_ms, f_best), (fb_ms, fb_best) = cells(t_f), cells(t_fb)
        print(f"| {b} x {h} | {s} | {d} | {mask} | {f_ms} | {f_best} | {fb_ms} | {fb_best} |",
              flush=True)


if __name__ == "__main__":
    main()
