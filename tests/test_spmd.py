"""Runs the multi-device tests (`tests/spmd`) on 8 host CPU devices, in a subprocess: JAX reads
`XLA_FLAGS=--xla_force_host_platform_device_count=8` only when it starts, and this session has
already started it with one device. The subprocess's report is shown on failure."""

import os
import pathlib
import subprocess
import sys

import pytest


def _run_spmd_suite(markers: str):
    here = pathlib.Path(__file__).parent
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(here / "spmd"), "-q", "-p", "no:cacheprovider",
         "-o", "addopts=", "-m", markers, "--rootdir", str(here / "spmd")],
        env=env, capture_output=True, text=True, timeout=1500,
    )
    return result


def test_spmd_suite_on_8_host_devices():
    result = _run_spmd_suite("not slow")
    report = result.stdout[-20000:] + result.stderr[-5000:]
    assert result.returncode == 0, f"the SPMD suite failed (exit {result.returncode}):\n{report}"
    assert " passed" in result.stdout and " skipped" not in result.stdout.splitlines()[-1], report


@pytest.mark.slow
def test_spmd_slow_sweep_on_8_host_devices():
    """The SPMD cases kept out of the default run (covered there by combined cases)."""
    result = _run_spmd_suite("slow")
    report = result.stdout[-20000:] + result.stderr[-5000:]
    assert result.returncode == 0, f"the SPMD slow sweep failed ({result.returncode}):\n{report}"
    assert " passed" in result.stdout, report
