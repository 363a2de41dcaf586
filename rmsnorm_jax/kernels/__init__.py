"""Fused Pallas kernels for ``rms_norm`` and ``add_rms_norm``: one pass forward, one backward.

- ``_select.py``: which path computes a call: the registry of backends (``BACKENDS``),
  :func:`select` (one platform, one pass) and :func:`route` (a whole call).
- ``_measured.py`` (+ ``data/measured_wins.json``): :data:`MEASURED`, the measured wins
  ``"auto"`` acts on, and the one function that matches them.
- ``_contract.py``: :class:`Backend`, what every backend module is, and the per-row maths
  they share.
- The backends: ``mosaic_gpu.py`` (+ ``mosaic_gpu_sizing.py``, ``mosaic_gpu_memory.py``):
  Mosaic GPU, Hopper and Blackwell; ``triton.py`` (+ ``triton_sizing.py``): Pallas-Triton,
  NVIDIA GPUs (on a CPU in interpret mode, for tests); ``mosaic_tpu.py`` (+
  ``mosaic_tpu_plan.py``): TPU v4 to TPU7x. Their tuned sizes are ``data/*.json``.
- ``_device.py``: the device being compiled for.
- ``_ops.py``: the two norms on the kernel path, with the XLA path's residuals and rules.
- ``_launch.py``: each platform's choice, each device's rows, ``vmap``.
- ``_sharding.py``: each device runs the kernels on its own rows under sharded ``jit``.
- ``_explain.py``: :func:`explain` prints a call's route (:func:`route_of`).

The choice per platform is made when the program is traced and applied when it is
lowered (``lax.platform_dependent``); where a backend's block cannot hold a row, or on a
platform with no kernel (ROCm), XLA computes the call, with the same residuals
(``docs/kernels.md``).
"""

from .._config import IMPLEMENTATIONS as IMPLEMENTATIONS
from .._config import check_implementation as check_implementation
from ._contract import Backend as Backend
from ._contract import KernelSpec as KernelSpec
from ._device import Target as Target
from ._explain import explain as explain
from ._explain import route_of as route_of
from ._measured import MEASURED as MEASURED
from ._measured import Measurement as Measurement
from ._ops import add_rms_norm_kernel as add_rms_norm_kernel
from ._ops import rms_norm_kernel as rms_norm_kernel
from ._select import BACKENDS as BACKENDS
from ._select import Choice as Choice
from ._select import Route as Route
from ._select import route as route
from ._select import select as select

__all__ = [
    "BACKENDS",
    "IMPLEMENTATIONS",
    "MEASURED",
    "Backend",
    "Choice",
    "KernelSpec",
    "Measurement",
    "Route",
    "Target",
    "add_rms_norm_kernel",
    "check_implementation",
    "explain",
    "rms_norm_kernel",
    "route",
    "route_of",
    "select",
]
