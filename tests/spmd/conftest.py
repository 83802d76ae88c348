"""The multi-device tests: run on 8 host CPU devices by `tests/test_spmd.py`, in a subprocess
that sets `XLA_FLAGS=--xla_force_host_platform_device_count=8` before JAX starts (the main
test session has started JAX with one device, so it skips this folder; see `tests/conftest.py`).

Run by hand: `XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/spmd`.
"""

import os

import jax
import pytest

if len(jax.devices()) < 8:
    pytest.skip(
        "the SPMD tests need 8 devices: run them with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_spmd.py does)",
        allow_module_level=True,
    )

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: kept out of the default run (tests/test_spmd.py)")
