"""``add_rms_norm`` on the XLA path: ``h = x + residual``, ``y = rms_norm(h)``, both
returned (the pre-norm residual stream), with forward mode and the analytic backward.

Residuals for the backward pass: ``h`` (the one array the stream keeps anyway), ``scale``
and one float per row. The statistic, the normalisation and the backward are
``passes.py``'s; the kernels reuse :func:`add_tangent`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._config import NormConfig
from .._linear_call import tangents_of
from .._types import match_vma, vma
from .passes import (
    backward_parts,
    normalized,
    output,
    output_tangent,
    row_statistic,
    tangent_parts,
    without_unit_axes,
)
from .per_compiler import residual_sum


@dataclasses.dataclass(frozen=True)
class AddConfig:
    """The static part of an ``add_rms_norm`` call besides the norm's :class:`NormConfig`.

    Attributes:
      residual_dtype: dtype of ``h = x + residual``.
      x_type, residual_type: ``jax.typeof`` of the inputs (dtype and varying mesh
        axes): what their cotangents must look like.
    """

    residual_dtype: np.dtype
    x_type: Any
    residual_type: Any


def add_rms_norm_core(cfg: NormConfig, acfg: AddConfig, x, residual, scale, bias, mask):
    """``(rms_norm(h), h)`` with ``h = x + residual`` in ``acfg.residual_dtype``, on
    inputs without the size-1 axes that nothing reaches (:func:`passes.without_unit_axes`)."""
    norm = lambda cfg, rows: _add_rms_norm(cfg, acfg, *rows, scale, bias, mask)
    return without_unit_axes(norm, cfg, (x, residual), (scale, bias, mask))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _add_rms_norm(cfg: NormConfig, acfg: AddConfig, x, residual, scale, bias, mask):
    return _add_fwd(cfg, acfg, x, residual, scale, bias, mask)[0]


def _add_fwd(cfg, acfg, x, residual, scale, bias, mask):
    # y and the statistic read the h that is returned and saved.
    h = residual_sum(x, residual, acfg.residual_dtype)
    row_stat = row_statistic(cfg, h, mask)
    y = output(cfg, normalized(cfg, h, scale, bias, row_stat))
    return (y, h), (h, scale, mask, row_stat)


def _add_bwd(cfg, acfg, saved, cotangents):
    """``dh = (norm backward of dy) + (cotangent of h)``, the same for both inputs."""
    h, scale, mask, row_stat = saved
    dy, dh_out = cotangents
    dh, dscale, dbias = backward_parts(cfg, h, scale, mask, row_stat, dy)
    dh = dh + dh_out.astype(dh.dtype)
    dx = match_vma(dh.astype(acfg.x_type.dtype), vma(acfg.x_type))
    dresidual = match_vma(dh.astype(acfg.residual_type.dtype), vma(acfg.residual_type))
    return dx, dresidual, dscale, dbias, None


def sum_present(parts: list) -> jax.Array | None:
    """The sum of the non-zero tangent parts, or None (a zero tangent) when there are none."""
    return functools.reduce(lambda a, b: a + b, parts) if parts else None


def add_tangent(cfg, acfg, res, tangents):
    """The tangents of ``(y, h)``: ``dh = dx + dresidual``, ``dy = T(h; dh, ...)``."""
    h, scale, mask, row_stat = res
    dx, dresidual, dscale, dbias = tangents
    dh = sum_present([t.astype(acfg.residual_dtype) for t in (dx, dresidual) if t is not None])
    dy = tangent_parts(cfg, h, scale, mask, row_stat, dh, dscale, dbias)
    dh_out = jnp.zeros(h.shape, acfg.residual_dtype) if dh is None else dh
    return [output_tangent(cfg, dy), dh_out]


@functools.partial(_add_rms_norm.defjvp, symbolic_zeros=True)
def _add_jvp(cfg, acfg, primals, tangents):
    outs, res = _add_fwd(cfg, acfg, *primals)
    dy, dh = tangents_of(
        outs,
        res,
        tangents[:4],
        lambda res, t: add_tangent(cfg, acfg, res, t),
        lambda res, cts: _add_bwd(cfg, acfg, res, cts)[:4],
    )
    return outs, (dy, dh)
