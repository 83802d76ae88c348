"""Command line: `python -m attnaux [demo]` runs the demonstration (one attention call and its
aux, then a short training run of a small decoder with its attention health report), and
`python -m attnaux bench` the CPU benchmark. `python -m attnaux <command> --help` explains each
command's options."""

import argparse
import sys

from attnaux._cli import bench as _bench
from attnaux._cli import demo as _demo


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
    d.set_defaults(func=_demo.demo)

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
