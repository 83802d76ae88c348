"""The command line's benchmark harness, kept out of the library's core modules:
`python -m attnaux bench` (`attnaux/__main__.py`, a thin entry point) parses the arguments and
calls `bench.main`. It imports the public functions from their modules, never the package
facade, so it sits one level above the public API and the entry point one above it.
"""
