"""Command line: `python -m attnaux.introspect report FILE [--png OUT.png]`.

Prints the per-head health of a collection saved with `attnaux.introspect.save` as a table and
writes the heatmap PNG (next to FILE as `FILE-stem.png` unless `--png` says where; `--no-png`
skips it).
"""

import argparse
import pathlib
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m attnaux.introspect",
        description="Diagnostics for attention statistics saved with attnaux.introspect.save.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser(
        "report", help="print the per-head health of a saved aux collection and plot it"
    )
    report.add_argument("file", type=pathlib.Path, help="a .npz written by attnaux.introspect.save")
    report.add_argument("--png", type=pathlib.Path, default=None,
                        help="where to write the heatmap (default: FILE with suffix .png)")
    report.add_argument("--no-png", action="store_true", help="print the table only")
    report.add_argument("--saturation", type=float, default=None,
                        help="a row is saturated when lse - max < this (default 0.01)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from . import _health, _io, _plot

    if not args.file.exists():
        print(f"error: {args.file} does not exist.", file=sys.stderr)
        return 2
    try:
        collection = _io.load(args.file)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    saturation = _health.DEFAULT_SATURATION if args.saturation is None else args.saturation
    if not saturation > 0:
        print(f"error: --saturation must be > 0; got {saturation}.", file=sys.stderr)
        return 2
    reports = {
        name: _health.health(aux, saturation=saturation) for name, aux in collection.items()
    }
    print(f"{args.file}: {len(reports)} entries, saturation threshold {saturation}")
    print(_health.HealthReport.table_of(reports))
    if args.no_png:
        return 0
    png = args.png if args.png is not None else args.file.with_suffix(".png")
    try:
        _plot.plot(reports, png)
    except (ImportError, ValueError) as error:  # no matplotlib; an extension plot won't write
        print(f"error: cannot write {png}: {error}", file=sys.stderr)
        return 1
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
