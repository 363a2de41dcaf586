"""``rms_norm`` on the XLA path: a ``custom_jvp`` whose forward mode is the tangent map
and whose reverse mode is its transpose, the analytic backward (``_linear_call.py``).

Residuals kept for the backward pass: ``x``, ``scale``, the ``mask`` in its given
(possibly broadcast) shape, and one float (at least float32) per row (``passes.py``).
"""

from __future__ import annotations

import functools

import jax

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


def _forward(cfg: NormConfig, x, scale, bias, mask):
    """``(y, row_stat)``."""
    row_stat = row_statistic(cfg, x, mask)
    return output(cfg, normalized(cfg, x, scale, bias, row_stat)), row_stat


def _backward(cfg: NormConfig, residuals, dy):
    """``(dx, dscale, dbias)`` from :func:`backward_parts`, ``dx`` in ``x``'s type."""
    x, scale, mask, row_stat = residuals
    dx, dscale, dbias = backward_parts(cfg, x, scale, mask, row_stat, dy)
    return match_vma(dx.astype(x.dtype), vma(jax.typeof(x))), dscale, dbias


def _tangent(cfg: NormConfig, residuals, dparams):
    return [output_tangent(cfg, tangent_parts(cfg, *residuals, *dparams))]


def rms_norm_core(cfg: NormConfig, x, scale, bias, mask):
    """RMSNorm of validated arrays (``mask`` is not differentiated), on ``x`` without
    the size-1 axes that nothing reaches (:func:`passes.without_unit_axes`)."""
    norm = lambda cfg, rows: _rms_norm(cfg, *rows, scale, bias, mask)
    return without_unit_axes(norm, cfg, (x,), (scale, bias, mask))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _rms_norm(cfg: NormConfig, x, scale, bias, mask):
    return _forward(cfg, x, scale, bias, mask)[0]


@functools.partial(_rms_norm.defjvp, symbolic_zeros=True)
def _jvp(cfg: NormConfig, primals, tangents):
    x, scale, bias, mask = primals
    y, row_stat = _forward(cfg, x, scale, bias, mask)
    (dy,) = tangents_of(
        [y],
        (x, scale, mask, row_stat),
        tangents[:3],
        functools.partial(_tangent, cfg),
        lambda res, cts: _backward(cfg, res, cts[0]),
    )
    return y, dy
