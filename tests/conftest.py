"""Test set-up, before jax is imported: the platforms, and eight host CPU devices.

- No ``JAX_PLATFORMS`` set and an accelerator present (an NVIDIA GPU or a TPU, found from
  its device files, with jax's plugin for it installed): ``JAX_PLATFORMS=<it>,cpu``. The
  accelerator is the default device, so the numerics tests run on it, and the host CPU
  backend is there beside it with eight devices for the tests that need eight (they take
  them through ``helpers.multi_device_mesh``). ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
  lets ``pytest -n`` workers share the accelerator.
- No ``JAX_PLATFORMS`` set and no accelerator: ``JAX_PLATFORMS=cpu``, which the deviceless
  compiles for TPU and GPU need (``rmsnorm_jax.aot``: otherwise the CUDA plugin fails to
  start a GPU and never registers).
- ``JAX_PLATFORMS`` set: kept as it is. With ``cuda`` or ``tpu`` alone there is no host
  CPU backend; the tests that need eight devices then skip, saying so.

The deviceless-compile tests skip unless ``JAX_PLATFORMS=cpu`` and the compilers are
installed (``helpers.aot_target``, ``helpers.requires_deviceless``).
"""

import glob
import importlib.util
import json
import os
import platform
import re
import shutil


def _plugin_installed(*modules: str) -> bool:
    for module in modules:
        try:
            if importlib.util.find_spec(module) is not None:
                return True
        except (ImportError, ValueError):
            pass
    return False


def accelerator_platform() -> str | None:
    """``"cuda"`` or ``"tpu"`` when this machine has one that jax can use, else None.

    Read from the device files (no jax import: the platforms must be chosen first).
    ``/dev/vfio/vfio`` alone is the VFIO control node of any Linux host, not a TPU.
    """
    nvidia = os.path.exists("/dev/nvidiactl") or bool(glob.glob("/dev/nvidia[0-9]*"))
    if (nvidia or shutil.which("nvidia-smi")) and _plugin_installed(
        "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"
    ):
        return "cuda"
    vfio = [p for p in glob.glob("/dev/vfio/*") if os.path.basename(p) != "vfio"]
    if (glob.glob("/dev/accel[0-9]*") or vfio) and _plugin_installed("libtpu"):
        return "tpu"
    return None


if "JAX_PLATFORMS" not in os.environ:
    _accelerator = accelerator_platform()
    if _accelerator is None:
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        os.environ["JAX_PLATFORMS"] = f"{_accelerator},cpu"
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Eight host CPU devices, unless the caller asked for another count (to run the
# multi-device tests' skip path: XLA_FLAGS=--xla_force_host_platform_device_count=1).
if not re.search(r"--xla_force_host_platform_device_count=", os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def x64():
    """Float64 for the oracle, for the duration of one test."""
    with jax.enable_x64(True):
        yield


@pytest.fixture
def client_record():
    """``record(library=..., family=..., **numbers)``: a client-library test's measured
    differences, printed (``pytest -s`` shows them) and, where ``$RMSNORM_JAX_CLIENT_RECORD``
    names a file (``.ci/clients.sh`` sets it), appended to it as a JSON line, from which
    ``.ci/clients_tables.py tests`` writes ``docs/results/clients-tests.md``."""

    def record(**row):
        print(
            ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            )
        )
        path = os.environ.get("RMSNORM_JAX_CLIENT_RECORD")
        if path:
            row |= {"python": platform.python_version(), "jax": jax.__version__}
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    return record
