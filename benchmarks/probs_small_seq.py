"""Benchmark: the probability-saving backends, `small_seq` and `probs`, on the CPU.

Command (from the repository root, with attnaux installed, e.g. `pip install -e .`):

    python benchmarks/probs_small_seq.py                  # everything below, best of 5
    python benchmarks/probs_small_seq.py --repeats 9 --kv 4 16 --no-probs

What runs, side by side in one process (float32, layout BSHD, every function jitted; one warm-up
call compiles, then the best of `--repeats` calls, each ended by `jax.block_until_ready`; a path
that takes more than 3 s per call is timed once; the candidates of one shape are measured in
turn, then again in a second round, and each keeps its best, so a burst of load from other
processes does not favour one of them):

1. Memory bandwidth of this machine: a jitted `x + 1` over a 512 MiB float32 array (read + write,
   1 GiB moved; the input is donated so the output is written in place), best of the repeats,
   measured before each kv_seq and once more at the end. On the shared VM it was measured on it
   varies within a run (from about 50 to about 100 GB/s): the fractions use the highest figure
   of the run, and the table header gives the range. For contrast, the same `x + 1` without
   donation (a new output array, every page of it fresh) is measured twice at the end.
2. Decoder cross-attention, batch 30720, q_seq 1, kv_seq in {2, 4, 8, 16}, 8 heads, head dim 128:
   `small_seq` vs `flash` vs `reference` (attnaux's three backends that can serve the shape) vs
   `jax.nn.dot_product_attention(implementation="xla")`. `fwd`: the forward alone (attnaux
   returns out, lse and max; small_seq writes no probabilities in inference). `fwd+bwd`:
   `jax.grad` of `sum(out * dout)` w.r.t. q, k, v (small_seq then saves P in the forward and
   reads it in the backward). The table gives each path's time, `small_seq`'s speed-up over the
   fastest other path, `small_seq`'s achieved bandwidth as a fraction of the copy bandwidth, and
   the CPU time of `small_seq`'s best call (user / system, all threads): system time is the
   operating system zeroing fresh output pages on first touch (XLA gives every call new output
   buffers; attnaux's handlers ask for 2 MiB pages for large ones, `csrc/cpu/cpu_memory.h`).
3. `probs` vs `flash` at 4x256x8x64 and 4x512x8x64 (b x s x h x d, self-attention, not causal),
   forward and forward+backward.

Bytes `small_seq` must move (4 bytes per element; B = batch, H = heads, D = head dim, S = kv_seq):

    fwd     = read q, k, v (B*H*D + 2*B*S*H*D) + write out (B*H*D) + lse, max (2*B*H)
    fwd+bwd = fwd + write P (B*H*S)
              + backward: read q, k, v, dout, P, dlse (B*(2*H*D + 2*S*H*D + H*S + H))
                          write dq, dk, dv (B*(H*D + 2*S*H*D))

These are the bytes the passes must move, each once. The memory system moves more: the operating
system zeroes every fresh output page before the kernel's first write to it (a second write of
out, P, dq, dk and dv, visible as system time), and XLA's own paths pay the same. The copy it is
compared with is the opposite case, memory already mapped and rewritten in place: this machine's
bandwidth.

achieved GB/s = bytes / best time / 1e9; fraction = achieved / copy GB/s, against the highest
copy figure of the run. Because a shared VM's bandwidth drifts by tens of percent within seconds,
`small_seq`'s fraction is also measured paired: five rounds of (copy, then small_seq), each the
best of 3 calls, and the median of the five per-round fractions (with their range). Progress goes
to stderr, markdown tables to stdout.
"""

