"""``add_rms_norm`` and ``gated_rms_norm``, the norms of today's LLM layers: their
argument checks, and the call into the XLA path (``_xla/``) or the kernels (``kernels/``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._config import (
    as_float_array,
    check_dtype,
    check_param,
    norm_config,
    normalize_axes,
    static_float,
)
from ._xla import ACTIVATIONS, AddConfig, GateConfig, add_rms_norm_core, gated_rms_norm_core
from .kernels._ops import add_rms_norm_kernel
from .kernels._select import route


def _check_like_x(name: str, value: Any, x: jax.Array) -> jax.Array:
    arr = as_float_array(name, value)
    if arr.shape != x.shape:
        raise ValueError(
            f"{name} with shape {arr.shape} must have x's shape {x.shape} (it is combined "
            f"with x element by element); broadcast or reshape it first."
        )
    return arr


def add_rms_norm(
    x: Any,
    residual: Any,
    scale: Any = None,
    eps: float = 1e-6,
    *,
    residual_dtype: Any = None,
    bias: Any = None,
    axis: int | Sequence[int] = -1,
    p: float = 1.0,
    scale_offset: float = 0.0,
    eps_placement: str = "inside",
    dtype: Any = None,
    axis_name: Hashable | None = None,
    mask: Any = None,
    implementation: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    r"""Residual add fused with RMSNorm: the pre-norm residual stream of a Transformer.

    ::

        h = x + residual                       # in residual_dtype
        y = rms_norm(h, scale, eps, ...)       # every rms_norm option
        return y, h

    The gradient is analytic (forward mode too): ``dh = (norm backward of dy) +
    (cotangent of h)``, returned to ``x`` and to ``residual`` each in its own dtype.
    Residuals kept for the backward pass: ``h``, ``scale`` and one float32 per row,
    no more than :func:`rms_norm` keeps (autodiff of ``rms_norm(x + r)`` keeps the same
    ``h``; a hand-written composition with ``flax.linen.RMSNorm`` keeps 3x to 6x more).
    The statistic is named ``"rms_norm_stat"`` and ``y`` ``"rms_norm_out"`` for remat
    policies.

    Dtypes: ``h`` has ``residual_dtype`` (default: the promotion of ``x`` and
    ``residual``; ``jnp.float32`` keeps a float32 residual stream under bfloat16
    activations). ``y`` has ``dtype`` (default: the promotion of ``h``, ``scale`` and
    ``bias``); statistics in at least float32.

    Args:
      x: the block's output, a floating array.
      residual: the residual stream, a floating array of ``x``'s shape.
      scale, eps, bias, axis, p, scale_offset, eps_placement, dtype, axis_name, mask:
        as in :func:`rms_norm`, applied to ``h``.
      residual_dtype: dtype of ``h``.
      implementation: ``"auto"``, ``"xla"`` or ``"pallas"``, as in :func:`rms_norm`.
        The kernels' forward reads ``x`` and ``residual`` and writes ``y``, ``h`` and the
        statistic in one pass; their backward reads ``h``, ``dy``, the cotangent of ``h``
        and the statistic, and writes the gradient both inputs share.

    Returns:
      ``(y, h)``, both of ``x``'s shape.

    Example:

    >>> import jax.numpy as jnp
    >>> from rmsnorm_jax import add_rms_norm
    >>> x = jnp.array([[1.0, 2.0], [3.0, 4.0]], jnp.bfloat16)
    >>> stream = jnp.array([[1.0, 0.0], [-1.0, 0.0]], jnp.float32)
    >>> y, h = add_rms_norm(x, stream, eps=0.0)
    >>> h.dtype, h.tolist()
    (dtype('float32'), [[2.0, 2.0], [2.0, 4.0]])
    >>> [round(v, 4) for v in y.ravel().tolist()]   # [2, 2] / 2 and [2, 4] / sqrt(10)
    [1.0, 1.0, 0.6325, 1.2649]
    """
    x = as_float_array("x", x)
    residual = _check_like_x("residual", residual, x)
    if residual_dtype is None:
        residual_dtype = jnp.promote_types(x.dtype, residual.dtype)
    residual_dtype = check_dtype(residual_dtype)
    h_type = jax.ShapeDtypeStruct(x.shape, residual_dtype)
    cfg, scale, bias, mask = norm_config(
        h_type, scale, eps, bias, axis, p, scale_offset, eps_placement, dtype, axis_name, mask
    )
    acfg = AddConfig(np.dtype(residual_dtype), jax.typeof(x), jax.typeof(residual))
    path = route("add_rms_norm", implementation, cfg, x, scale, bias, mask, acfg)
    if path.spec is not None:
        return add_rms_norm_kernel(cfg, path.spec, path.request, acfg, x, residual, scale, bias)
    return add_rms_norm_core(cfg, acfg, x, residual, scale, bias, mask)


def gated_rms_norm(
    x: Any,
    gate: Any,
    scale: Any = None,
    eps: float = 1e-6,
    *,
    activation: str = "silu",
    norm_before_gate: bool = True,
    group_size: int | None = None,
    bias: Any = None,
    axis: int | Sequence[int] = -1,
    p: float = 1.0,
    scale_offset: float = 0.0,
    eps_placement: str = "inside",
    dtype: Any = None,
    implementation: str = "auto",
) -> jax.Array:
    r"""Gated RMSNorm (Mamba2, FLA's ``FusedRMSNormGated``, Qwen3-Next's ``RMSNormGated``).

    ::

        norm_before_gate=True:   y = ((scale + offset) * x / RMS(x) + bias) * act(gate)
        norm_before_gate=False:  y = (scale + offset) * v / RMS(v) + bias,  v = x * act(gate)

    with ``act`` = ``silu`` (``z * sigmoid(z)``) or ``sigmoid``. With ``group_size``
    the statistic is taken per group of ``group_size`` consecutive features of the last
    axis (one per row and group, as in Mamba2's grouped norm); ``scale`` and ``bias``
    stay per feature.

    The gradient is analytic (forward mode too) for ``x``, ``gate``, ``scale`` and
    ``bias``. Residuals kept for the backward pass: ``x``, ``gate``, ``scale`` (and
    ``bias``) and one float32 per row and group; ``act(gate)`` and the normalized
    values are recomputed. (Autodiff of ``norm(x) * silu(z)`` keeps full-size float32
    copies besides.)

    Dtypes: statistics and the gating in at least float32; ``y`` has ``dtype``
    (default: the promotion of ``x``, ``gate``, ``scale`` and ``bias``); gradients come
    back in each input's dtype.

    Args:
      x: floating array.
      gate: floating array of ``x``'s shape (the gate branch, before its activation).
      scale, eps, bias, axis, p, scale_offset, eps_placement, dtype: as in
        :func:`rms_norm`. ``p < 1`` and several ``axis`` entries are not combined with
        ``group_size``.
      activation: ``"silu"`` (default) or ``"sigmoid"``.
      norm_before_gate: normalize then gate (default, Mamba2's and FLA's default), or
        gate then normalize.
      group_size: optional int dividing the last axis: the statistic per group.
      implementation: ``"auto"``, ``"xla"`` or ``"pallas"``, accepted for a uniform API
        with :func:`rms_norm`; there is no fused kernel for the gated form yet, so every
        value computes it with XLA.

    Returns:
      ``y`` of ``x``'s shape.

    Example:

    >>> import jax.numpy as jnp
    >>> from rmsnorm_jax import gated_rms_norm
    >>> x = jnp.array([[3.0, 4.0, 1.0, 1.0]])
    >>> # RMS = sqrt(27 / 4); sigmoid(0) = 1/2
    >>> y = gated_rms_norm(x, jnp.zeros_like(x), eps=0.0, activation="sigmoid")
    >>> [round(v, 4) for v in y.ravel().tolist()]
    [0.5774, 0.7698, 0.1925, 0.1925]
    >>> # RMS per group of two: sqrt(12.5) and 1; silu(50) = 50
    >>> y = gated_rms_norm(x, jnp.full_like(x, 50.0), eps=0.0, group_size=2)
    >>> [round(v, 3) for v in y.ravel().tolist()]
    [42.426, 56.569, 50.0, 50.0]
    """
    x = as_float_array("x", x)
    gate = _check_like_x("gate", gate, x)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}.")
    if not isinstance(norm_before_gate, bool):
        raise TypeError(f"norm_before_gate must be a bool, got {norm_before_gate!r}.")
    shape = x.shape
    if group_size is not None:
        x, gate, scale, bias, axis = _grouped(x, gate, scale, bias, axis, p, group_size)
    options = (scale, eps, bias, axis, p, scale_offset, eps_placement, dtype)
    cfg, scale, bias, _ = norm_config(x, *options, promote_with=(gate.dtype,))
    route("gated_rms_norm", implementation, cfg, x, scale, bias, None)  # XLA: no kernel yet
    y = gated_rms_norm_core(cfg, GateConfig(activation, norm_before_gate), x, gate, scale, bias)
    return y.reshape(shape)


def _grouped(x, gate, scale, bias, axis, p, group_size):
    """Views the last axis as (groups, group_size); the parameters likewise."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise TypeError(f"group_size must be a positive int or None, got {group_size!r}.")
    if x.ndim == 0 or x.shape[-1] % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide the last axis of x with shape "
            f"{x.shape}; pick a divisor of {x.shape[-1] if x.ndim else 'it'}."
        )
    if normalize_axes(axis, x.ndim) != (x.ndim - 1,):
        raise ValueError(
            f"group_size groups the last axis and cannot be combined with axis={axis!r}; "
            f"use axis=-1 (the default)."
        )
    if static_float("p", p, "in (0, 1]") != 1.0:
        raise ValueError(f"group_size with p={p} is not supported (pRMSNorm per group); use p=1.0.")
    grouped = (*x.shape[:-1], x.shape[-1] // group_size, group_size)

    def param(name, value):
        if value is None:
            return None
        arr = check_param(name, value, x.shape)
        if arr.ndim == 0:
            return arr
        if arr.shape[-1] == 1:  # one value for every feature: size 1 on both new axes
            return arr[..., None]
        return arr.reshape((*arr.shape[:-1], *grouped[-2:]))

    return x.reshape(grouped), gate.reshape(grouped), param("scale", scale), param("bias", bias), -1
