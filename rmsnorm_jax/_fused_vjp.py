"""The differentiable cores of the fused LLM-layer norms, built on the core's passes
(``_vjp.py``): ``add_rms_norm_core`` and ``gated_rms_norm_core`` with their forward and
backward rules and tangent maps. The public functions (``_fused.py``) check the arguments
and call these or the kernels; the kernels reuse :func:`add_tangent` from here.

- ``add_rms_norm``: ``h = x + residual``, ``y = rms_norm(h)``, returning both (the
  pre-norm residual stream). Residuals for the backward pass: ``h`` (the one array the
  stream keeps anyway), ``scale`` and one float per row.
- ``gated_rms_norm``: ``y = norm(x) * act(gate)`` or ``y = norm(x * act(gate))``
  (Mamba2, FLA, Qwen3-Next). Residuals: ``x``, ``gate``, ``scale`` (and ``bias``) and
  one float per row (and group); ``act(gate)`` and the normalized values are
  recomputed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._backends import residual_sum, vma
from ._linear import tangents_of
from ._vjp import (
    NormConfig,
    backward_parts,
    match_vma,
    normalized,
    output,
    output_tangent,
    row_statistic,
    tangent_parts,
)

# ---------------------------------------------------------------- residual add


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


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def add_rms_norm_core(cfg: NormConfig, acfg: AddConfig, x, residual, scale, bias, mask):
    """``(rms_norm(h), h)`` with ``h = x + residual`` in ``acfg.residual_dtype``."""
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


def _sum_present(parts: list) -> jax.Array | None:
    """The sum of the non-zero tangent parts, or None (a zero tangent) when there are none."""
    return functools.reduce(lambda a, b: a + b, parts) if parts else None


def add_tangent(cfg, acfg, res, tangents):
    """The tangents of ``(y, h)``: ``dh = dx + dresidual``, ``dy = T(h; dh, ...)``."""
    h, scale, mask, row_stat = res
    dx, dresidual, dscale, dbias = tangents
    dh = _sum_present([t.astype(acfg.residual_dtype) for t in (dx, dresidual) if t is not None])
    dy = tangent_parts(cfg, h, scale, mask, row_stat, dh, dscale, dbias)
    dh_out = jnp.zeros(h.shape, acfg.residual_dtype) if dh is None else dh
    return [output_tangent(cfg, dy), dh_out]


@functools.partial(add_rms_norm_core.defjvp, symbolic_zeros=True)
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


# ---------------------------------------------------------------- gated


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


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def gated_rms_norm_core(cfg: NormConfig, gcfg: GateConfig, x, gate, scale, bias):
    """``norm(x) * act(gate)`` (``norm_before_gate``) or ``norm(x * act(gate))``."""
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
        dv = _sum_present(parts)
        dy = tangent_parts(cfg, v, scale, None, row_stat, dv, dscale, dbias)
    return [output_tangent(cfg, dy)]


@functools.partial(gated_rms_norm_core.defjvp, symbolic_zeros=True)
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
