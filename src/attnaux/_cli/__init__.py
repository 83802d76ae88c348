"""The command line's work, kept out of the library's core modules: `python -m attnaux`
(`attnaux/__main__.py`) is a thin entry point that parses the arguments and calls these.

- `demo`: one attention call and its aux, then a short training run with a health report.
- `train`: the small decoder training loop the demo runs (public API only).
- `bench`: the CPU benchmark harness, attnaux `flash` against XLA.

They use attnaux's public API only.
"""
