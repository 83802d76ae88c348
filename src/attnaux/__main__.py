"""Command line: `python -m attnaux [demo]` runs a small example, `python -m attnaux bench` the
CPU benchmark. `python -m attnaux <command> --help` explains each command's options."""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import attnaux
from attnaux import _bench


def demo(args: argparse.Namespace) -> int:
    """A batched causal GQA attention on the default device; prints the output and its aux."""
    b, s, q_heads, kv_heads, d = args.batch, args.seq, args.q_heads, args.kv_heads, args.head_dim
    kq, kk, kv = jax.random.split(jax.random.key(args.seed), 3)
    q = jax.random.normal(kq, (b, s, q_heads, d), jnp.float32)
    k = jax.random.normal(kk, (b, s, kv_heads, d), jnp.float32)
    v = jax.random.normal(kv, (b, s, kv_heads, d), jnp.float32)

    print(f"attnaux {attnaux.__version__} on JAX {jax.__version__} ({jax.default_backend()})")
    print(f"q {list(q.shape)}, k/v {list(k.shape)} float32 (GQA {q_heads}:{kv_heads}), "
          "causal=True\n")
    print(attnaux.explain(q, k, v, causal=True))

    start = time.perf_counter()
    out, aux = jax.block_until_ready(attnaux.attention(q, k, v, causal=True))
    took = time.perf_counter() - start

    head_max = jnp.max(aux.max, axis=(0, 2))  # max of aux.max over batch and rows, per head
    visible = jnp.isfinite(aux.lse)
    mean_lse = jnp.sum(jnp.where(visible, aux.lse, 0.0)) / jnp.maximum(jnp.sum(visible), 1)
    empty = int(jnp.sum(~visible))
    print(f"\nbackend that ran: {aux.backend}  ({took * 1e3:.0f} ms, compile included)")
    print(f"out: {list(out.shape)} {out.dtype}")
    print(f"aux.lse: {list(aux.lse.shape)} {aux.lse.dtype}   aux.max: {list(aux.max.shape)} "
          f"{aux.max.dtype}   (batch, q_heads, q_seq)")
    print("max logit per head: " + " ".join(f"{x:.3f}" for x in np.asarray(head_max)))
    print(f"mean lse: {float(mean_lse):.4f} (rows with a visible key)")
    print(f"rows with no visible key: {empty} of {aux.lse.size} (causal: every row sees key 0, "
          "so 0 is expected)")
    print(f"out finite: {bool(jnp.all(jnp.isfinite(out)))}")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}.")
    return value


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m attnaux",
        description="attnaux: fused attention for JAX that returns its softmax statistics. "
                    "Without a command, runs the demo.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{demo,bench}")

    d = commands.add_parser(
        "demo", help="a small causal GQA attention, printing the output shape, the backend and "
                     "the aux statistics (the default command).",
        description="Runs attnaux.attention(q, k, v, causal=True) on the default device with "
                    "random float32 inputs and prints the output shape, which backend ran "
                    "(with attnaux.explain), and the aux statistics.")
    d.add_argument("--batch", type=_positive, default=2, help="batch size (default: 2).")
    d.add_argument("--seq", type=_positive, default=128, help="sequence length (default: 128).")
    d.add_argument("--q-heads", type=_positive, default=8, help="query heads (default: 8).")
    d.add_argument("--kv-heads", type=_positive, default=2,
                   help="key/value heads; must divide --q-heads (default: 2).")
    d.add_argument("--head-dim", type=_positive, default=64, help="head dimension (default: 64).")
    d.add_argument("--seed", type=int, default=0, help="PRNG seed of the inputs (default: 0).")
    d.set_defaults(func=demo)

    bench = commands.add_parser(
        "bench", help="CPU benchmark: GFLOP/s and peak memory of attnaux flash against XLA.",
        description=_bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _bench.add_arguments(bench)
    bench.set_defaults(func=_bench.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # no command: the demo with its defaults
        args = parser.parse_args(["demo"])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
