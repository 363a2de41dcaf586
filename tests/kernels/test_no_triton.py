"""A jax that ships no Pallas-Triton (deprecated since jax 0.11): nothing imports it, and
every implementation still computes the formula (``without_triton.py``, in a fresh
process so that the missing module is missing from the start)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import deviceless_skip_reason

pytestmark = pytest.mark.newest

SCRIPT = Path(__file__).with_name("without_triton.py")


def test_every_implementation_without_pallas_triton():
    """rms_norm, add_rms_norm and gated_rms_norm under "auto", "xla" and "pallas", values
    and gradients against the float64 formula, and explain, on the CPU; and, where this
    process can compile for an H100 without one, the Mosaic GPU kernels there."""
    argv = [] if deviceless_skip_reason("h100") else ["--h100"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])},
    )
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "ok"
    assert (
        sum(line.startswith(("rms_norm ", "add_rms_norm ", "gated_rms_norm ")) for line in lines)
        == 9
    )
    assert ("h100 pallas:" in done.stdout) == bool(argv)
