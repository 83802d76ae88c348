"""Benchmark: `attnaux.softmax` against `jax.nn.softmax` (XLA's fused softmax), on the CPU.

Command (from the repository root, with attnaux installed, e.g. `pip install -e .`):

    python benchmarks/softmax.py                 # both shapes, three fusions, fwd and fwd+bwd
    python benchmarks/softmax.py --repeats 9 --fusions scale causal --shapes 8x16x512x512

What is timed, for logits of shape [b, h, q, kv] float32 (defaults: 8x16x512x512, 2x8x2048x2048):

- attnaux: `attnaux.softmax(logits, scale=s, mask=m, causal=c)` (backend "auto", i.e. the
  compiled kernel when registered; the table says which ran), which also returns lse and max.
- XLA: `jax.nn.softmax(jnp.where(visible, s * logits, -inf), axis=-1)`, the scale and the mask
  (and for the causal fusion a `jnp.tril` mask built in the same jitted function) applied in JAX,
  so XLA fuses them into its softmax.
- Fusions: `scale` (no mask), `scale+mask` (a random boolean mask of shape [b, 1, q, kv],
  broadcast over heads), `scale+causal` (top-left causal mask).
- `fwd`: the forward alone. `fwd+bwd`: `jax.grad` of `sum(probs * dprobs)` with respect to the
  logits, `dprobs` a fixed random array (so the forward runs too, then the backward).
- Every function is jitted; one warm-up call compiles, then the best of `--repeats` (5) calls,
  each ended by `jax.block_until_ready`; the two candidates' calls alternate, so load from other
  processes hits both alike. The last column is the best process CPU time per call (user +
  system over all threads; the system part is mostly first-touch page faults of the fresh
  output buffers, which both candidates pay): a second view, less sensitive to load.

Bytes moved (the minimum any implementation must move, the same figure for both candidates),
with E = b*h*q*kv elements of 4 bytes and M the mask's element count (1 byte each, 0 without):

    fwd     = 4E (read logits) + M (read mask) + 4E (write probs)
    fwd+bwd = fwd + 4E (read probs) + 4E (read dprobs) + 4E (write dlogits) = 20E + M

(the per-row lse/max outputs, E/kv floats, are left out). GB/s = bytes / best time / 1e9; the
ratio is XLA time / attnaux time, so > 1 means attnaux is faster. The machine may be shared and
noisy: compare ratios within one run.
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

try:
    from attnaux import softmax, softmax_kernel_available
except ImportError:  # not yet re-exported from attnaux/__init__.py
    from attnaux._softmax import softmax, softmax_kernel_available

SHAPES = ((8, 16, 512, 512), (2, 8, 2048, 2048))
FUSIONS = ("scale", "scale+mask", "scale+causal")
SCALE = 0.125


def _attnaux_fn(fusion):
    causal = fusion == "scale+causal"

    def fwd(x, mask):
        probs, aux = softmax(x, scale=SCALE, mask=mask, causal=causal)
        return probs, aux.lse, aux.max

    return fwd


def _xla_fn(fusion):
    def fwd(x, mask):
        s = SCALE * x
        if fusion == "scale+causal":
            q, kv = x.shape[-2:]
            s = jnp.where(jnp.tril(jnp.ones((q, kv), bool)), s, -jnp.inf)
        elif mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        return (jax.nn.softmax(s, axis=-1),)

    return fwd


def _fwd_bwd(fwd):
    def f(x, mask, dprobs):
        return jax.grad(lambda x: jnp.sum(fwd(x, mask)[0] * dprobs))(x)

    return f


def _best_times(fns, repeats):
    """Best wall time and best process CPU time (user + system, all threads) per candidate.

    The candidates' calls alternate (a, b, a, b, ...) so that load from other processes hits
    both alike."""
    for fn, fargs in fns.values():
        jax.block_until_ready(fn(*fargs))  # compile + warm up
    wall = dict.fromkeys(fns, float("inf"))
    cpu = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, (fn, fargs) in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(fn(*fargs))
            wall[name] = min(wall[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    return wall, cpu


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["x".join(map(str, s)) for s in SHAPES],
        help="logits shapes b x h x q x kv (default: %(default)s)",
    )
    parser.add_argument(
        "--fusions", nargs="+", default=list(FUSIONS), choices=["scale", "mask", "causal", *FUSIONS]
    )
    parser.add_argument(
        "--passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"]
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    fusions = [f if f.startswith("scale") else f"scale+{f}" for f in args.fusions]

    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}",
        file=sys.stderr,
    )
    rows = []
    for spec in args.shapes:
        shape = tuple(int(d) for d in spec.split("x"))
        b, _, q, kv = shape
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
        dprobs = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
        elems = int(np.prod(shape))
        ok, why = softmax_kernel_available(shape, jnp.float32)
        impl = "kernel" if ok else f"reference ({why})"
        for fusion in fusions:
            mask = jnp.asarray(rng.random((b, 1, q, kv)) < 0.9) if fusion == "scale+mask" else None
            mask_bytes = 0 if mask is None else mask.size
            for pass_ in args.passes:
                nbytes = 8 * elems + mask_bytes + (12 * elems if pass_ == "fwd+bwd" else 0)
                fns = {}
                for name, make in (("attnaux", _attnaux_fn), ("xla", _xla_fn)):
                    fwd = make(fusion)
                    if pass_ == "fwd":
                        fns[name] = (jax.jit(fwd), (x, mask))
                    else:
                        fns[name] = (jax.jit(_fwd_bwd(fwd)), (x, mask, dprobs))
                times, cpus = _best_times(fns, args.repeats)
                print(
                    f"  {spec} {fusion} {pass_}: attnaux {times['attnaux'] * 1e3:.2f} ms, "
                    f"XLA {times['xla'] * 1e3:.2f} ms",
                    file=sys.stderr,
                )
                rows.append((spec, fusion, pass_, nbytes, times, cpus))

    print(
        f"\nattnaux.softmax ({impl}) vs jax.nn.softmax (XLA), float32, best of "
        f"{args.repeats}; bytes: fwd = 8E + M, fwd+bwd = 20E + M\n"
    )
    print(
        "| shape | fusion | pass | MB | attnaux ms | attnaux GB/s | XLA ms | XLA GB/s | "
        "ratio (XLA/attnaux) | CPU ms attnaux / XLA |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec, fusion, pass_, nbytes, times, cpus in rows:
        ta, tx = times["attnaux"], times["xla"]
        print(
            f"| {spec} | {fusion} | {pass_} | {nbytes / 1e6:.0f} | {ta * 1e3:.2f} | "
            f"{nbytes / ta / 1e9:.2f} | {tx * 1e3:.2f} | {nbytes / tx / 1e9:.2f} | "
            f"{tx / ta:.2f}x | {cpus['attnaux'] * 1e3:.0f} / {cpus['xla'] * 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
