"""GPU benchmark: packed sequences, `attnaux.varlen_attention` vs FlashAttention-3's varlen.

    python benchmarks/varlen_gpu.py           # the shapes of issue 22 (bf16, 16 heads x 128)
    python benchmarks/varlen_gpu.py --quick   # one shape
    python benchmarks/varlen_gpu.py --candidates varlen,"varlen cuda-bwd"   # those and FA3
    python benchmarks/varlen_gpu.py --breakdown   # where the Hopper kernels' packed time goes
    python benchmarks/varlen_gpu.py --max-seqlen tokens   # max_seqlen_* = the tokens, a loose
                                                          # static bound (attnaux and FA3 alike)

Side by side in one run, for each (tokens, documents), causal, forward and forward+backward
(`jax.vjp` of the output with a fixed cotangent). The documents have equal lengths, or, in the
rows marked `varied`, lengths drawn from [0.25, 1.75] x the mean (fixed seed) with `max_seqlen`
their longest (`--max-seqlen tokens`: the number of tokens, the bound a jitted caller knows without
reading the lengths):

- `varlen`: `attnaux.varlen_attention` as `auto` serves it (GPU `flash`: cuDNN's ragged layout;
  on a Hopper GPU from `max_seqlen_q` 256 attnaux's CUDA forward over the packed tokens and, at
  head dim 128, attnaux's CUDA backward over them; at other head dims cuDNN's ragged backward,
  or the Hopper kernels' packed backward where `max_seqlen_*` would make cuDNN's grid many times
  the tokens, `_dispatch.GPU_VARLEN_CUDNN_BACKWARD_MAX_SPREAD`; out + lse + max);
- `varlen cuda`: the same call with the CUDA forward at every length and cuDNN's backward
  (`_dispatch.GPU_VARLEN_CUDA_FORWARD_MIN_SEQ = 0`, `GPU_VARLEN_CUDA_BACKWARD` and the spread
  bound off);
- `varlen cuda-bwd`: the same call with attnaux's CUDA kernels both ways at every length
  (`_dispatch.GPU_VARLEN_CUDA_BACKWARD` on, `GPU_VARLEN_CUDA_FORWARD_MIN_SEQ` and
  `GPU_VARLEN_CUDA_BACKWARD_MIN_SEQ` 0);
- `varlen ragged`: the same call with `_dispatch.GPU_VARLEN_CUDA_FORWARD` and the spread bound
  off (cuDNN's ragged layout both ways);
- `varlen hopper`: the same call with `_dispatch.GPU_VARLEN_PREFERS_HOPPER` on (attnaux's own
  kernels, `_hopper_packed`: one packed row, visiting ranges per tile);
- `varlen+lse`: `varlen` with a loss on `aux.lse` too (forward+backward only);
- `batched`: `attnaux.attention` on the same documents as a batch `[n, T/n]` (cuDNN; equal
  lengths only);
- `segments`: `attnaux.attention` on one row with segment ids (on Hopper, attnaux's kernels);
- `fa3 varlen`: FlashAttention-3's `flash_mha_varlen` from the `dew-flash-attn-cu13` wheel (its
  `dew_flash_attn` package importable; skipped otherwise).

`--breakdown` times, per shape, the pieces of the `segments` call on a Hopper GPU: its kernels
alone (token infos and tables made ahead), the tables alone, and attnaux's Hopper kernels on the
batched documents (the same kernels without segments), beside cuDNN batched and FA3.

Every candidate is compiled ahead (`jit(...).lower(...).compile()`; `varlen hopper` with the flag
on and JAX's caches cleared around it). Timing as `benchmarks/gpu_flash.py`: warm-ups, rounds
of back-to-back calls with the candidates taking turns, the median of the rounds' means. Prints
ms and FA3's time over attnaux's (both ways of serving varlen).
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import attnaux
from attnaux import _dispatch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_flash import timed  # noqa: E402

try:
    import dew_flash_attn
except ImportError:  # pragma: no cover - the wheel is optional
    dew_flash_attn = None

SHAPES = [(16384, 16), (16384, 64), (8192, 8), (16384, 4)]  # (tokens, documents)
VARIED = [(16384, 16), (16384, 64)]  # the same, documents of different lengths
HEADS, DIM = 16, 128


def _lengths(tokens, docs, varied):
    """The documents' lengths: equal, or drawn from [0.25, 1.75] x the mean (seeded by `docs`),
    summing to `tokens`."""
    if not varied:
        return np.full(docs, tokens // docs)
    raw = np.random.default_rng(docs).uniform(0.25, 1.75, docs)
    lengths = np.maximum(np.floor(raw / raw.sum() * tokens).astype(int), 1)
    lengths[-1] += tokens - lengths.sum()
    return lengths


def _candidates(tokens, docs, varied=False, loose=False):
    lengths = _lengths(tokens, docs, varied)
    length = int(lengths.max())
    bound = tokens if loose else length  # the static max_seqlen_* of the packed calls
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    ids = jnp.asarray(np.repeat(np.arange(docs), lengths), jnp.int32)[None]
    packed = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=bound, max_seqlen_kv=bound,
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

    fns = {"varlen": varlen, "varlen cuda": varlen, "varlen cuda-bwd": varlen,
           "varlen ragged": varlen, "varlen hopper": varlen, "segments": segments}
    if not varied:
        fns["batched"] = batched
    if dew_flash_attn is not None:
        def fa3(q, k, v):
            return dew_flash_attn.flash_mha_varlen(q, k, v, cu, bound, is_causal=True), None
        fns["fa3 varlen"] = fa3
    return fns


COLUMNS = ["varlen", "varlen cuda", "varlen cuda-bwd", "varlen ragged", "varlen hopper",
           "varlen+lse", "batched", "segments", "fa3 varlen"]
RATIOS = ("varlen", "varlen cuda", "varlen cuda-bwd", "varlen ragged", "varlen hopper")
_CUDNN_BACKWARD = {"GPU_VARLEN_CUDNN_BACKWARD_MAX_SPREAD": float("inf"),  # whatever the bound
                   "GPU_VARLEN_CUDA_BACKWARD": False}
FLAGS = {"varlen hopper": {"GPU_VARLEN_PREFERS_HOPPER": True},
         "varlen cuda": {"GPU_VARLEN_CUDA_FORWARD_MIN_SEQ": 0, **_CUDNN_BACKWARD},
         "varlen cuda-bwd": {"GPU_VARLEN_CUDA_FORWARD_MIN_SEQ": 0, "GPU_VARLEN_CUDA_BACKWARD": True,
                             "GPU_VARLEN_CUDA_BACKWARD_MIN_SEQ": 0},
         "varlen ragged": {"GPU_VARLEN_CUDA_FORWARD": False, **_CUDNN_BACKWARD}}


def _compiled(jitted, args, name=None):
    """`jitted` compiled for `args` with `_dispatch`'s flags of `FLAGS[name]` at trace time (the
    inner jits' caches cleared around a change, so that no trace of the other setting is
    reused)."""
    flags = FLAGS.get(name, {})
    if not flags:
        return jitted.lower(*args).compile()
    saved = {f: getattr(_dispatch, f) for f in flags}
    for f, value in flags.items():
        setattr(_dispatch, f, value)
    jax.clear_caches()
    try:
        return jitted.lower(*args).compile()
    finally:
        for f, value in saved.items():
            setattr(_dispatch, f, value)
        jax.clear_caches()


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


def breakdown(tokens, docs, q, k, v, w, fns):
    """The pieces of the Hopper kernels' packed call (forward and forward+backward)."""
    from attnaux import _hopper_mods, _hopper_packed
    from attnaux._canon import canonicalize, parse_statics

    length = tokens // docs
    statics = parse_statics(scale=None, causal=True, window=None, softcap=None, dropout_rate=0.0)
    ids = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), length)[None]

    def problem(q, k, v, **extra):
        return canonicalize(q, k, v, statics, **extra)

    def hopper_batched(q, k, v):
        b = lambda x: x.reshape(docs, length, *x.shape[1:])  # noqa: E731
        p = problem(b(q), b(k), b(v))
        out, lse, _ = _hopper_mods.run(p.arrays, p.options, None, (), None)
        return out.reshape(q.shape), lse

    p = problem(q[None], k[None], v[None], q_segment_ids=ids, kv_segment_ids=ids)
    infos = _hopper_packed.pad_infos(*_hopper_packed.token_infos(p.arrays, p.options))
    g = _hopper_packed.geometry(p.options, tokens, tokens)
    config = _hopper_packed.hopper.default_config(q.shape[-1])
    st = _hopper_packed._Static(p.options.scale, None, g, config)

    def tables(infos):
        return _hopper_packed.tables(*infos, g, config.block_kv)

    tabs = jax.jit(tables)(infos)

    def kernels(q, k, v):
        out, lse, _ = _hopper_packed._call(st, q[None], k[None], v[None], infos, tabs)
        return out[0], lse

    pieces = {"hopper batched": hopper_batched, "segments kernels": kernels,
              "segments": fns["segments"], "batched": fns["batched"]}
    if "fa3 varlen" in fns:
        pieces["fa3 varlen"] = fns["fa3 varlen"]
    fwd = timed({n: _compiled(_forward(f), (q, k, v)) for n, f in pieces.items()}, (q, k, v))
    fwd["tables"] = timed({"tables": _compiled(jax.jit(tables), (infos,))}, (infos,))["tables"]
    bwd = timed({n: _compiled(_backward(f), (q, k, v, w)) for n, f in pieces.items()},
                (q, k, v, w))
    names = [*pieces, "tables"]
    for name, times in (("fwd", fwd), ("fwd+bwd", bwd)):
        cells = [f"{times[n] * 1e3:.3f}" if n in times else "-" for n in names]
        print(f"| {tokens} | {docs} | {name} | " + " | ".join(cells) + " |")
    return names


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--max-seqlen", choices=("longest", "tokens"), default="longest",
                        help="the packed calls' max_seqlen_*: the longest document (default) or "
                             "the number of tokens")
    parser.add_argument("--candidates", default=None,
                        help="comma-separated columns to time (FA3 always); default: all")
    args = parser.parse_args()
    chosen = None if args.candidates is None else {*args.candidates.split(","), "fa3 varlen"}
    if chosen is not None and not chosen <= set(COLUMNS):
        parser.error(f"--candidates: expected names among {COLUMNS}; got "
                     f"{sorted(chosen - set(COLUMNS))}")
    loose = args.max_seqlen == "tokens"
    if args.breakdown:
        print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
        for tokens, docs in SHAPES[:1] if args.quick else SHAPES:
            key = jax.random.key(0)
            q, k, v, w = (jax.random.normal(jax.random.fold_in(key, i), (tokens, HEADS, DIM),
                                            jnp.bfloat16) for i in range(4))
            names = breakdown(tokens, docs, q, k, v, w.astype(jnp.float32),
                              _candidates(tokens, docs))
        print("| tokens | docs | pass | " + " | ".join(names) + " | (ms, header last)")
        return
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; "
          f"FA3: {'yes' if dew_flash_attn is not None else 'not installed'}; "
          f"max_seqlen: {args.max_seqlen}")
    print("| tokens | docs | pass | " + " | ".join(COLUMNS) + " | "
          + " | ".join(f"fa3 / {n.split()[-1]}" for n in RATIOS) + " |")
    print("|---" * (len(COLUMNS) + 3 + len(RATIOS)) + "|")
    shapes = [(t, d, False) for t, d in SHAPES] + [(t, d, True) for t, d in VARIED]
    for tokens, docs, varied in shapes[:1] if args.quick else shapes:
        key = jax.random.key(0)
        q, k, v, w = (jax.random.normal(jax.random.fold_in(key, i), (tokens, HEADS, DIM),
                                        jnp.bfloat16) for i in range(4))
        w = w.astype(jnp.float32)
        fns = _candidates(tokens, docs, varied, loose)
        lse_too = chosen is None or "varlen+lse" in chosen
        if chosen is not None:
            fns = {n: f for n, f in fns.items() if n in chosen or (n == "varlen" and lse_too)}
        fwd = timed({n: _compiled(_forward(f), (q, k, v), n) for n, f in fns.items()}, (q, k, v))
        bwd_fns = {n: _compiled(_backward(f), (q, k, v, w), n) for n, f in fns.items()}
        if lse_too:
            bwd_fns["varlen+lse"] = _compiled(_backward(fns["varlen"], with_lse=True),
                                              (q, k, v, w))
        bwd = timed(bwd_fns, (q, k, v, w))
        for name, times in (("fwd", fwd), ("fwd+bwd", bwd)):
            cells = [f"{times[n] * 1e3:.3f}" if n in times else "-" for n in COLUMNS]
            ratios = [f"{times['fa3 varlen'] / times[n]:.2f}x"
                      if "fa3 varlen" in times and n in times else "-" for n in RATIOS]
            label = f"{docs} varied" if varied else f"{docs}"
            print(f"| {tokens} | {label} | {name} | " + " | ".join(cells + ratios) + " |")
    print("(ms, median of rounds; fa3 / x = FA3 time / x's time: > 1 means x is faster)")


if __name__ == "__main__":
    main()
