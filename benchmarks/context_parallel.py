"""Context parallelism (`attnaux.parallel`) on host CPU devices: balance, time and traffic.

`python benchmarks/context_parallel.py` (sets XLA_FLAGS for 8 host devices itself). Three
tables, one run:

1. **Work per device**, causal, n = 8: the (query, key) pairs each device computes (blocks that
   the causal mask hides entirely are skipped, diagonal blocks count half), for the contiguous
   and the zigzag layout, from the ring's own skip rule; max / min is the imbalance.
2. **Wall time against the number of devices** for one global problem (`--shape b x s x h x d`,
   causal, float32), forward and forward+backward: n = 1 is `attnaux.attention` (flash) on one
   device, n = 2, 4, 8 the ring (zigzag). The host devices share this machine's cores, so past
   the core count the time cannot fall: the figure to read is the ring's overhead against the
   work, not a speed-up.
3. **Bytes sent per device** by the ring's forward (from the compiled HLO: the
   collective-permutes in the loop body times its n - 1 trips) against the theoretical
   `(n - 1) / n` of K and V.
"""

import os

if __name__ == "__main__":  # run as a script: 8 host devices (imported, e.g. by multi_gpu.py,
    # it changes nothing: its helpers serve the devices the importer has)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import attnaux as ax  # noqa: E402
import attnaux.parallel as par  # noqa: E402

_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}


def work_per_device(n: int, layout: str) -> list[float]:
    """Computed (query, key) pairs per device, in units of one chunk pair, for a causal mask:
    the ring visits every (query chunk, key chunk) pair; a pair wholly above the diagonal is
    skipped, one on it costs half (the kernels skip the tiles above it)."""
    chunks = 2 if layout == "zigzag" else 1
    work = []
    for device in range(n):
        ids = (device, 2 * n - 1 - device) if chunks == 2 else (device,)
        total = 0.0
        for q_id in ids:
            for src in range(n):
                kv_ids = (src, 2 * n - 1 - src) if chunks == 2 else (src,)
                for k_id in kv_ids:
                    total += 1.0 if k_id < q_id else 0.5 if k_id == q_id else 0.0
        work.append(total / chunks**2)  # in units of a device's (block x block) pair
    return work


def timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def permute_bytes(text: str) -> int:
    """Bytes moved by the collective-permutes of the compiled HLO's while body (one trip)."""
    total = 0
    for match in re.finditer(r"=\s*(\(?[^=]*?\)?)\s+collective-permute(?:-start)?\(", text):
        for dtype, dims in re.findall(r"(f32|bf16|f16|s32|u32|pred)\[([\d,]*)\]", match.group(1)):
            size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            total += size * _DTYPE_BYTES[dtype]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1x8192x8x64", help="b x s x h x d (1x8192x8x64)")
    parser.add_argument("--kv-heads", type=int, default=None, help="default: h")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    b, s, h, d = (int(x) for x in args.shape.split("x"))
    kv = args.kv_heads or h
    print(f"attnaux {ax.__version__}, JAX {jax.__version__}, {len(jax.devices())} host devices "
          f"on {os.cpu_count()} cores; causal, float32, q {b}x{s}x{h}x{d}, kv heads {kv}\n")

    print("## Work per device (causal, n = 8; units: one block x block pair)\n")
    print("| layout | per device | max / min |")
    print("|---|---|---|")
    for layout in ("contiguous", "zigzag"):
        work = work_per_device(8, layout)
        print(f"| {layout} | {', '.join(f'{w:g}' for w in work)} | "
              f"{max(work) / min(work):.2f} |")

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.float32)
    k = jax.random.normal(keys[1], (b, s, kv, d), jnp.float32)
    v = jax.random.normal(keys[2], (b, s, kv, d), jnp.float32)

    def loss_of(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v)[0]) + jnp.sum(attend(q, k, v)[1].lse)

    print("\n## Wall time against the number of devices (median of "
          f"{args.repeats}; ms)\n")
    print("| devices | forward | forward+backward | forward vs n = 1 |")
    print("|---|---|---|---|")
    base = None
    traffic = []
    for n in (1, 2, 4, 8):
        if n == 1:
            def attend(q, k, v):
                return ax.attention(q, k, v, causal=True, backend="flash")
            args_in = (q, k, v)
        else:
            mesh = jax.make_mesh((n,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,),
                                 devices=jax.devices()[:n])
            sharding = NamedSharding(mesh, P(None, "sp"))
            args_in = tuple(jax.device_put(par.zigzag(x, n, axis=1), sharding) for x in (q, k, v))

            def attend(q, k, v, mesh=mesh):
                return par.context_parallel_attention(q, k, v, mesh=mesh, axis_name="sp",
                                                      causal=True, layout="zigzag")
        fwd = jax.jit(attend)
        fwd_bwd = jax.jit(jax.grad(loss_of(attend), argnums=(0, 1, 2)))
        t_fwd = timed(fwd, *args_in, repeats=args.repeats)
        t_all = timed(fwd_bwd, *args_in, repeats=args.repeats)
        base = base or t_fwd
        print(f"| {n} | {t_fwd * 1e3:.1f} | {t_all * 1e3:.1f} | {t_fwd / base:.2f} |")
        if n > 1:
            per_trip = permute_bytes(fwd.lower(*args_in).compile().as_text())
            kv_bytes = 2 * b * s * kv * d * 4
            traffic.append((n, per_trip, per_trip * (n - 1), kv_bytes * (n - 1) / n))

    print("\n## Bytes sent per device by the ring's forward\n")
    print("| devices | per hop | hops x per hop | (n - 1) / n of K and V | ratio |")
    print("|---|---|---|---|---|")
    for n, per_trip, sent, theory in traffic:
        print(f"| {n} | {per_trip / 2**20:.2f} MiB | {sent / 2**20:.2f} MiB | "
              f"{theory / 2**20:.2f} MiB | {sent / theory:.2f} |")


if __name__ == "__main__":
    main()
