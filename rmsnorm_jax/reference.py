"""The plain formula in jax.numpy, differentiated by autodiff: the tests' oracle.

Written independently of the custom_vjp core (it moves the normalized axes to the end,
flattens each row, and slices the first ``k`` features), so that agreement between the
two is evidence, not tautology. Used by tests, benchmarks and docs, never by the
library itself.
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def rms_norm_reference(
    x,
    scale=None,
    eps: float = 1e-6,
    *,
    bias=None,
    axis=-1,
    p: float = 1.0,
    k: int | None = None,
    scale_offset: float = 0.0,
    eps_placement: str = "inside",
    mask=None,
):
    """``(scale + scale_offset) * x / RMS(x) + bias`` with the RMS of the first k features.

    Computes in the dtype of ``x`` (call it with float64 arrays under
    ``jax.enable_x64(True)`` for an exact oracle). ``k`` overrides ``ceil(n * p)``.
    ``mask`` (broadcastable to ``x``): the mean square over the True positions of each
    row only, ``sum(x**2 [mask]) / max(count, 1)``.

    >>> import jax.numpy as jnp
    >>> y = rms_norm_reference(jnp.array([2.0, 4.0, 6.0, 8.0]), eps=0.0)
    >>> [round(float(v), 3) for v in y]   # x / sqrt(30)
    [0.365, 0.73, 1.095, 1.461]
    """
    axes = tuple(sorted(a % x.ndim for a in ((axis,) if isinstance(axis, int) else axis)))
    rest = tuple(a for a in range(x.ndim) if a not in axes)
    moved = jnp.transpose(x, rest + axes)
    n = math.prod(x.shape[a] for a in axes)
    rows = moved.reshape(-1, n)
    if k is None:
        k = min(n, math.ceil(round(n * p, 9)))
    if mask is None:
        ms = jnp.mean(rows[:, :k] ** 2, axis=1, keepdims=True)
    else:
        m = jnp.transpose(jnp.broadcast_to(mask, x.shape), rest + axes).reshape(-1, n)
        squares = jnp.where(m, rows, 0) ** 2
        count = jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1)
        ms = jnp.sum(squares, axis=1, keepdims=True) / count
    if eps_placement == "inside":
        normed = rows / jnp.sqrt(ms + eps)
    else:
        normed = rows / (jnp.sqrt(ms) + eps)
    y = normed.reshape(moved.shape)
    y = jnp.transpose(y, tuple(sorted(range(x.ndim), key=lambda i: (rest + axes)[i])))
    if scale is not None:
        y = y * (scale + scale_offset)
    if bias is not None:
        y = y + bias
    return y


def add_rms_norm_reference(x, residual, scale=None, eps: float = 1e-6, **kw):
    """``(rms_norm_reference(x + residual), x + residual)``."""
    h = x + residual
    return rms_norm_reference(h, scale, eps, **kw), h


def gated_rms_norm_reference(
    x,
    gate,
    scale=None,
    eps: float = 1e-6,
    *,
    activation: str = "silu",
    norm_before_gate: bool = True,
    group_size: int | None = None,
    bias=None,
    **kw,
):
    """The gated norm written out: ``act(z) = z / (1 + exp(-z))`` (silu) or
    ``1 / (1 + exp(-z))``; groups by splitting the last axis and normalizing each
    group on its own."""
    sig = 1 / (1 + jnp.exp(-gate))
    act = gate * sig if activation == "silu" else sig
    offset = kw.pop("scale_offset", 0.0)  # the gain is applied here, not per group

    def norm(v):
        if group_size is None:
            return rms_norm_reference(v, eps=eps, **kw)
        groups = jnp.split(v, v.shape[-1] // group_size, axis=-1)
        return jnp.concatenate([rms_norm_reference(g, eps=eps, **kw) for g in groups], -1)

    gain = 1.0 if scale is None else scale + offset
    shift = 0.0 if bias is None else bias
    if norm_before_gate:
        return (gain * norm(x) + shift) * act
    return gain * norm(x * act) + shift
