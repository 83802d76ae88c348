"""Several GPUs of one host (issue 27): a data-parallel training step and context parallelism.

    python benchmarks/multi_gpu.py                    # every part, on all GPUs of the host
    python benchmarks/multi_gpu.py --part cp --seqs 32768,131072
    python benchmarks/multi_gpu.py --quick            # small shapes: a smoke run (on CPU too,
                                                      # with host devices from XLA_FLAGS)

Everything is jitted and timed with `jax.block_until_ready`: the median of `--repeats` calls
after one warm-up (the machines are shared: read the ratios of one run). Device counts are
1, 2, 4, ... up to the devices present; n = 1 runs on the first device alone.

1. **Data parallel** (`--part dp`): one training step of the example decoder
   (`attnaux.nn.Decoder`, bf16 parameters and activations, causal attention through
   `attnaux.attention`, i.e. cuDNN `flash` on GPU, a z-loss on every layer's `aux.lse`, an SGD
   update) with the token batch sharded over n devices and the parameters replicated (their
   gradients all-reduced). Reported against the same step on one device with the whole batch
   and with one device's share of it (batch / n): the sharded step should take about the time
   of the share.
2. **Context parallelism** (`--part cp`): causal attention over one sequence of `--seqs` tokens
   (16 heads x 128, bf16, batch 1) sharded over n devices with `attnaux.parallel`'s ring and the
   zigzag layout, forward and forward+backward (`jax.grad` of `sum(out * w) + sum(lse)`),
   against `attnaux.attention` (flash) of the whole sequence on one device.
   **Communication hidden behind compute**, from three programs of the same shapes: the ring
   (`t_ring`), the ring with its `ppermute`s replaced by the identity (the same kernel calls on
   the device's own blocks: `t_compute`), and the ring's transfers alone (the same `ppermute`s
   in the same loop, no kernels: `t_comm`). Hidden share = `(t_compute + t_comm - t_ring) /
   t_comm`, clipped to [0, 1]: 1 when the transfers cost nothing on top of the compute.
   **Balance**: the (query, key) chunk pairs each device computes under the causal mask for the
   contiguous and the zigzag layout (from the ring's skip rule), and the measured time of both
   layouts at the longest sequence on the most devices (contiguous waits for its busiest
   device).
"""

import argparse
import contextlib
import os
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import attnaux
import attnaux.parallel as par
from attnaux import introspect as ai

sys.path.insert(0, os.path.dirname(__file__))
from context_parallel import timed, work_per_device  # noqa: E402


def device_counts(limit: int) -> list[int]:
    counts, n = [], 1
    while n <= limit:
        counts.append(n)
        n *= 2
    return counts


def mesh_of(n: int, axis: str):
    return jax.make_mesh((n,), (axis,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n])


