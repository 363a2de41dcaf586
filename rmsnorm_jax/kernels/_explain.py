"""``explain``: which path a call of ``rms_norm`` takes, and why, without making it."""

from __future__ import annotations

import inspect
import math

import jax.numpy as jnp

from .._config import check_implementation, norm_config
from ._dispatch import kernel_spec, measured_win, target_device, why_not_kernels


def explain(x, scale=None, eps: float = 1e-6, *, implementation: str = "pallas", **kwargs) -> str:
    """Which path ``rms_norm(x, scale, eps, implementation=..., **kwargs)`` takes, and why.

    The same arguments as :func:`rmsnorm_jax.rms_norm` (arrays or
    ``jax.ShapeDtypeStruct``); nothing is computed. The answer names XLA with the
    reason, or the kernels per platform: a GPU (Triton), a TPU (Mosaic, where a row fits
    the generation's VMEM, decided when compiled) and a CPU (interpret mode), each with
    the XLA fallback where a row does not fit.

    >>> import jax, jax.numpy as jnp
    >>> from rmsnorm_jax.kernels import explain
    >>> x = jax.ShapeDtypeStruct((8, 16384), jnp.bfloat16)
    >>> for part in explain(x).split("; "):
    ...     print(part)
    pallas: GPU: XLA (the row does not fit the Triton kernels)
    TPU: Mosaic where the row fits the generation's VMEM, else XLA
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
    known = set(inspect.signature(norm_config).parameters) - {"shape", "x_dtype", "promote_with"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(
            f"explain() got unexpected keyword arguments {unknown}; it takes rms_norm's: "
            f"{', '.join(sorted(known))}, implementation."
        )
    cfg, scale, bias, mask = norm_config(x.shape, dtype, scale=scale, eps=eps, **kwargs)
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
        return f"auto: the kernels on {win.platform} (measured: {win.source}), XLA elsewhere"
    rows = math.prod(x.shape[:-1])
    fits = triton.fits(spec, rows, dtype)  # the CPU's interpret mode runs the Triton kernels
    gpu = "Triton" if fits else "XLA (the row does not fit the Triton kernels)"
    interpret = "interpret mode" if fits else gpu
    return (
        f"pallas: GPU: {gpu}; TPU: Mosaic where the row fits the generation's VMEM, "
        f"else XLA; CPU: {interpret}"
    )
