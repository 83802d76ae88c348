"""GPU benchmark: attnaux `flash` (cuDNN, returning lse and max) vs jax.nn cuDNN attention.

    python benchmarks/gpu_flash.py            # every GPU shape of shared/BENCHMARKS.md, bf16
    python benchmarks/gpu_flash.py --quick    # two shapes
    python benchmarks/gpu_flash.py --segments # packed sequences (segment ids), see below

Side by side in one run, for each shape and causal mode, forward and forward+backward:

- `attnaux`: `attnaux.attention(..., backend="flash")`, returning out, aux.lse and aux.max;
- `attnaux lse`: the same call asking cuDNN for lse alone (its Stats output), to show what the
  max costs; the cuDNN frontend picks the implementation, and for a Stats-only graph without
  masks it may pick its "unified" engine, which on cuDNN < 9.21 cannot emit the max at all;
- `attnaux lse (composite)`: lse alone on the composite engine that attnaux's lse+max graph runs
  on (forward only): the max's cost on one engine;
- `cudnn`: `jax.nn.dot_product_attention(..., implementation="cudnn")`, which returns neither.

The forward+backward pass is `jax.vjp` of the output with a fixed cotangent (no lse cotangent).
Timing: jitted, 2 warm-up calls, then rounds of back-to-back calls (one block_until_ready at the
end; as many calls as take about 50 ms, 10 to 300); seven rounds with the candidates taking
turns, the median of the rounds' means reported. FLOPs as FlashAttention: 4*b*h*s*s*d forward,
halved for causal; forward+backward = 3.5x forward. Prints a markdown table (TFLOP/s, ratios).

`--segments`: packed sequences, each row of the batch holding 4 segments of random lengths (the
same ids for queries and keys), times in ms of: attnaux `flash` with the segment ids (attnaux's
score modifier forward, a constant segment bias backward); the same masking spelled by the user
as a `[B, 1, S, S]` bias; the `probs` backend with the segment ids (what `auto` picked on GPU
before `flash` served them); and `flash` without segments (the unmasked bound).
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import attnaux
from attnaux._flash_cudnn import flash_attention_cuda
from attnaux._internal import canonical_problem

SHAPES = [  # (b, s, h, d), as in BENCHMARKS.md's GPU table
    (8, 1024, 16, 128),
    (4, 2048, 16, 128),
    (2, 4096, 16, 128),
    (1, 8192, 16, 128),
    (1, 16384, 16, 128),
    (2, 4096, 32, 64),
]
# FlashAttention-3 (XLA FFI) on an H100, TFLOP/s forward / forward+backward (BENCHMARKS.md)
FA3 = {
    ((8, 1024, 16, 128), False): (517, 441), ((8, 1024, 16, 128), True): (331, 289),
    ((4, 2048, 16, 128), False): (579, 547), ((4, 2048, 16, 128), True): (488, 423),
    ((2, 4096, 16, 128), False): (646, 620), ((2, 4096, 16, 128), True): (578, 527),
    ((1, 8192, 16, 128), False): (678, 660), ((1, 8192, 16, 128), True): (615, 618),
    ((1, 16384, 16, 128), False): (684, 662), ((1, 16384, 16, 128), True): (630, 630),
    ((2, 4096, 32, 64), False): (329, 321), ((2, 4096, 32, 64), True): (317, 296),
}


def attnaux_full(q, k, v, causal):
    out, aux = attnaux.attention(q, k, v, causal=causal, backend="flash")
    return out, aux.lse, aux.max


def attnaux_lse(q, k, v, causal, composite=False):
    problem = canonical_problem(q, k, v, causal=causal)
    out, lse, _ = flash_attention_cuda(problem.arrays, problem.options, with_max=False,
                                       composite=composite)
    return out, lse


def attnaux_lse_composite(q, k, v, causal):
    return attnaux_lse(q, k, v, causal, composite=True)


def cudnn(q, k, v, causal):
    return (jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),)


CANDIDATES = {"attnaux": attnaux_full, "attnaux lse": attnaux_lse,
              "attnaux lse (composite)": attnaux_lse_composite, "cudnn": cudnn}
FWD_ONLY = ("attnaux lse (composite)",)


def _mean_of_calls(fn, args, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        r = fn(*args)
    jax.block_until_ready(r)
    return (time.perf_counter() - t0) / calls


def timed(fns, args, rounds=7, round_s=0.05):
    """Median over `rounds` of the mean time of back-to-back calls (as many as take about
    `round_s`, 10 to 300), after 2 warm-ups; the candidates take turns within each round, so
    drift hits them alike."""
    calls = {}
    for name, fn in fns.items():
        for _ in range(2):
            jax.block_until_ready(fn(*args))
        calls[name] = int(min(300, max(10, round_s / _mean_of_calls(fn, args, 5))))
    means = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            means[name].append(_mean_of_calls(fn, args, calls[name]))
    return {name: statistics.median(m) for name, m in means.items()}


def run(shapes, causal_modes):
    rows = []
    for shape in shapes:
        b, s, h, d = shape
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in keys)
        for causal in causal_modes:
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            fwd, fwd_bwd = {}, {}
            for name, f in CANDIDATES.items():
                fwd[name] = jax.jit(lambda q, k, v, f=f, c=causal: f(q, k, v, c))
                if name in FWD_ONLY:
                    continue
                fwd_bwd[name] = jax.jit(
                    lambda q, k, v, do, f=f, c=causal: jax.vjp(
                        lambda q, k, v: f(q, k, v, c)[0], q, k, v
                    )[1](do)
                )
            t_f = timed(fwd, (q, k, v))
            t_fb = timed(fwd_bwd, (q, k, v, do))
            res = {n: (flops / t_f[n] / 1e12,
                       3.5 * flops / t_fb[n] / 1e12 if n in t_fb else float("nan"))
                   for n in CANDIDATES}
            rows.append((shape, causal, res))
            a, al, ac, c = (res[n] for n in CANDIDATES)
            print(f"{'x'.join(map(str, shape))} causal={causal}: attnaux {a[0]:.0f}/{a[1]:.0f}, "
                  f"lse-only {al[0]:.0f}/{al[1]:.0f} (composite {ac[0]:.0f}), jax.nn cudnn "
                  f"{c[0]:.0f}/{c[1]:.0f} TFLOP/s", flush=True)
    return rows


def _segment_ids(b, s, segments=4, seed=0):
    cuts = jax.random.randint(jax.random.key(seed), (b, segments - 1), 1, s)
    return jnp.sum(jnp.arange(s)[None, :, None] >= cuts[:, None, :], axis=-1).astype(jnp.int32)


def run_segments(shapes):
    print("| b x s x h x d | causal | flash, segment ids | flash, segments as a bias "
          "| probs, segment ids | flash, no segments | segment ids vs bias / vs probs |")
    print("|---|---|---|---|---|---|---|")
    for shape in shapes:
        b, s, h, d = shape
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in keys)
        seg = _segment_ids(b, s)
        bias = jnp.where(seg[:, None, :, None] == seg[:, None, None, :], 0.0, -jnp.inf)
        bias = bias.astype(jnp.bfloat16)
        for causal in (False, True):
            calls = {
                "seg": lambda q, k, v, seg, bias, c=causal: attnaux.attention(
                    q, k, v, q_segment_ids=seg, causal=c, backend="flash")[0],
                "bias": lambda q, k, v, seg, bias, c=causal: attnaux.attention(
                    q, k, v, bias=bias, causal=c, backend="flash")[0],
                "probs": lambda q, k, v, seg, bias, c=causal: attnaux.attention(
                    q, k, v, q_segment_ids=seg, causal=c, backend="probs")[0],
                "none": lambda q, k, v, seg, bias, c=causal: attnaux.attention(
                    q, k, v, causal=c, backend="flash")[0],
            }
            fwd = {n: jax.jit(f) for n, f in calls.items()}
            fwd_bwd = {
                n: jax.jit(lambda q, k, v, seg, bias, do, f=f: jax.vjp(
                    lambda q, k, v: f(q, k, v, seg, bias), q, k, v)[1](do))
                for n, f in calls.items()
            }
            t_f = timed(fwd, (q, k, v, seg, bias))
            t_fb = timed(fwd_bwd, (q, k, v, seg, bias, do))
            ms = {n: (1e3 * t_f[n], 1e3 * t_fb[n]) for n in calls}
            cells = " | ".join(f"{ms[n][0]:.3f} / {ms[n][1]:.3f}" for n in calls)
            ratios = (f"{t_f['bias'] / t_f['seg']:.2f}x / {t_fb['bias'] / t_fb['seg']:.2f}x; "
                      f"{t_f['probs'] / t_f['seg']:.2f}x / {t_fb['probs'] / t_fb['seg']:.2f}x")
            print(f"| {'x'.join(map(str, shape))} | {'yes' if causal else 'no'} | {cells} "
                  f"| {ratios} |", flush=True)


def table(rows) -> str:
    lines = [
        "| b x s x h x d | causal | attnaux flash (lse+max) | attnaux lse only (cuDNN's pick) "
        "| lse only, composite (fwd) | jax.nn cudnn | ratio vs cudnn fwd / fwd+bwd "
        "| max cost fwd, same engine | max cost vs cuDNN's pick fwd / fwd+bwd | FA-3 (H100) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, causal, res in rows:
        a, al, ac, c = (res[n] for n in CANDIDATES)
        fa = FA3.get((shape, causal))
        fa_text = f"{fa[0]} / {fa[1]}" if fa else "-"
        # max cost: how much faster lse-only is than lse+max (positive = max costs time)
        lines.append(
            f"| {'x'.join(map(str, shape))} | {'yes' if causal else 'no'} "
            f"| {a[0]:.0f} / {a[1]:.0f} | {al[0]:.0f} / {al[1]:.0f} | {ac[0]:.0f} "
            f"| {c[0]:.0f} / {c[1]:.0f} | {a[0] / c[0]:.2f} / {a[1] / c[1]:.2f} "
            f"| {100 * (ac[0] / a[0] - 1):+.1f}% "
            f"| {100 * (al[0] / a[0] - 1):+.1f}% / {100 * (al[1] / a[1] - 1):+.1f}% "
            f"| {fa_text} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two shapes only")
    parser.add_argument("--segments", action="store_true",
                        help="packed sequences (segment ids) instead; times in ms fwd / fwd+bwd")
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit(f"needs a GPU; JAX's default backend is {jax.default_backend()!r}")
    shapes = SHAPES[:1] + SHAPES[-1:] if args.quick else SHAPES
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}, cuDNN "
          f"{attnaux._ffi.ext_cuda().cudnn_version()}", flush=True)
    if args.segments:
        run_segments(shapes[:3])
        return
    rows = run(shapes, (False, True))
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
