"""Pallas Mosaic kernels for TPU (v4 to TPU7x): one pass forward, one pass backward.

The contract (``_contract.Backend``) is ``_contract.py``'s and so is the
maths: the kernel bodies call its per-row helpers on float32 blocks loaded from VMEM.
Blocks are whole rows (``mosaic_tpu_plan.py`` sizes them), so a row's statistic and its
normalisation happen in the same pass over HBM:

- forward, grid ``(blocks,)``, "parallel": reads x (and the residual) once, writes y (and
  h) once, and the per-row float32 statistic, lane-dense as ``(blocks, 1, block_rows)``
  (a ``(rows, 1)`` column would be padded to 128 lanes by XLA:TPU);
- backward, grid ``(slots, steps)``: "parallel" over ``slots`` (the two TensorCores of a
  megacore v4/v5p chip each take one), "arbitrary" over ``steps``. Reads x, dy (and dh)
  once, writes dx once; the scale and bias gradients are summed into an (8, n) float32
  accumulator that stays in VMEM for all the steps of a slot, so the partial sums written
  are ``(8 * slots, n)`` whatever the number of rows.

``docs/kernels.md`` has the sizes, the bytes moved and the layouts XLA:TPU gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._rounding import added
from ._contract import (
    KernelSpec,
    check_backward,
    check_forward,
    input_grad,
    inv_rms,
    mean_square,
    normalized,
    out_struct,
    stat_from_ms,
)
from .mosaic_tpu_plan import LANES, PARTIAL_ROWS, Plan, backward_row_map, fits, plan

__all__ = ["LABEL", "NAME", "PLATFORM", "backward", "deprecated", "fits", "forward", "unusable"]

NAME = "mosaic_tpu"
LABEL = "Mosaic TPU"
PLATFORM = "tpu"
_KERNELS = "the Mosaic TPU kernels"


def unusable(target) -> str | None:
    """None: every TPU generation from v4 runs them (one not known gets v4's sizes,
    which fit them all: ``mosaic_tpu_plan.generation``)."""
    return None


def deprecated(version: str) -> str | None:
    """None: Pallas' Mosaic TPU backend is jax's own, not deprecated."""
    return None


def _pallas_call(body, p: Plan, specs, semantics, interpret: bool, kind: str):
    """``pl.pallas_call`` of ``body`` over ``p``'s grid; ``specs``: the in and out block
    specs and the out shapes."""
    in_specs, out_specs, out_shape = specs
    return pl.pallas_call(
        body,
        grid=p.grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=semantics, vmem_limit_bytes=p.generation.vmem_limit_bytes
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=f"rms_norm_{kind}",
    )


def _lane_row(column: jax.Array) -> jax.Array:
    """(rows, 1) -> (1, rows), for the lane-dense statistic. A transpose of a (rows, 128)
    tile: ``column.reshape(1, rows)`` needs a sublane gather, which v4 lacks."""
    rows = column.shape[0]
    return jnp.transpose(jnp.broadcast_to(column, (rows, LANES)))[:1, :]


def _col(shape) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)


def forward(spec: KernelSpec, x, scale, bias, residual=None, *, h_dtype=None, interpret=False):
    """One pass: ``(y, stat, h)`` of ``x`` (rows, n), the contract of ``_contract.py``.

    y = (scale + scale_offset) * h * r + bias in spec.out_dtype, h = x (or x + residual
    in h_dtype), r = 1 / RMS of the first spec.k features, computed in float32;
    stat: (rows,) float32, rsqrt(ms + eps) ("inside") or sqrt(ms) ("outside").
    ``interpret=True`` runs the kernel on CPU (Pallas TPU interpret mode).
    """
    rows, h_dtype, _ = check_forward(spec, x, scale, bias, residual, h_dtype, _KERNELS)
    n = spec.n
    residual_dtype = None if residual is None else residual.dtype
    p = plan(spec, rows, x.dtype, "forward", residual_dtype=residual_dtype, h_dtype=h_dtype)
    if p is None:
        raise ValueError(
            f"rows of {n} features do not fit the TPU kernel's VMEM (or rows == {rows} is "
            f"0); check fits(spec, rows, x.dtype) first and use the XLA path."
        )
    br, (blocks,) = p.block_rows, p.grid
    with_residual = residual is not None

    def body(*refs):
        refs = list(refs)
        x_ref = refs.pop(0)
        res_ref = refs.pop(0) if with_residual else None
        scale_ref = refs.pop(0) if spec.has_scale else None
        bias_ref = refs.pop(0) if spec.has_bias else None
        y_ref, stat_ref = refs.pop(0), refs.pop(0)
        if with_residual:
            # Mosaic rounds h to h_dtype before it is widened again; interpret mode runs
            # this body as XLA ops, which may keep float32 values (excess precision):
            # ``added`` keeps the roundings there (``rmsnorm_jax/_rounding.py``).
            h = added(x_ref[...], res_ref[...], h_dtype, keep=interpret)
            refs.pop(0)[...] = h
            xf = h.astype(jnp.float32)
        else:
            xf = x_ref[...].astype(jnp.float32)
        col = _col((1, n))
        stat = stat_from_ms(spec, mean_square(spec, xf, col))  # (br, 1)
        scale_f = None if scale_ref is None else scale_ref[...]
        bias_f = None if bias_ref is None else bias_ref[...]
        y_ref[...] = normalized(spec, xf, stat, scale_f, bias_f).astype(y_ref.dtype)
        stat_ref[...] = _lane_row(stat)

    row_spec = pl.BlockSpec((br, n), lambda i: (i, 0))
    vec_spec = pl.BlockSpec((1, n), lambda i: (0, 0))
    operands = [x] + ([residual] if with_residual else [])
    in_specs = [row_spec] * len(operands)
    for param, on in ((scale, spec.has_scale), (bias, spec.has_bias)):
        if on:
            operands.append(param.astype(jnp.float32).reshape(1, n))
            in_specs.append(vec_spec)
    out_shape = [
        out_struct((rows, n), spec.out_dtype, x),
        out_struct((blocks, 1, br), jnp.float32, x),
    ]
    out_specs = [row_spec, pl.BlockSpec((None, 1, br), lambda i: (i, 0, 0))]
    if with_residual:
        out_shape.append(out_struct((rows, n), h_dtype, x))
        out_specs.append(row_spec)
    specs = (in_specs, out_specs, out_shape)
    outs = _pallas_call(body, p, specs, ("parallel",), interpret, "forward")(*operands)
    y, stat = outs[0], outs[1].reshape(blocks * br)[:rows]
    return y, stat, (outs[2] if with_residual else None)


def backward(spec: KernelSpec, x, dy, stat, scale, dh=None, *, dx_dtype, interpret=False):
    """One pass: ``(dx, dscale_partials, dbias_partials)``, the contract of ``_contract.py``.

    dx = r * gdy - [col < k] * x * r * alpha * (1/k) * sum_j gdy_j x_j r (+ dh), in
    dx_dtype, with gdy = (scale + offset) * dy (``_contract.input_grad``); the partials are
    float32 (8 * slots, n) sums of dy * x * r and of dy over the rows (sum them over
    axis 0). ``interpret=True`` runs the kernel on CPU (Pallas TPU interpret mode).
    """
    rows, dx_dtype = check_backward(spec, x, dy, stat, scale, dh, dx_dtype, _KERNELS)
    n = spec.n
    residual_dtype = None if dh is None else dh.dtype
    p = plan(spec, rows, x.dtype, "backward", residual_dtype=residual_dtype, dx_dtype=dx_dtype)
    if p is None:
        raise ValueError(
            f"rows of {n} features do not fit the TPU kernel's VMEM (or rows == {rows} is "
            f"0); check fits(spec, rows, x.dtype) first and use the XLA path."
        )
    br = p.block_rows
    slots, steps = p.grid
    blocks = -(-rows // br)
    with_dh = dh is not None
    sums = [s for s, on in (("dscale", spec.has_scale), ("dbias", spec.has_bias)) if on]

    def body(*refs):
        refs = list(refs)
        x_ref, dy_ref, stat_ref = refs.pop(0), refs.pop(0), refs.pop(0)
        scale_ref = refs.pop(0) if spec.has_scale else None
        dh_ref = refs.pop(0) if with_dh else None
        dx_ref = refs.pop(0)
        sum_refs = dict(zip(sums, refs, strict=True))
        slot, step = pl.program_id(0), pl.program_id(1)

        xf = x_ref[...].astype(jnp.float32)
        dyf = dy_ref[...].astype(jnp.float32)
        stat = stat_ref[...].reshape(br, 1)
        scale_f = None if scale_ref is None else scale_ref[...]
        dx = input_grad(spec, xf, dyf, stat, scale_f, _col((1, n)))
        if dh_ref is not None:
            dx = dx + dh_ref[...].astype(jnp.float32)
        dx_ref[...] = dx.astype(dx_ref.dtype)

        if sums:

            @pl.when(step == 0)
            def _():
                for ref in sum_refs.values():
                    ref[...] = jnp.zeros_like(ref)

            # Rows past the end (a partial last block, a repeated block) hold garbage.
            first = (slot * steps + step) * br
            valid = lax.broadcasted_iota(jnp.int32, (br, 1), 0) + first < rows

            def accumulate(ref, value):
                value = jnp.where(valid, value, 0.0)
                ref[...] += value.reshape(br // PARTIAL_ROWS, PARTIAL_ROWS, n).sum(0)

            if "dscale" in sum_refs:
                accumulate(sum_refs["dscale"], dyf * (xf * inv_rms(spec, stat)))
            if "dbias" in sum_refs:
                accumulate(sum_refs["dbias"], dyf)

    row_map = backward_row_map(steps, blocks)
    row_spec = pl.BlockSpec((br, n), row_map)
    stat_rows = jnp.pad(stat.astype(jnp.float32), (0, blocks * br - rows))
    operands = [x, dy, stat_rows.reshape(blocks, 1, br)]
    in_specs = [
        row_spec,
        row_spec,
        pl.BlockSpec((None, 1, br), lambda c, i: (row_map(c, i)[0], 0, 0)),
    ]
    if spec.has_scale:
        operands.append(scale.astype(jnp.float32).reshape(1, n))
        in_specs.append(pl.BlockSpec((1, n), lambda c, i: (0, 0)))
    if with_dh:
        operands.append(dh)
        in_specs.append(row_spec)
    partial = out_struct((PARTIAL_ROWS * slots, n), jnp.float32, x)
    out_shape = [out_struct((rows, n), dx_dtype, x)] + [partial] * len(sums)
    out_specs = [row_spec] + [pl.BlockSpec((PARTIAL_ROWS, n), lambda c, i: (c, 0))] * len(sums)
    specs = (in_specs, out_specs, out_shape)
    semantics = ("parallel", "arbitrary")
    outs = _pallas_call(body, p, specs, semantics, interpret, "backward")(*operands)
    partials = dict(zip(sums, outs[1:], strict=True))
    return outs[0], partials.get("dscale"), partials.get("dbias")
