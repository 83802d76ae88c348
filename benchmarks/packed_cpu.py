"""Packed sequences on CPU: the same documents packed into one row (segment ids) against
batched (one row each), `attnaux.attention` with the `flash` and `probs` backends, float32, side
by side in one run.

`python benchmarks/packed_cpu.py [--lengths 2048 16384] [--docs 4 16 64]`: for each total length
T and number of documents (equal lengths T / docs), heads 8 x dim 64, causal and not, the
forward and forward+backward times (best of `--repeats` rounds after a warm-up, the candidates
taking turns in each) and packed / batched.
`probs` (with `return_probs=True`: P is written, [1, 8, T, T] packed) runs where its P fits,
T <= `--probs-max-length`. The packed call's kernels skip the (query tile, key tile) pairs whose
segments differ; `probs` still writes the zeros of P there, which batched does not have. The
`varlen / batched` columns time `attnaux.varlen_attention` on the same documents (`[T, h, d]`
with cu_seqlens; on CPU it gathers them per sequence and runs the batched kernels, or, where
`max_seqlen` would pad to many times the tokens, lays them out in one packed row).
`--max-seqlen tokens` gives varlen the number of tokens as `max_seqlen` (the bound a jitted
caller knows without reading the lengths) instead of the longest document.

XLA beside them (`flash` rows, T <= `--xla-max-length`, 4096 by default: XLA materialises the
`[*, 8, T, T]` scores): `jax.nn.dot_product_attention(..., implementation="xla")` on the packed
row with the segment ids as a dense `[1, 1, T, T]` mask (`xla packed`), and on the documents as
a batch (`xla batched`); the table's last columns give attnaux's packed time over each."""

import argparse
import time

import jax
import jax.numpy as jnp

import attnaux as ax


def best_in_turns(fns, *args, repeats):
    """Each function's best time over `repeats` rounds in which they take turns, after a warm-up
    call each: a shared machine's drift hits them alike (timed one after another, each its
    repeats in a row, one 256-token cell read 1.35x in one run and 1.14x in the next)."""
    for fn in fns:
        jax.block_until_ready(fn(*args))
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _lse_sum(aux):
    """The loss's lse term (XLA's attention returns no lse: none)."""
    return 0.0 if aux.lse is None else jnp.sum(aux.lse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 16384])
    parser.add_argument("--docs", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--backends", nargs="+", default=["flash", "probs"])
    parser.add_argument("--probs-max-length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-seqlen", choices=("longest", "tokens"), default="longest")
    parser.add_argument("--xla-max-length", type=int, default=4096)
    args = parser.parse_args()
    h, d = 8, 64
    print(f"attnaux {ax.__version__}, JAX {jax.__version__}, float32, heads {h} x dim {d}, "
          f"varlen's max_seqlen: {args.max_seqlen}\n")
    print("| backend | T | docs | causal | packed fwd ms | batched fwd ms | packed / batched "
          "| varlen / batched | packed fwd+bwd ms | batched fwd+bwd ms | packed / batched "
          "| varlen / batched | packed / xla packed fwd, fwd+bwd | packed / xla batched fwd, "
          "fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for total in args.lengths:
        keys = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(key, (1, total, h, d)) for key in keys)
        for backend in args.backends:
            if backend == "probs" and total > args.probs_max_length:
                continue
            options = dict(backend=backend, return_probs=backend == "probs")
            for docs in args.docs:
                seg = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), total // docs)[None]
                for causal in (False, True):
                    def packed(q, k, v, seg=seg, causal=causal, options=options):
                        return ax.attention(q, k, v, causal=causal, q_segment_ids=seg,
                                            kv_segment_ids=seg, **options)

                    def batched(q, k, v, docs=docs, causal=causal, total=total, options=options):
                        shape = (docs, total // docs, h, d)
                        return ax.attention(q.reshape(shape), k.reshape(shape), v.reshape(shape),
                                            causal=causal, **options)

                    cu = jnp.arange(docs + 1, dtype=jnp.int32) * (total // docs)

                    bound = total if args.max_seqlen == "tokens" else total // docs

                    def varlen(q, k, v, cu=cu, causal=causal, longest=bound, options=options):
                        out, aux = ax.varlen_attention(
                            q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_kv=cu,
                            max_seqlen_q=longest, max_seqlen_kv=longest, causal=causal,
                            **options)
                        return out, aux

                    def xla_packed(q, k, v, seg=seg, causal=causal):
                        mask = seg[:, None, :, None] == seg[:, None, None, :]
                        out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                                           implementation="xla")
                        return out, ax.AttnAux(lse=None, max=None)

                    def xla_batched(q, k, v, docs=docs, causal=causal, total=total):
                        shape = (docs, total // docs, h, d)
                        out = jax.nn.dot_product_attention(
                            q.reshape(shape), k.reshape(shape), v.reshape(shape),
                            is_causal=causal, implementation="xla")
                        return out, ax.AttnAux(lse=None, max=None)

                    candidates = [packed, batched, varlen]
                    with_xla = backend == "flash" and total <= args.xla_max_length
                    if with_xla:
                        candidates += [xla_packed, xla_batched]
                    # The forward returns P too (probs), so that it is computed and written.
                    fwds = [jax.jit(lambda q, k, v, fn=fn: (fn(q, k, v)[0], fn(q, k, v)[1].probs))
                            for fn in candidates]
                    grads = [jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v)[0])
                                              + _lse_sum(fn(q, k, v)[1]), argnums=(0, 1, 2)))
                             for fn in candidates]
                    row = list(zip(best_in_turns(fwds, q, k, v, repeats=args.repeats),
                                   best_in_turns(grads, q, k, v, repeats=args.repeats)))
                    (pf, pb), (bf, bb), (vf, vb) = row[:3]
                    xla = "- | - |"
                    if with_xla:
                        (xf, xb), (yf, yb) = row[3:]
                        xla = f"{pf / xf:.2f}, {pb / xb:.2f} | {pf / yf:.2f}, {pb / yb:.2f} |"
                    print(f"| {backend} | {total} | {docs} | {'yes' if causal else 'no'} | "
                          f"{pf * 1e3:.1f} | {bf * 1e3:.1f} | {pf / bf:.2f} | {vf / bf:.2f} | "
                          f"{pb * 1e3:.1f} | {bb * 1e3:.1f} | {pb / bb:.2f} | {vb / bb:.2f} | "
                          + xla, flush=True)


if __name__ == "__main__":
    main()