import argparse
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import attnaux


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def best_time(fn, args, repeats: int, slow_s: float = 3.0) -> tuple[float, float, float]:
    """(wall, user CPU, system CPU) seconds of the fastest of `repeats` calls after a warm-up; a
    path slower than `slow_s` per call is timed once (its ratio to small_seq is far beyond noise
    anyway). CPU times are the whole process's (every thread) during that call."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    best = (float("inf"), 0.0, 0.0)
    for _ in range(repeats):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        if wall < best[0]:
            best = (wall, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime)
        if best[0] > slow_s:
            break
    return best


def copy_bandwidth(repeats: int, mib: int = 512, donate: bool = True) -> float:
    """GB/s of a jitted `x + 1` over `mib` MiB of float32 (bytes read + written). With `donate`
    the input is donated, so XLA writes in place and the figure is memory bandwidth, not the cost
    of faulting in fresh output pages; without it XLA writes a new array, as every op whose
    output is not donated does."""
    n = mib * 2**20 // 4
    step = jax.jit(lambda x: x + 1, donate_argnums=0 if donate else ())  # x + 0 would be elided
    x = step(jnp.ones((n,), jnp.float32))
    best = float("inf")
    for _ in range(max(repeats, 3)):
        jax.block_until_ready(x)
        t0 = time.perf_counter()
        y = jax.block_until_ready(step(x))
        best = min(best, time.perf_counter() - t0)
        if donate:
            x = y
        del y
    del x
    return 2 * n * 4 / best / 1e9


def _attnaux(backend):
    def fwd(q, k, v):
        out, aux = attnaux.attention(q, k, v, backend=backend)
        return out, aux.lse, aux.max

    return fwd


def _xla(q, k, v):
    return (jax.nn.dot_product_attention(q, k, v, implementation="xla"),)


def _fwd_bwd(fwd):
    def loss(q, k, v, dout):
        return jnp.sum(fwd(q, k, v)[0] * dout)

    return jax.grad(loss, argnums=(0, 1, 2))


def small_seq_bytes(b, s, h, d, passes):
    fwd = 4 * (b * h * d + 2 * b * s * h * d + b * h * d + 2 * b * h)
    if passes == "fwd":
        return fwd
    bwd = 4 * (b * (2 * h * d + 2 * s * h * d + h * s + h) + b * (h * d + 2 * s * h * d))
    return fwd + 4 * b * h * s + bwd


def inputs(b, sq, skv, h, d, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((b, sq, h, d), (b, skv, h, d), (b, skv, h, d), (b, sq, h, d))
    return tuple(jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for s in shapes)


def _best_of_rounds(cands, make, repeats, rounds=2):
    """Each candidate's best (wall, user, sys) over `rounds` rounds that time every candidate in
    turn."""
    best = {}
    for _ in range(rounds):
        for name, f in cands.items():
            fn, args = make(f)
            t = best_time(fn, args, repeats)
            if name not in best or t[0] < best[name][0]:
                best[name] = t
            if t[0] > 3.0:  # a slow path: one measurement is enough
                cands = {n: g for n, g in cands.items() if n != name}
    return best


def paired_fraction(fn, args, nbytes, rounds=5, repeats=3):
    """(median, min, max) over `rounds` of small_seq GB/s / copy GB/s, the copy measured just
    before."""
    fractions = []
    for _ in range(rounds):
        copy = copy_bandwidth(repeats)
        wall = best_time(fn, args, repeats)[0]
        fractions.append(nbytes / wall / 1e9 / copy)
    return statistics.median(fractions), min(fractions), max(fractions)


def bench_small_seq(kvs, repeats, batch=30720, heads=8, dim=128):
    cands = {
        "small_seq": _attnaux("small_seq"),
        "flash": _attnaux("flash"),
        "reference": _attnaux("reference"),
        "xla (jax.nn)": _xla,
    }
    copies, rows = [], []
    for s in kvs:
        _log(f"copy bandwidth (before kv={s})")
        copies.append(copy_bandwidth(repeats))
        q, k, v, dout = inputs(batch, 1, s, heads, dim)
        for passes in ("fwd", "fwd+bwd"):
            _log(f"small_seq shape kv={s} {passes}")

            def make(f, passes=passes, arrays=(q, k, v, dout)):
                if passes == "fwd":
                    return jax.jit(f), arrays[:3]
                return jax.jit(_fwd_bwd(f)), arrays

            best = _best_of_rounds(cands, make, repeats)
            _log(f"small_seq kv={s} {passes}: paired fraction of the copy")
            fn, args = make(cands["small_seq"])
            nbytes = small_seq_bytes(batch, s, heads, dim, passes)
            rows.append((s, passes, best, paired_fraction(fn, args, nbytes)))
    _log("copy bandwidth (end)")
    copies.append(copy_bandwidth(repeats))
    fresh_copies = [copy_bandwidth(repeats, donate=False) for _ in range(2)]
    copy_gbs = max(copies)
    print(f"\n## small_seq: batch {batch}, q_seq 1, {heads} heads, head dim {dim}, float32\n")
    print(f"copy bandwidth (jitted, donated x + 1 over 512 MiB): {copy_gbs:.1f} GB/s, the "
          f"highest of {len(copies)} measurements through the run "
          f"({min(copies):.1f} to {max(copies):.1f})\n")
    print(f"the same x + 1 into a new array (not donated): {max(fresh_copies):.1f} GB/s, the "
          f"higher of {len(fresh_copies)} (what first-touch page zeroing leaves of the bandwidth "
          "when every output page is fresh)\n")
    header = ["kv_seq", "pass"] + [f"{n} ms" for n in cands] + [
        "speed-up vs best other", "small_seq GB/s", "fraction of best copy",
        "paired fraction (min-max)", "small_seq CPU ms (user / sys)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for s, passes, times, paired in rows:
        t_ss, user, system = times["small_seq"]
        other = min(t[0] for n, t in times.items() if n != "small_seq")
        gbs = small_seq_bytes(batch, s, heads, dim, passes) / t_ss / 1e9
        row = [str(s), passes] + [f"{1e3 * times[n][0]:.1f}" for n in cands] + [
            f"{other / t_ss:.2f}x", f"{gbs:.1f}", f"{gbs / copy_gbs:.2f}",
            "{:.2f} ({:.2f}-{:.2f})".format(*paired), f"{1e3 * user:.0f} / {1e3 * system:.0f}"]
        print("| " + " | ".join(row) + " |", flush=True)


def bench_probs(repeats, shapes=((4, 256, 8, 64), (4, 512, 8, 64))):
    print("\n## probs vs flash (self-attention, not causal, float32)\n")
    header = ["b x s x h x d", "pass", "probs ms", "flash ms", "flash / probs"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for b, s, h, d in shapes:
        q, k, v, dout = inputs(b, s, s, h, d)
        for passes in ("fwd", "fwd+bwd"):
            _log(f"probs shape {b}x{s}x{h}x{d} {passes}")

            def make(f, passes=passes, arrays=(q, k, v, dout)):
                if passes == "fwd":
                    return jax.jit(f), arrays[:3]
                return jax.jit(_fwd_bwd(f)), arrays

            cands = {"probs": _attnaux("probs"), "flash": _attnaux("flash")}
            times = {n: t[0] for n, t in _best_of_rounds(cands, make, repeats, rounds=3).items()}
            row = [f"{b}x{s}x{h}x{d}", passes, f"{1e3 * times['probs']:.2f}",
                   f"{1e3 * times['flash']:.2f}", f"{times['flash'] / times['probs']:.2f}"]
            print("| " + " | ".join(row) + " |", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--batch", type=int, default=30720)
    parser.add_argument("--no-probs", action="store_true", help="skip the probs vs flash part")
    parser.add_argument("--no-small-seq", action="store_true", help="skip the small_seq part")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.default_backend()}, {jax.device_count()} device(s)")
    if not args.no_small_seq:
        bench_small_seq(args.kv, args.repeats, batch=args.batch)
    if not args.no_probs:
        bench_probs(args.repeats)


if __name__ == "__main__":
    main()
