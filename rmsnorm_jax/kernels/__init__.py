"""Fused Pallas kernels for ``rms_norm`` and ``add_rms_norm``: one pass forward, one backward.

- ``triton.py`` (+ ``triton_sizing.py``): Pallas-Triton kernels for NVIDIA GPUs; on a CPU
  they run in Pallas interpret mode (tests).
- ``mosaic_tpu.py`` (+ ``mosaic_tpu_plan.py``): Pallas Mosaic kernels for TPU v4 to TPU7x.
- ``_contract.py``: what every backend implements, and the per-row maths they share.
- ``_dispatch.py``: which path computes a call (``implementation=``) and :data:`MEASURED`,
  the measurements behind ``"auto"``.
- ``_ops.py``: the two norms by the kernels, with the XLA path's residuals and rules.
- ``_launch.py``: the backend per platform, each device's rows, ``vmap``.
- ``_sharding.py``: each device runs the kernels on its own rows under sharded ``jit``.
- ``_explain.py``: :func:`explain`, which path a call takes and why.

The backend is chosen when the program is lowered (``lax.platform_dependent``); where a
backend's block cannot hold a row, or on a platform with no kernel (ROCm), that backend
computes the call with the XLA path, with the same residuals (``docs/kernels.md``).
"""

from .._config import IMPLEMENTATIONS as IMPLEMENTATIONS
from .._config import check_implementation as check_implementation
from ._contract import KernelSpec as KernelSpec
from ._dispatch import MEASURED as MEASURED
from ._dispatch import Measurement as Measurement
from ._dispatch import use_kernels as use_kernels
from ._explain import explain as explain
from ._ops import add_rms_norm_kernel as add_rms_norm_kernel
from ._ops import rms_norm_kernel as rms_norm_kernel

__all__ = [
    "IMPLEMENTATIONS",
    "MEASURED",
    "KernelSpec",
    "Measurement",
    "add_rms_norm_kernel",
    "check_implementation",
    "explain",
    "rms_norm_kernel",
    "use_kernels",
]
