"""Test set-up: eight host CPU devices for the sharding tests (before jax is imported)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # tests run on CPU; AOT compiles need it (aot.py)

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax
import pytest


@pytest.fixture
def x64():
    """Float64 for the oracle, for the duration of one test."""
    with jax.enable_x64(True):
        yield
