"""Bitwise independence of the thread count, shared by the kernel tests: a script run in a child
process pinned to one CPU and to all of them must save the same arrays."""

import os
import subprocess
import sys

import numpy as np
import pytest


def assert_same_on_one_and_all_cpus(script: str, tmp_path, names) -> None:
    """Runs `python -c script MODE PATH` with MODE "one" and "all" (the script pins itself and
    saves its arrays to PATH with `np.savez`), and asserts that both saved exactly `names`'
    arrays, bitwise equal. The child imports attnaux as this process does (installed, or
    PYTHONPATH=src)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs at least 2 CPUs to compare against a 1-CPU run")
    outs = {}
    for mode in ("one", "all"):
        path = tmp_path / f"{mode}.npz"
        subprocess.run([sys.executable, "-c", script, mode, str(path)], check=True,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"), timeout=300)
        outs[mode] = np.load(path)
    assert len(outs["one"].files) == len(outs["all"].files) == len(names)
    for i, name in enumerate(names):
        a, b = outs["one"][f"arr_{i}"], outs["all"][f"arr_{i}"]
        assert np.array_equal(a, b), f"{name} differs between 1 CPU and all CPUs (bitwise)"