# ------------------------------------------------------------------------------------------------
# 1. Data parallel training step
# ------------------------------------------------------------------------------------------------
def data_parallel(args, out) -> None:
    from attnaux.nn import Decoder

    model = Decoder(args.vocab, args.dp_seq, args.dim, args.depth, args.heads, args.heads,
                    key=jax.random.key(0))
    model = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x,
                         model)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    tokens = jax.random.randint(jax.random.key(1), (args.dp_batch, args.dp_seq + 1), 0,
                                args.vocab)

    def loss_fn(params, tokens):
        model = eqx.combine(params, static)
        logits, auxes = jax.vmap(model)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        nll = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
        return nll + 1e-4 * sum(ai.z_loss(aux) for aux in auxes) / len(auxes)

    def step(params, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        return jax.tree.map(lambda p, g: p - 1e-3 * g.astype(p.dtype), params, grads), loss

    def time_step(n: int, batch: int) -> float:
        mesh = mesh_of(n, "data")
        p = jax.device_put(params, NamedSharding(mesh, P()))
        t = jax.device_put(tokens[:batch], NamedSharding(mesh, P("data")))
        compiled = jax.jit(step).lower(p, t).compile()
        return timed(lambda p, t: compiled(p, t)[1], p, t, repeats=args.repeats)

    counts = device_counts(len(jax.devices()))[1:]
    out(f"\n## Data parallel: decoder training step (depth {args.depth}, dim {args.dim}, "
        f"{args.heads} heads, seq {args.dp_seq}, vocab {args.vocab}, bf16), global batch "
        f"{args.dp_batch}\n")
    out("| devices | step, batch sharded (ms) | one device, whole batch (ms) | one device, "
        "batch / n (ms) | sharded / (batch / n) | speed-up vs one device |")
    out("|---|---|---|---|---|---|")
    whole = time_step(1, args.dp_batch)
    out(f"| 1 | {whole * 1e3:.1f} | {whole * 1e3:.1f} | {whole * 1e3:.1f} | 1.00 | 1.00 |")
    for n in counts:
        if args.dp_batch % n:
            continue
        sharded = time_step(n, args.dp_batch)
        share = time_step(1, args.dp_batch // n)
        out(f"| {n} | {sharded * 1e3:.1f} | {whole * 1e3:.1f} | {share * 1e3:.1f} | "
            f"{sharded / share:.2f} | {whole / sharded:.2f} |")


# ------------------------------------------------------------------------------------------------
# 2. Context parallelism
# ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def transfers_removed():
    """While tracing: `jax.lax.ppermute` is the identity, so the ring computes on its own blocks
    (the same kernel calls, skipped pairs included, since they follow the loop index)."""
    original = jax.lax.ppermute
    jax.lax.ppermute = lambda x, axis_name, perm: x
    try:
        yield
    finally:
        jax.lax.ppermute = original


def context_parallel(args, out) -> None:
    heads, dim = args.cp_heads, args.cp_dim
    counts = device_counts(len(jax.devices()))
    out(f"\n## Context parallel: causal attention, {heads} heads x {dim}, bf16, batch 1, "
        "zigzag ring\n")
    out("Pairs of (query chunk, key chunk) computed per device under the causal mask (units of "
        "one device block x block; the diagonal counts half):\n")
    out("| devices | contiguous | max / min | zigzag | max / min |")
    out("|---|---|---|---|---|")
    for n in counts[1:]:
        c, z = work_per_device(n, "contiguous"), work_per_device(n, "zigzag")
        out(f"| {n} | {', '.join(f'{w:g}' for w in c)} | {max(c) / min(c):.2f} | "
            f"{', '.join(f'{w:g}' for w in z)} | {max(z) / min(z):.2f} |")

    out("\n| tokens | devices | fwd (ms) | fwd+bwd (ms) | fwd speed-up | fwd+bwd speed-up | "
        "fwd TFLOP/s per device | fwd: compute / transfers alone (ms) | fwd hidden | "
        "fwd+bwd: compute / transfers alone (ms) | fwd+bwd hidden |")
    out("|---|---|---|---|---|---|---|---|---|---|---|")
    balance = []
    for seq in args.seqs:
        keys = jax.random.split(jax.random.key(seq), 3)
        q, k, v = (jax.random.normal(key, (1, seq, heads, dim), jnp.bfloat16) for key in keys)
        flops = 4 * heads * seq * seq * dim / 2
        base = None
        for n in counts:
            if seq % (2 * n):
                continue
            row = measure_cp(n, seq, q, k, v, args)
            base = base or row
            t_f, t_fb = row["fwd"], row["fwd+bwd"]
            hidden = []
            for what in ("fwd", "fwd+bwd"):
                if n == 1:
                    hidden.append("- | -")
                    continue
                comp, comm, ring = row[f"{what} compute"], row[f"{what} comm"], row[what]
                share = min(1.0, max(0.0, (comp + comm - ring) / comm)) if comm > 0 else 1.0
                hidden.append(f"{comp * 1e3:.2f} / {comm * 1e3:.2f} | {share:.0%}")
            out(f"| {seq} | {n} | {t_f * 1e3:.2f} | {t_fb * 1e3:.2f} | "
                f"{base['fwd'] / t_f:.2f} | {base['fwd+bwd'] / t_fb:.2f} | "
                f"{flops / n / t_f / 1e12:.0f} | {hidden[0]} | {hidden[1]} |")
        if args.balance and seq == max(args.seqs) and counts[-1] > 1:
            n = counts[-1]
            contiguous = measure_cp(n, seq, q, k, v, args, layout="contiguous", parts=False)
            zigzag = measure_cp(n, seq, q, k, v, args, parts=False)
            balance.append((seq, n, contiguous, zigzag))
    if balance:
        out("\n| tokens | devices | contiguous fwd / fwd+bwd (ms) | zigzag fwd / fwd+bwd (ms) | "
            "contiguous / zigzag |")
        out("|---|---|---|---|---|")
        for seq, n, c, z in balance:
            out(f"| {seq} | {n} | {c['fwd'] * 1e3:.2f} / {c['fwd+bwd'] * 1e3:.2f} | "
                f"{z['fwd'] * 1e3:.2f} / {z['fwd+bwd'] * 1e3:.2f} | "
                f"{c['fwd'] / z['fwd']:.2f} / {c['fwd+bwd'] / z['fwd+bwd']:.2f} |")


def measure_cp(n, seq, q, k, v, args, layout="zigzag", parts=True) -> dict:
    """Times (ms) of the forward and forward+backward, and with `parts` the compute-only and
    transfer-only programs of the ring."""
    if n == 1:
        def attend(q, k, v):
            out, aux = attnaux.attention(q, k, v, causal=True, backend="flash")
            return out, aux.lse
        inputs = tuple(jax.device_put(x, jax.devices()[0]) for x in (q, k, v))
    else:
        mesh = mesh_of(n, "sp")
        sharding = NamedSharding(mesh, P(None, "sp"))
        perm = (lambda x: par.zigzag(x, n, axis=1)) if layout == "zigzag" else (lambda x: x)
        inputs = tuple(jax.device_put(perm(x), sharding) for x in (q, k, v))

        def attend(q, k, v):
            out, aux = par.context_parallel_attention(q, k, v, mesh=mesh, axis_name="sp",
                                                      causal=True, layout=layout)
            return out, aux.lse

    def loss(q, k, v):
        out, lse = attend(q, k, v)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    fwd = jax.jit(attend)
    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    row = {"fwd": timed(fwd, *inputs, repeats=args.repeats),
           "fwd+bwd": timed(fwd_bwd, *inputs, repeats=args.repeats)}
    if n == 1 or not parts:
        return row
    with transfers_removed():
        fwd_local = jax.jit(attend).lower(*inputs).compile()
        fwd_bwd_local = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*inputs).compile()
    row["fwd compute"] = timed(fwd_local, *inputs, repeats=args.repeats)
    row["fwd+bwd compute"] = timed(fwd_bwd_local, *inputs, repeats=args.repeats)
    forward_hops, backward_hops = transfers_alone(n, inputs)
    row["fwd comm"] = timed(forward_hops, *inputs, repeats=args.repeats)
    row["fwd+bwd comm"] = row["fwd comm"] + timed(backward_hops, *inputs, repeats=args.repeats)
    return row


def transfers_alone(n, inputs):
    """The ring's transfers without its kernels: the forward sends K and V n - 1 hops; the
    backward sends K and V n - 1 hops and dK, dV (float32, as the ring carries them) n hops."""
    mesh = mesh_of(n, "sp")
    spec = P(None, "sp")
    perm = [(i, (i + 1) % n) for i in range(n)]

    def hop(x):
        return jax.tree.map(lambda a: jax.lax.ppermute(a, "sp", perm), x)

    def forward(q, k, v):
        kv = jax.lax.fori_loop(0, n - 1, lambda _, kv: hop(kv), (k, v))
        return kv[0][:, :1]

    def backward(q, k, v):
        grads = (k.astype(jnp.float32), v.astype(jnp.float32))

        def step(_, carry):
            kv, grads = carry
            return hop(kv), hop(grads)

        kv, grads = jax.lax.fori_loop(0, n - 1, step, ((k, v), grads))
        grads = hop(grads)
        return kv[0][:, :1].astype(jnp.float32) + grads[0][:, :1]

    def sharded(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))

    return sharded(forward), sharded(backward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("dp", "cp", "all"), default="all")
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seqs", default="32768,131072", help="context-parallel sequence lengths")
    parser.add_argument("--output", default=None, help="also write the tables to this file")
    parser.add_argument("--no-balance", dest="balance", action="store_false",
                        help="skip the timing of the contiguous layout")
    args = parser.parse_args()
    args.seqs = [int(s) for s in args.seqs.split(",")]
    args.vocab, args.dim, args.depth, args.heads = 8192, 1024, 4, 8
    args.dp_batch, args.dp_seq = 16, 2048
    args.cp_heads, args.cp_dim = 16, 128
    if args.quick:
        args.seqs, args.repeats = [1024], 2
        args.vocab, args.dim, args.depth, args.heads = 256, 128, 1, 2
        args.dp_batch, args.dp_seq = 8, 128
        args.cp_heads, args.cp_dim = 2, 64
    lines = []

    def out(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
        if args.output:
            with open(args.output, "w") as f:
                f.write("\n".join(lines) + "\n")

    devices = jax.devices()
    out(f"attnaux {attnaux.__version__}, JAX {jax.__version__}, {len(devices)} x "
        f"{devices[0].device_kind} ({jax.default_backend()})")
    if args.part in ("dp", "all"):
        data_parallel(args, out)
    if args.part in ("cp", "all"):
        context_parallel(args, out)


if __name__ == "__main__":
    main()
