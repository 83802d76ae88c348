"""`score_mod`/`mask_mod` (`auto`: the C++ kernels' score programs on CPU, `flex` elsewhere; and
`flex` itself) against the built-in options they spell, one run.

    python benchmarks/score_mod.py                  # 1 x 2048 x 8 x 64, float32 (CPU default)
    python benchmarks/score_mod.py --shape 4x4096x16x128 --dtype bfloat16   # on a GPU

Pairs (the same math both ways): softcap via `score_mod` vs `softcap=`, causal via `mask_mod` vs
`causal=True`, ALiBi via `score_mod` (closing over the slopes) vs a precomputed `[H, S, S]`
`bias`, a document mask via `mask_mod` vs segment ids (4 documents: the block table skips 3/4
of the tiles; the identity `score_mod` row is the same call without the mask, the dense cost), plus
the materialising `reference` with the same functions (it needs the `S x S` scores). Forward
and forward+backward (`jax.vjp` of out), jitted, best of `--repeats` after a warm-up; prints ms
and the ratios to the built-in option (`--no-flex` leaves the flex column out).
"""

import argparse
import time

import jax
import jax.numpy as jnp

import attnaux as ax


def best(fn, args, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1x2048x8x64")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--no-flex", action="store_true")
    args = parser.parse_args()
    b, s, h, d = map(int, args.shape.split("x"))
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, w = (jax.random.normal(kk, (b, s, h, d), dtype) for kk in keys)
    slopes = 2.0 ** -jnp.arange(1, h + 1, dtype=jnp.float32)
    i, j = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    doc = jnp.arange(s) // (s // 4)  # 4 documents
    seg = jnp.broadcast_to(doc, (b, s))
    pairs = {
        "softcap": (dict(score_mod=lambda x, bb, hh, ii, jj: 30.0 * jnp.tanh(x / 30.0)),
                    dict(softcap=30.0)),
        "causal": (dict(mask_mod=lambda bb, hh, ii, jj: jj <= ii), dict(causal=True)),
        "alibi": (dict(score_mod=lambda x, bb, hh, ii, jj: x + slopes[hh] * (jj - ii),
                       causal=True),
                  dict(bias=(slopes[:, None, None] * (j - i)[None]).astype(jnp.float32),
                       causal=True)),
        # block sparsity: 4 documents, so flex visits a quarter of the tiles (explain says)
        "document mask": (dict(mask_mod=lambda bb, hh, ii, jj: doc[ii] == doc[jj]),
                          dict(q_segment_ids=seg, kv_segment_ids=seg)),
        "no mask (dense, for the document row)": (dict(score_mod=lambda x, bb, hh, ii, jj: x),
                                                  dict()),
    }
    print(f"{jax.devices()[0].device_kind}; JAX {jax.__version__}; {args.shape} {args.dtype}")
    print("| spelled | auto with functions (backend) fwd / fwd+bwd ms | flex fwd / fwd+bwd ms | "
          "built-in fwd / fwd+bwd ms | auto / built-in | flex / built-in | reference with the "
          "functions fwd / fwd+bwd ms |")
    print("|---|---|---|---|---|---|---|")
    nan = (float("nan"), float("nan"))
    for name, (mods, builtin) in pairs.items():
        row = []
        runs = (mods, dict(mods, backend="flex"), builtin, dict(mods, backend="reference"))
        for n, opts in enumerate(runs):
            if (n == 3 and args.no_reference) or (n == 1 and args.no_flex):
                row.append(nan)
                continue

            # arrays travel as arguments: closed over, a [H, S, S] bias would be folded into
            # the compiled program as a constant
            arrays = {n_: x for n_, x in opts.items() if isinstance(x, jax.Array)}
            rest = {n_: x for n_, x in opts.items() if n_ not in arrays}

            def fwd(q, k, v, arrays, rest=rest):
                return ax.attention(q, k, v, **rest, **arrays)[0]

            def fb(q, k, v, arrays, fwd=fwd):
                return jax.vjp(lambda q, k, v: fwd(q, k, v, arrays), q, k, v)[1](w)

            row.append((best(jax.jit(fwd), (q, k, v, arrays), args.repeats),
                        best(jax.jit(fb), (q, k, v, arrays), args.repeats)))
        chosen = ax.explain(q, k, v, **mods).backend
        (af, ab), (xf, xb), (bf, bb), (rf, rb) = row
        print(f"| {name} | {af * 1e3:.3f} / {ab * 1e3:.3f} ({chosen}) | {xf * 1e3:.3f} / "
              f"{xb * 1e3:.3f} | {bf * 1e3:.3f} / {bb * 1e3:.3f} | {af / bf:.2f}x / "
              f"{ab / bb:.2f}x | {xf / bf:.2f}x / {xb / bb:.2f}x | {rf * 1e3:.1f} / "
              f"{rb * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
