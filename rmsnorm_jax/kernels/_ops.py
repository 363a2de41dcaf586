"""``rms_norm_kernel`` and ``add_rms_norm_kernel``: the two norms by the fused kernels,
with the XLA path's residuals and rules.

Each is a ``custom_jvp``: forward mode is the XLA tangent map (``_xla/passes.py``) around
the kernels' output; reverse mode its transpose, the kernel backward (``_linear_call``).
The residuals are the XLA path's: ``x`` (``h`` for the residual form), ``scale`` and the
per-row float32 statistic, named ``"rms_norm_stat"``; ``y`` is named ``"rms_norm_out"``.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from .._config import NormConfig
from .._linear_call import tangents_of
from .._types import cotangent_like, match_vma, vma
from .._xla.add_rms_norm import AddConfig, add_tangent
from .._xla.passes import OUT_NAME, STAT_NAME, output_tangent, tangent_parts
from ._contract import KernelSpec
from ._launch import RowCall, backward_rows, forward_rows
from ._select import Request, add_dx_dtype


def _vector(a, n: int):
    return None if a is None else a.reshape(n)


def _parameter_cotangents(spec: KernelSpec, sums, scale, bias_type):
    """The kernels' parameter sums (replicated) in their primals' types."""
    it = iter(sums)
    dscale = cotangent_like(next(it), jax.typeof(scale)) if spec.has_scale else None
    dbias = cotangent_like(next(it), bias_type) if spec.has_bias else None
    return dscale, dbias


# ---------------------------------------------------------------- rms_norm


def _forward(cfg: NormConfig, spec: KernelSpec, request: Request, x, scale, bias):
    n = spec.n
    call = RowCall(cfg, spec, request)
    y, stat = forward_rows(call, x, None, _vector(scale, n), _vector(bias, n))
    stat = checkpoint_name(stat, STAT_NAME)
    return checkpoint_name(y, OUT_NAME), (x, scale, stat)


def _backward(cfg: NormConfig, spec: KernelSpec, request: Request, residuals, cts):
    x, scale, stat = residuals
    call = RowCall(cfg, spec, request, dx_dtype=np.dtype(x.dtype))
    dx, *sums = backward_rows(call, x, cts[0], stat, None, _vector(scale, spec.n))
    dscale, dbias = _parameter_cotangents(spec, sums, scale, cfg.bias_type)
    return match_vma(dx, vma(jax.typeof(x))), dscale, dbias


def _tangent(cfg: NormConfig, residuals, dparams):
    x, scale, stat = residuals
    return [output_tangent(cfg, tangent_parts(cfg, x, scale, None, stat, *dparams))]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def rms_norm_kernel(cfg: NormConfig, spec: KernelSpec, request: Request, x, scale, bias):
    """``rms_norm`` of validated arrays by the kernel path (``_select.route``'s spec)."""
    return _forward(cfg, spec, request, x, scale, bias)[0]


@functools.partial(rms_norm_kernel.defjvp, symbolic_zeros=True)
def _jvp(cfg, spec, request, primals, tangents):
    y, res = _forward(cfg, spec, request, *primals)
    (dy,) = tangents_of(
        [y],
        res,
        tangents,
        functools.partial(_tangent, cfg),
        functools.partial(_backward, cfg, spec, request),
    )
    return y, dy


# ---------------------------------------------------------------- add_rms_norm


def _add_forward(
    cfg, spec: KernelSpec, request: Request, acfg: AddConfig, x, residual, scale, bias
):
    n = spec.n
    call = RowCall(cfg, spec, request, h_dtype=np.dtype(acfg.residual_dtype))
    y, stat, h = forward_rows(call, x, residual, _vector(scale, n), _vector(bias, n))
    stat = checkpoint_name(stat, STAT_NAME)
    return (checkpoint_name(y, OUT_NAME), h), (h, scale, stat)


def _add_backward(cfg, spec: KernelSpec, request: Request, acfg: AddConfig, residuals, cts):
    h, scale, stat = residuals
    dy, dh_out = cts
    call = RowCall(cfg, spec, request, dx_dtype=add_dx_dtype(acfg))
    dh, *sums = backward_rows(call, h, dy, stat, dh_out, _vector(scale, spec.n))
    dscale, dbias = _parameter_cotangents(spec, sums, scale, cfg.bias_type)
    dx = match_vma(dh.astype(acfg.x_type.dtype), vma(acfg.x_type))
    dresidual = match_vma(dh.astype(acfg.residual_type.dtype), vma(acfg.residual_type))
    return dx, dresidual, dscale, dbias


def _add_tangent(cfg: NormConfig, acfg: AddConfig, residuals, dparams):
    h, scale, stat = residuals
    return add_tangent(cfg, acfg, (h, scale, None, stat), dparams)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def add_rms_norm_kernel(
    cfg: NormConfig, spec: KernelSpec, request: Request, acfg: AddConfig, x, residual, scale, bias
):
    """``add_rms_norm`` of validated arrays by the kernel path: ``(y, h)``."""
    return _add_forward(cfg, spec, request, acfg, x, residual, scale, bias)[0]


@functools.partial(add_rms_norm_kernel.defjvp, symbolic_zeros=True)
def _add_jvp(cfg, spec, request, acfg, primals, tangents):
    outs, res = _add_forward(cfg, spec, request, acfg, *primals)
    dy, dh = tangents_of(
        outs,
        res,
        tangents,
        functools.partial(_add_tangent, cfg, acfg),
        functools.partial(_add_backward, cfg, spec, request, acfg),
    )
    return outs, (dy, dh)
