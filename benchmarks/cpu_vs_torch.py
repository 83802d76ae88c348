"""CPU attention side by side: attnaux, PyTorch's scaled_dot_product_attention, XLA, one run.

    python benchmarks/cpu_vs_torch.py                    # dense and decode, float32 and bf16
    python benchmarks/cpu_vs_torch.py --only decode --dtypes float32

Dense rows: the CPU shapes of shared/BENCHMARKS.md (b x s x h x d, causal and not), GFLOP/s with
the FlashAttention convention (forward 4 b h sq skv d, halved for causal; forward+backward 3.5x
that). Decode rows: q_seq 1..16 against a long KV cache; their figure is the K and V bytes read
per second, next to this machine's copy bandwidth measured in the same run (a 256 MiB NumPy copy,
bytes read + written), since decode is memory-bound, and next to the arithmetic bound measured in
the same run: `cpu_peak.c` (compiled here with `cc -march=native` where a C compiler and AVX-512
are present) gives the cores' multiply-add peak R (512-bit FMAs for float32, VDPBF16PS for
bfloat16), and a key of a kv head with r query rows (q_seq x the GQA group) and head dim d needs
2 r d multiply-adds for its 2 d values of K and V, so no kernel reads them faster than R x (bytes
of a value) / r (bfloat16: the VDPBF16PS bound; where the decode multiplies on AMX tiles, 16
bfloat16 rows a kv head on a CPU that has them, it can go past it). Where that bound is below a
share of the copy bandwidth, the share cannot be reached on this machine. The same probe reads
a 256 MiB buffer with every core (512-bit loads, nothing else): decode reads K and V once, so
that **read stream** is its memory bound, which can sit well below the copy's bytes read +
written (59% of it on a 2-core Xeon VM). Every time is the best of `--repeats` after a warm-up,
jitted (attnaux, XLA) or under `torch.no_grad` / autograd (torch), with both cores.
torch is optional: without it its column is empty. Ratios > 1 mean attnaux is faster.
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import attnaux as ax

DENSE = [  # b, sq, skv, h_q, h_kv, d
    (4, 512, 512, 8, 8, 64), (1, 2048, 2048, 8, 8, 64), (1, 4096, 4096, 8, 8, 64),
    (1, 2048, 2048, 8, 8, 128),
]
DECODE = [  # b, sq, skv, h_q, h_kv, d
    (8, 1, 4096, 8, 8, 128), (64, 1, 1024, 8, 8, 64), (1, 1, 32768, 8, 8, 128),
    (8, 1, 4096, 32, 8, 128), (4, 4, 8192, 32, 8, 128), (1, 16, 16384, 8, 8, 128),
    (1, 1, 131072, 8, 2, 128),
]


def best(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(repeats=5) -> float:
    """Bytes read + written per second by a 256 MiB memory copy on every core (NumPy's copy,
    one slice per core in threads: it releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    cores = os.cpu_count() or 1
    src = np.ones(64 * 2**20, np.float32)
    dst = np.empty_like(src)
    parts = np.array_split(np.arange(src.size), cores)
    bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts]
    with ThreadPoolExecutor(cores) as pool:
        def copy():
            list(pool.map(lambda r: np.copyto(dst[r[0]:r[1]], src[r[0]:r[1]]), bounds))

        t = best(copy, repeats)
    return 2 * src.nbytes / t


def arithmetic_peak(seconds=0.3) -> dict[str, float] | None:
    """`{"float32": R, "bfloat16": R, "read": B}`, the multiply-adds per second of every core
    and the bytes per second they read from memory together (`cpu_peak.c`; bfloat16 falls back
    to the float32 FMAs where the CPU has no AVX-512 BF16), or None where the probe cannot be
    built or run here (no C compiler, no AVX-512)."""
    import subprocess
    import tempfile

    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_peak.c")
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "cpu_peak")
        try:
            subprocess.run([os.environ.get("CC", "cc"), "-O2", "-march=native", "-pthread",
                            source, "-o", binary], check=True, capture_output=True)
            result = subprocess.run([binary, str(os.cpu_count() or 1), str(seconds)], check=True,
                                    capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError):
            return None
    rates = dict((name, float(value)) for name, value in
                 (line.split() for line in result.stdout.splitlines()))
    return {"float32": rates["fma32"], "bfloat16": rates["dpbf16"] or rates["fma32"],
            "read": rates["read"]}


def jax_fns(q, k, v, w, causal, backend):
    def attn(q, k, v):
        if backend == "xla":
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
        return ax.attention(q, k, v, causal=causal)[0]

    fwd = jax.jit(attn)
    fb = jax.jit(lambda q, k, v: jax.vjp(attn, q, k, v)[1](w))
    return (lambda: jax.block_until_ready(fwd(q, k, v)),
            lambda: jax.block_until_ready(fb(q, k, v)))


