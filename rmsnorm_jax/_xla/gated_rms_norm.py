"""``gated_rms_norm`` on the XLA path: ``y = norm(x) * act(gate)`` or
``y = norm(x * act(gate))`` (Mamba2, FLA, Qwen3-Next), with forward mode and the analytic
backward.

Residuals: ``x``, ``gate``, ``scale`` (and ``bias``) and one float per row (and group);
``act(gate)`` and the normalized values are recomputed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from .._config import NormConfig
from .._linear_call import tangents_of
from .._types import match_vma, vma
from .add_rms_norm import sum_present
from .passes import (
    backward_parts,
    normalized,
    output,
    output_tangent,
    row_statistic,
    tangent_parts,
    without_unit_axes,
)

ACTIVATIONS = ("silu", "sigmoid")


@dataclasses.dataclass(frozen=True)
class GateConfig:
    """The static part of a gated call besides the norm's own :class:`NormConfig`."""

    activation: str
    norm_before_gate: bool


def _activation(gcfg: GateConfig, gate: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(act(gate), act'(gate))`` in the dtype of ``gate`` (the compute dtype)."""
    sig = jax.nn.sigmoid(gate)
    if gcfg.activation == "sigmoid":
        return sig, sig * (1 - sig)
    return gate * sig, sig * (1 + gate * (1 - sig))  # silu


def gated_rms_norm_core(cfg: NormConfig, gcfg: GateConfig, x, gate, scale, bias):
    """``norm(x) * act(gate)`` (``norm_before_gate``) or ``norm(x * act(gate))``, on
    inputs without the size-1 axes that nothing reaches (:func:`passes.without_unit_axes`)."""
    norm = lambda cfg, rows: _gated_rms_norm(cfg, gcfg, *rows, scale, bias)
    return without_unit_axes(norm, cfg, (x, gate), (scale, bias))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _gated_rms_norm(cfg: NormConfig, gcfg: GateConfig, x, gate, scale, bias):
    return _gated_fwd(cfg, gcfg, x, gate, scale, bias)[0]


def _gated_fwd(cfg, gcfg, x, gate, scale, bias):
    cd = cfg.compute_dtype
    act, _ = _activation(gcfg, gate.astype(cd))
    if gcfg.norm_before_gate:
        row_stat = row_statistic(cfg, x, None)
        y = normalized(cfg, x, scale, bias, row_stat) * act
    else:
        v = x.astype(cd) * act
        row_stat = row_statistic(cfg, v, None)
        y = normalized(cfg, v, scale, bias, row_stat)
    return output(cfg, y), (x, gate, scale, bias, row_stat)


def _gated_bwd(cfg, gcfg, saved, dy):
    x, gate, scale, bias, row_stat = saved
    cd = cfg.compute_dtype
    act, act_grad = _activation(gcfg, gate.astype(cd))
    dy = dy.astype(cd)
    if gcfg.norm_before_gate:
        # y = n * a with n = norm(x) (scale and bias included): dn = dy * a for the
        # core's backward, dgate = dy * n * a'.
        n = normalized(cfg, x, scale, bias, row_stat)
        dx, dscale, dbias = backward_parts(cfg, x, scale, None, row_stat, dy * act)
        dgate = dy * n * act_grad
    else:
        # y = norm(v) with v = x * a: dv from the core, dx = dv * a, dgate = dv * x * a'.
        v = x.astype(cd) * act
        dv, dscale, dbias = backward_parts(cfg, v, scale, None, row_stat, dy)
        dx = dv * act
        dgate = dv * x.astype(cd) * act_grad
    dx = match_vma(dx.astype(x.dtype), vma(jax.typeof(x)))
    dgate = match_vma(dgate.astype(gate.dtype), vma(jax.typeof(gate)))
    return dx, dgate, dscale, dbias


def _gated_tangent(cfg, gcfg, res, tangents):
    x, gate, scale, bias, row_stat = res
    dx, dgate, dscale, dbias = tangents
    cd = cfg.compute_dtype
    act, act_grad = _activation(gcfg, gate.astype(cd))
    dgate = None if dgate is None else dgate.astype(cd)
    if gcfg.norm_before_gate:
        # y = n * a: dy = dn * a + n * a' * dgate.
        dy = tangent_parts(cfg, x, scale, None, row_stat, dx, dscale, dbias) * act
        if dgate is not None:
            dy = dy + normalized(cfg, x, scale, bias, row_stat) * act_grad * dgate
    else:
        # y = norm(v), v = x * a: dv = dx * a + x * a' * dgate.
        v = x.astype(cd) * act
        parts = [dx.astype(cd) * act] if dx is not None else []
        if dgate is not None:
            parts.append(x.astype(cd) * act_grad * dgate)
        dv = sum_present(parts)
        dy = tangent_parts(cfg, v, scale, None, row_stat, dv, dscale, dbias)
    return [output_tangent(cfg, dy)]


@functools.partial(_gated_rms_norm.defjvp, symbolic_zeros=True)
def _gated_jvp(cfg, gcfg, primals, tangents):
    y, res = _gated_fwd(cfg, gcfg, *primals)
    (dy,) = tangents_of(
        [y],
        res,
        tangents,
        lambda res, t: _gated_tangent(cfg, gcfg, res, t),
        lambda res, cts: _gated_bwd(cfg, gcfg, res, cts[0]),
    )
    return y, dy
