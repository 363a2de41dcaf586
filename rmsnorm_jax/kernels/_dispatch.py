"""Which path computes a call: XLA (``_vjp.py``) or the fused kernels, and why.

``implementation="xla"`` is the XLA path; ``"pallas"`` the fused kernels wherever the call
fits them (otherwise XLA, see :func:`kernel_spec`); ``"auto"`` the kernels only where a
measurement on hardware, recorded in :data:`MEASURED`, found them faster than XLA.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._spec import KernelSpec

IMPLEMENTATIONS = ("auto", "xla", "pallas")

KERNEL_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A measured win of the kernels over XLA that ``"auto"`` acts on.

    Attributes:
      platform: ``"cuda"`` or ``"tpu"``.
      device_kind: a substring of ``jax.Device.device_kind`` (e.g. ``"H100"``).
      dtypes: the input dtype names it holds for.
      features: the inclusive range of features per row it holds for.
      source: where and when it was measured (device, date, command, result file).
    """

    platform: str
    device_kind: str
    dtypes: tuple[str, ...]
    features: tuple[int, int]
    source: str


# Empty: the kernels' speed has not been measured on a GPU or TPU yet (no device in the
# sessions that wrote them; XLA's cost models give no estimate for a custom call). So
# "auto" stays on XLA everywhere until `python -m benchmarks ops` on a device shows a
# win; then add the measurement here, with its device, date and result file.
MEASURED: tuple[Measurement, ...] = ()


def check_implementation(implementation: Any) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}: "
            f"'xla' for the XLA path, 'pallas' for the fused kernels, 'auto' to let the "
            f"library choose from measurements."
        )
    return implementation


def _row_param(param, n: int) -> bool:
    """Whether a scale or bias is one value per feature of the last axis (or absent)."""
    return param is None or (param.shape[-1:] == (n,) and math.prod(param.shape) == n)


def why_not_kernels(cfg, x, scale, bias, mask) -> str | None:
    """Why a call does not fit the kernels (see :func:`kernel_spec`), or None if it fits."""
    if mask is not None:
        return "a mask"
    if cfg.axis_name is not None:
        return "axis_name (features split across devices)"
    if cfg.axes != (x.ndim - 1,):
        return f"normalized axes {cfg.axes}, not the last axis alone"
    if np.dtype(x.dtype) not in KERNEL_DTYPES:
        return f"x of dtype {np.dtype(x.dtype).name} (the kernels take float32/bfloat16/float16)"
    if cfg.compute_dtype != np.dtype(jnp.float32):
        return f"statistics in {np.dtype(cfg.compute_dtype).name}, not float32"
    if not (_row_param(scale, cfg.n) and _row_param(bias, cfg.n)):
        return "a scale or bias that is not one value per feature"
    return None


def kernel_spec(cfg, x, scale, bias, mask) -> KernelSpec | None:
    """The kernels' description of a call, or None where the call does not fit them.

    The kernels take rows of the last axis (any leading dims), float32, bfloat16 or
    float16 input with float32 statistics, a scale and bias of one value per feature,
    pRMSNorm, ``scale_offset`` and both eps placements. They do not take a ``mask``,
    ``axis_name`` (features split across devices), normalized axes other than the
    last alone, float64, or a scale/bias that varies along the rows: those stay on XLA.
    (Rows too wide for a kernel's block fall back per backend, see ``kernels/__init__``.)
    """
    if why_not_kernels(cfg, x, scale, bias, mask) is not None:
        return None
    return KernelSpec(
        n=cfg.n,
        k=cfg.k,
        eps=cfg.eps,
        inside=cfg.inside,
        scale_offset=cfg.scale_offset,
        has_scale=scale is not None,
        has_bias=bias is not None,
        out_dtype=np.dtype(cfg.out_dtype),
    )


def _measured_faster(spec: KernelSpec, x_dtype) -> bool:
    """Whether :data:`MEASURED` holds a win for this call on the default device."""
    if not MEASURED:
        return False
    device = jax.devices()[0]
    return any(
        m.platform == device.platform
        and m.device_kind in device.device_kind
        and np.dtype(x_dtype).name in m.dtypes
        and m.features[0] <= spec.n <= m.features[1]
        for m in MEASURED
    )


def use_kernels(implementation: str, cfg, x, scale, bias, mask) -> KernelSpec | None:
    """The :class:`KernelSpec` when the kernels compute this call, else None (XLA)."""
    implementation = check_implementation(implementation)
    if implementation == "xla":
        return None
    spec = kernel_spec(cfg, x, scale, bias, mask)
    if spec is None:
        return None
    if implementation == "auto" and not _measured_faster(spec, x.dtype):
        return None
    return spec