def torch_fns(q, k, v, w, causal, dtype):
    import torch

    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]

    def t(x, grad=False):  # BSHD -> BHSD, contiguous
        x = torch.from_numpy(np.asarray(x, np.float32)).to(tdtype).transpose(1, 2).contiguous()
        return x.requires_grad_(grad)

    tq, tk, tv = t(q), t(k), t(v)
    gq, gk, gv = t(q, True), t(k, True), t(v, True)
    tw = t(w)
    gqa = q.shape[2] != k.shape[2]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fwd():
        with torch.no_grad():
            sdpa(tq, tk, tv, is_causal=causal, enable_gqa=gqa)

    def fb():
        gq.grad = gk.grad = gv.grad = None
        out = sdpa(gq, gk, gv, is_causal=causal, enable_gqa=gqa)
        out.backward(tw)

    return fwd, fb


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("dense", "decode"), default=None)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-backward", action="store_true")
    args = parser.parse_args()
    try:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    bandwidth = copy_bandwidth()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    peak = arithmetic_peak() if args.only in (None, "decode") else None
    print(f"{cpu}; {os.cpu_count()} cores; JAX {jax.__version__}; torch {torch_version}; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write); multiply-add peak "
          + ("not measured" if peak is None else
             f"{peak['float32'] / 1e9:.0f} G/s float32, {peak['bfloat16'] / 1e9:.0f} G/s "
             f"bfloat16; read stream {peak['read'] / 1e9:.1f} GB/s "
             f"({peak['read'] / bandwidth:.0%} of the copy)"))
    rng = np.random.default_rng(0)
    for dtype in args.dtypes:
        jdtype = jnp.dtype(dtype)
        if args.only in (None, "dense"):
            print(f"\n### dense, {dtype}: GFLOP/s fwd / fwd+bwd (ratio attnaux / torch)")
            print("| b x s x h x d | causal | attnaux | torch SDPA | XLA | attnaux / torch |")
            print("|---|---|---|---|---|---|")
            for b, sq, skv, hq, hk, d in DENSE:
                for causal in (False, True):
                    shapes = ((b, sq, hq, d), (b, skv, hk, d), (b, skv, hk, d), (b, sq, hq, d))
                    q, k, v, w = (jnp.asarray(rng.standard_normal(s), jdtype) for s in shapes)
                    flops = 4 * b * hq * sq * skv * d / (2 if causal else 1)
                    row = {}
                    for name in ("attnaux", "torch", "xla"):
                        if name == "torch" and torch_version is None:
                            row[name] = (float("nan"), float("nan"))
                            continue
                        if name == "xla" and dtype != "float32":
                            row[name] = (float("nan"), float("nan"))  # slow and beside the point
                            continue
                        fns = (torch_fns(q, k, v, w, causal, dtype) if name == "torch"
                               else jax_fns(q, k, v, w, causal, name))
                        tf = best(fns[0], args.repeats)
                        tb = float("nan") if args.no_backward else best(fns[1], args.repeats)
                        row[name] = (flops / tf / 1e9, 3.5 * flops / tb / 1e9)
                    a, t, x = row["attnaux"], row["torch"], row["xla"]
                    print(f"| {b}x{sq}x{hq}x{d} | {'yes' if causal else 'no'} | {a[0]:.0f} / "
                          f"{a[1]:.0f} | {t[0]:.0f} / {t[1]:.0f} | {x[0]:.0f} / {x[1]:.0f} | "
                          f"{a[0] / t[0]:.2f} / {a[1] / t[1]:.2f} |", flush=True)
        if args.only in (None, "decode"):
            print(f"\n### decode, {dtype}: K+V GB/s fwd (% of copy bandwidth), fwd+bwd ms")
            print("| b x sq x skv x hq/hkv x d | attnaux fwd | torch fwd | XLA fwd | "
                  "attnaux / torch fwd | fwd+bwd ms attnaux / torch | attnaux / torch fwd+bwd "
                  "| arithmetic bound GB/s (% of copy) | attnaux / bound | attnaux / read stream |")
            print("|---|---|---|---|---|---|---|---|---|---|")
            for b, sq, skv, hq, hk, d in DECODE:
                shapes = ((b, sq, hq, d), (b, skv, hk, d), (b, skv, hk, d), (b, sq, hq, d))
                q, k, v, w = (jnp.asarray(rng.standard_normal(s), jdtype) for s in shapes)
                kv_bytes = 2 * b * skv * hk * d * jdtype.itemsize
                row = {}
                for name in ("attnaux", "torch", "xla"):
                    if name == "torch" and torch_version is None:
                        row[name] = (float("nan"), float("nan"))
                        continue
                    fns = (torch_fns(q, k, v, w, False, dtype) if name == "torch"
                           else jax_fns(q, k, v, w, False, name))
                    tb = float("nan") if args.no_backward else best(fns[1], args.repeats)
                    row[name] = (best(fns[0], args.repeats), tb)
                a, t, x = row["attnaux"], row["torch"], row["xla"]

                def gbs(sec, kv_bytes=kv_bytes):
                    return f"{kv_bytes / sec / 1e9:.1f} ({kv_bytes / sec / bandwidth:.0%})"

                # 2 r d multiply-adds per key of a kv head (r rows) for its 2 d values
                rows = sq * (hq // hk)
                bound = (float("nan") if peak is None
                         else peak[dtype] * jdtype.itemsize / rows)
                stream = float("nan") if peak is None else peak["read"]
                print(f"| {b}x{sq}x{skv}x{hq}/{hk}x{d} | {gbs(a[0])} | {gbs(t[0])} | "
                      f"{gbs(x[0])} | {t[0] / a[0]:.2f} | {a[1] * 1e3:.2f} / {t[1] * 1e3:.2f} | "
                      f"{t[1] / a[1]:.2f} | {bound / 1e9:.1f} ({bound / bandwidth:.0%}) | "
                      f"{kv_bytes / a[0] / bound:.2f} | {kv_bytes / a[0] / stream:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
