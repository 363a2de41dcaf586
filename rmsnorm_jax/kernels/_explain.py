"""``explain``: which path a call of ``rms_norm`` takes, and why, without making it."""

from __future__ import annotations

import inspect
import math

import jax.numpy as jnp

from .._config import check_implementation, norm_config
from ._contract import KernelSpec
from ._dispatch import gpu_backend, kernel_spec, measured_win, target_device, why_not_kernels

_NAMES = {"mosaic_gpu": "Mosaic GPU", "triton": "Triton", "mosaic_tpu": "Mosaic TPU"}


def _gpu_path(spec: KernelSpec, rows: int, dtype) -> str:
    """What computes the call on the GPU being compiled for."""
    name = spec.gpu_backend or gpu_backend()
    if name is None:
        return "XLA (this jax has no GPU kernels of ours)"
    from . import mosaic_gpu, triton

    module = mosaic_gpu if name == "mosaic_gpu" else triton
    if module.fits(spec, rows, dtype):
        return _NAMES[name]
    return f"XLA (the row does not fit the {_NAMES[name]} kernels)"


def explain(x, scale=None, eps: float = 1e-6, *, implementation: str = "pallas", **kwargs) -> str:
    """Which path ``rms_norm(x, scale, eps, implementation=..., **kwargs)`` takes, and why.

    The same arguments as :func:`rmsnorm_jax.rms_norm` (arrays or
    ``jax.ShapeDtypeStruct``); nothing is computed. The answer names XLA with the
    reason, or the kernels per platform, each with the XLA fallback where a row does not
    fit them: a GPU (Mosaic GPU on Hopper and Blackwell where this jax has it, Triton on
    other GPUs), a TPU (Mosaic TPU, where a row fits the generation's VMEM, decided when
    compiled) and a CPU (the Triton kernels in interpret mode).

    >>> import jax, jax.numpy as jnp
    >>> from rmsnorm_jax.kernels import explain
    >>> x = jax.ShapeDtypeStruct((8, 16384), jnp.bfloat16)
    >>> for part in explain(x).split("; "):
    ...     print(part)  # doctest: +ELLIPSIS
    pallas: GPU: ...
    TPU: Mosaic TPU where the row fits the generation's VMEM, else XLA
    CPU: XLA (the row does not fit the Triton kernels)
    >>> print(explain(x, mask=jnp.ones((8, 16384), bool)))
    xla: the kernels do not take a mask
    """
    from . import triton

    implementation = check_implementation(implementation)
    if implementation == "xla":
        return "xla: implementation='xla'"
    dtype = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"x must be a real floating-point array, got dtype {dtype}; rms_norm refuses it "
            f"(cast it first, e.g. x.astype(jnp.float32))."
        )
    # rms_norm's defaults (norm_config's, held equal by a test).
    known = set(inspect.signature(norm_config).parameters) - {"x", "promote_with"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(
            f"explain() got unexpected keyword arguments {unknown}; it takes rms_norm's: "
            f"{', '.join(sorted(known))}, implementation."
        )
    cfg, scale, bias, mask = norm_config(x, scale=scale, eps=eps, **kwargs)
    reason = why_not_kernels(cfg, x, scale, bias, mask)
    if reason is not None:
        return f"xla: the kernels do not take {reason}"
    spec = kernel_spec(cfg, x, scale, bias, mask)
    assert spec is not None  # why_not_kernels found no reason
    if implementation == "auto":
        win = measured_win("rms_norm", spec, x)
        if win is None:
            platform, kind = target_device()
            return (
                f"xla: 'auto' takes the kernels only where rmsnorm_jax.kernels.MEASURED "
                f"holds a measured win, and none is for {kind} ({platform}), "
                f"{dtype.name}, {cfg.n} features, {math.prod(x.shape) * dtype.itemsize:,} "
                f"bytes of x; implementation='pallas' takes them anyway"
            )
        return (
            f"auto: the {_NAMES.get(win.backend, win.backend)} kernels on {win.platform} "
            f"(measured: {win.source}), XLA elsewhere"
        )
    rows = math.prod(x.shape[:-1])
    interpret = "the Triton kernels in interpret mode"
    if not triton.fits(spec, rows, dtype):
        interpret = "XLA (the row does not fit the Triton kernels)"
    return (
        f"pallas: GPU: {_gpu_path(spec, rows, dtype)}; TPU: Mosaic TPU where the row fits "
        f"the generation's VMEM, else XLA; CPU: {interpret}"
    )
