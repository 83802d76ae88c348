"""Command line: `python -m attnaux [demo]` runs the demonstration (one attention call and its
aux, then a short training run of a small decoder with its attention health report), and
`python -m attnaux bench` the CPU benchmark. `python -m attnaux <command> --help` explains each
command's options."""

import argparse
import pathlib
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
    if args.steps > 0:
        return train_demo(args)
    return 0


def train_demo(args: argparse.Namespace) -> int:
    """Trains the small decoder of `attnaux.nn`, saves every layer's aux, prints its health
    report and writes the heatmap PNG."""
    from attnaux import _demo
    from attnaux import introspect as ai
    from attnaux.introspect import _health

    config = _demo.DemoConfig(steps=args.steps, log_every=max(args.steps // 2, 1),
                              clip_threshold=args.clip_threshold, seed=args.seed)
    print(f"\nTraining a {config.depth}-layer decoder (attnaux.nn, GQA {config.num_heads}:"
          f"{config.kv_heads}, causal) on a copy task for {config.steps} steps, with a z-loss on "
          f"aux.lse and QK-clip at max logit {config.clip_threshold}:")
    model, _ = _demo.train(config)
    collection = _demo.final_auxes(model, config)
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    saved = out_dir / "attnaux-demo-aux.npz"
    ai.save(saved, collection)
    print(f"\nSaved the aux of {len(collection)} layers to {saved}. Health per head:")
    print(_health.format_table({name: ai.health(aux) for name, aux in collection.items()}))
    png = out_dir / "attnaux-demo-heads.png"
    try:
        ai.plot(collection, png)
    except ImportError as error:
        print(f"(no PNG: {error})")
    else:
        print(f"Wrote {png}; `python -m attnaux.introspect report {saved}` reprints this report.")
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
        "demo", help="one attention call and its aux statistics, then a short training run with "
                     "a health report (the default command).",
        description="Runs attnaux.attention(q, k, v, causal=True) on the default device with "
                    "random float32 inputs and prints the output shape, which backend ran "
                    "(with attnaux.explain), and the aux statistics. Then trains a small "
                    "decoder built from attnaux.nn layers for --steps steps (z-loss on lse, "
                    "QK-clip from aux.max), saves every layer's aux, prints the per-head health "
                    "report and writes a PNG heatmap (needs matplotlib: pip install "
                    "'attnaux[plot]').")
    d.add_argument("--batch", type=_positive, default=2, help="batch size (default: 2).")
    d.add_argument("--seq", type=_positive, default=128, help="sequence length (default: 128).")
    d.add_argument("--q-heads", type=_positive, default=8, help="query heads (default: 8).")
    d.add_argument("--kv-heads", type=_positive, default=2,
                   help="key/value heads; must divide --q-heads (default: 2).")
    d.add_argument("--head-dim", type=_positive, default=64, help="head dimension (default: 64).")
    d.add_argument("--seed", type=int, default=0, help="PRNG seed of the inputs (default: 0).")
    d.add_argument("--steps", type=int, default=60,
                   help="training steps of the decoder demonstration; 0 skips it (default: 60).")
    d.add_argument("--clip-threshold", type=float, default=12.0,
                   help="QK-clip: the largest logit allowed per head (default: 12).")
    d.add_argument("--out-dir", default=".",
                   help="where to write attnaux-demo-aux.npz and attnaux-demo-heads.png "
                        "(default: the current directory).")
    d.set_defaults(func=demo)

    bench = commands.add_parser(
        "bench", help="CPU benchmark: GFLOP/s and peak memory of attnaux flash against XLA.",
        description=_bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _bench.add_arguments(bench)
    bench.set_defaults(func=_bench.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in ("demo", "bench", "-h", "--help"):
        argv = ["demo", *argv]  # no command: the demo, with any options given
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
