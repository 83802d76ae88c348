"""Runs the multi-device tests (`tests/spmd`) on 8 host CPU devices, in a subprocess: JAX reads
`XLA_FLAGS=--xla_force_host_platform_device_count=8` only when it starts, and this session has
already started it with one device. The subprocess's report is shown on failure.

The default run's subprocess is started as soon as collection has selected its test
(`tests/conftest.py::pytest_collection_finish` calls `start_early`), so it runs beside the rest
of the session instead of after it (the session's tests use about one core; CI has two), and
the test waits for its result. Run alone (`pytest tests/test_spmd.py`) it starts when collected
too, and the test waits as before. A subprocess still running when the session ends (`-x`, an
interrupt) is killed (`stop_all`)."""

import os
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest

_TIMEOUT_S = 1500
_RUNS: dict[str, "_SuiteRun"] = {}


class _SuiteRun:
    """`python -m pytest tests/spmd -m <markers>` on 8 host devices, running in the background;
    stdout and stderr go to temporary files (pipes could fill up while nobody reads them)."""

    def __init__(self, markers: str):
        here = pathlib.Path(__file__).parent
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
        env["JAX_PLATFORMS"] = "cpu"
        self.stdout = tempfile.TemporaryFile(mode="w+")
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", str(here / "spmd"), "-q", "-p", "no:cacheprovider",
             "-o", "addopts=", "-m", markers, "--rootdir", str(here / "spmd")],
            env=env, stdout=self.stdout, stderr=self.stderr, text=True,
        )

    def result(self) -> subprocess.CompletedProcess:
        """Waits for the subprocess (at most `_TIMEOUT_S` from its start) and returns its exit
        status and output; a subprocess past its time is killed and `TimeoutExpired` raised."""
        left = max(1.0, _TIMEOUT_S - (time.monotonic() - self.started))
        try:
            returncode = self.proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        outputs = []
        for f in (self.stdout, self.stderr):
            f.seek(0)
            outputs.append(f.read())
            f.close()
        return subprocess.CompletedProcess(self.proc.args, returncode, *outputs)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_early(markers: str = "not slow"):
    """Starts the suite for `markers` in the background (once per session)."""
    if markers not in _RUNS:
        _RUNS[markers] = _SuiteRun(markers)


def stop_all():
    """Kills the background suites that are still running (the session ends without them)."""
    for run in _RUNS.values():
        run.stop()


def _run_spmd_suite(markers: str) -> subprocess.CompletedProcess:
    start_early(markers)  # a no-op when the session started it after collection
    return _RUNS.pop(markers).result()


def test_spmd_suite_on_8_host_devices():
    result = _run_spmd_suite("not slow")
    report = result.stdout[-20000:] + result.stderr[-5000:]
    assert result.returncode == 0, f"the SPMD suite failed (exit {result.returncode}):\n{report}"
    assert " passed" in result.stdout and " skipped" not in result.stdout.splitlines()[-1], report


# Started by `tests/conftest.py` when collection selects the test (see the module docstring).
test_spmd_suite_on_8_host_devices.start_early = lambda: start_early("not slow")


@pytest.mark.slow
def test_spmd_slow_sweep_on_8_host_devices():
    """The SPMD cases kept out of the default run (covered there by combined cases)."""
    result = _run_spmd_suite("slow")
    report = result.stdout[-20000:] + result.stderr[-5000:]
    assert result.returncode == 0, f"the SPMD slow sweep failed ({result.returncode}):\n{report}"
    assert " passed" in result.stdout, report
