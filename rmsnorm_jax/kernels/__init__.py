"""Fused Pallas kernels for ``rms_norm`` and ``add_rms_norm``: one pass forward, one backward.

- ``gpu.py``: Pallas-Triton kernels (NVIDIA GPUs); on a CPU backend they run in Pallas
  interpret mode (for tests; slow).
- ``tpu.py``: Pallas Mosaic kernels (TPU v4 to TPU7x).
- ``_spec.py``: the contract both implement, and the per-row maths they share.
- ``_dispatch.py``: which path computes a call (``implementation=``) and the
  measurements behind ``"auto"``.
- ``_sharding.py``: each device runs the kernels on its own rows under sharded ``jit``.
- ``_passes.py``: the per-device passes and the differentiation rules.
- ``_explain.py``: :func:`explain`, which path a call takes and why.

The backend is chosen when the program is lowered (``lax.platform_dependent``): a program
traced once compiles to the Triton kernels for a GPU, the Mosaic kernels for a TPU and
interpret mode for a CPU. Where a backend's block cannot hold a row (``fits``), or on a
platform with no kernel (ROCm), that backend computes the call with the XLA path of
``_vjp.py`` instead, with the same residuals.

The residuals kept for the backward pass are the XLA path's: ``x`` (``h`` for the
residual form), ``scale`` and the per-row float32 statistic, named ``"rms_norm_stat"``;
``y`` is named ``"rms_norm_out"``. Forward mode is the XLA tangent map around the
kernels' output; reverse mode its transpose, the kernel backward (``_linear``). A kernel
differentiated again (grad-of-grad, ``jax.hessian``) differentiates as its XLA twin.
"""

from ._dispatch import IMPLEMENTATIONS, MEASURED, Measurement, check_implementation, use_kernels
from ._explain import explain
from ._passes import add_rms_norm_kernel, rms_norm_kernel
from ._spec import KernelSpec

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
