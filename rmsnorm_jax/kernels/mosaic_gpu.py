"""Mosaic GPU kernels (Hopper, Blackwell): RMSNorm in one pass forward and one backward.

The contract is ``_contract.py``'s (``Backend``) and the maths its
per-row helpers, as in the Pallas-Triton kernels (``triton.py``). Each kernel is one
``plgpu.kernel`` lowered with Mosaic GPU's lane semantics (explicit register layouts) of
one warpgroup (128 threads) per block; how a chunk is laid out, loaded and stored, and
how the persistent grid walks the rows, is ``mosaic_gpu_memory.py``. The schedule
(``mosaic_gpu_sizing.plan``, whose ``Sizing`` says why each choice is made; none is tuned
on a GPU yet):

- A row is J splits of S <= 256 features, so that R rows are one TMA copy ``(R, J, S)``
  (a TMA box holds at most 256 elements an axis). A persistent grid (as many blocks as
  shared memory lets reside, at most 4 an SM) walks the row blocks ``i, i + P, ...``;
  with two staging slots the next block's copies fly while this one is computed.
- Up to 2048 features, row tiles: R rows (about 8192 features of rows) a block, in
  register chunks of T rows x S features. A warp owns whole rows, so a row's sums are
  reduced in registers and across lanes only.
- Wider rows: one row a block, in chunks of T splits x S features; a row's sum crosses
  the 4 warps once per pass (through shared memory). A row staged whole where it fits
  shared memory, else streamed: each pass loads its chunks again (the second time
  mostly from L2; dh, where given, too) through two-slot rings.
- Threads hold vectors of v features: 16 bytes of the widest operand (float32 wherever a
  parameter or a partial sum is), so shared-memory transfers are 8 or 16 bytes.
- Two passes over the rows: the mean square (forward) or ``sum_j gdy_j x_j``
  (backward), then the outputs, chunk by chunk through two-slot shared-memory rings
  that TMA stores (clipped at the last row).
- Backward: the scale and bias gradients accumulate in float32 in shared memory, one
  row per row of a chunk (row tiles) or one (wide rows); each persistent block stores
  its rows once at the end: ``(programs * rows, n)`` partial sums that the caller sums
  (a fixed order, no atomics).

``interpret=True`` (or a ``plgpu.InterpretGPUParams``, e.g. with ``detect_races=True``)
runs the same kernels on the CPU (jax >= 0.11.2): ``tests/kernels/test_mosaic_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .._rounding import added
from ._contract import (
    KernelSpec,
    check_backward,
    check_dtype,
    check_forward,
    gain,
    inv_rms,
    normalized,
    out_struct,
    stat_from_ms,
)
from .mosaic_gpu_memory import (
    F32,
    chunk,
    columns,
    iota,
    load,
    param,
    row_total,
    spread,
    stage_types,
    store,
    walk,
    zeros,
)
from .mosaic_gpu_sizing import SIZING, Plan, Sizing, fits, grid_size, plan_or_raise

__all__ = [
    "LABEL",
    "NAME",
    "PLATFORM",
    "available",
    "backward",
    "deprecated",
    "fits",
    "forward",
    "unusable",
]

NAME = "mosaic_gpu"
LABEL = "Mosaic GPU"
PLATFORM = "cuda"
_KERNELS = "the Mosaic GPU kernels"


def available() -> bool:
    """Whether this jax has the ``plgpu.kernel`` API these kernels are written in, and
    runs them in interpret mode on a CPU (jax >= 0.11.2)."""
    return hasattr(plgpu, "InterpretGPUParams") and hasattr(plgpu, "kernel")


def unusable(target) -> str | None:
    """Why this jax or the device ``target`` (a ``_device.Target``) cannot run these
    kernels: a jax before 0.11.2, or a GPU known to be neither Hopper nor Blackwell
    (compute capability 9.x or 10.x). A GPU not known (a deviceless compile without a
    mesh) is taken for one that runs them."""
    if not available():
        return f"jax {jax.__version__} has no Mosaic GPU plgpu.kernel (jax >= 0.11.2 has)"
    capability = target.capability
    if target.platform == "cuda" and capability is not None and capability[0] not in (9, 10):
        return (
            f"the Mosaic GPU kernels need Hopper or Blackwell (compute capability 9.x or "
            f"10.x), not {target.kind} ({capability[0]}.{capability[1]})"
        )
    return None


def deprecated(version: str) -> str | None:
    """None: Mosaic GPU is the Pallas GPU backend jax develops."""
    return None


# ---------------------------------------------------------------- forward


def _forward_kernel(*kernel_refs, spec: KernelSpec, plan: Plan, rows, programs, has_res, interpret):
    refs = list(kernel_refs)
    x, res = refs.pop(0), refs.pop(0) if has_res else None
    scale = refs.pop(0) if spec.has_scale else None
    bias = refs.pop(0) if spec.has_bias else None
    y, stat = refs.pop(0), refs.pop(0)
    h = refs.pop(0) if has_res else None
    stage, bar, rings = refs.pop(0), refs.pop(0), refs.pop(0)
    stat_ring = None if plan.split else refs.pop(0)

    def rows_in(views):
        """The normalized rows of a chunk: x, or h = x + residual rounded to h's dtype."""
        xv = load(views[0], plan, raw=True)
        if res is None:
            return xv
        return added(xv, load(views[1], plan, raw=True), h.dtype, keep=bool(interpret))

    def tile(i, block, t, chunk_refs):
        row = block * plan.R + t * plan.T
        q0 = (i * plan.tiles + t) * plan.chunks  # this tile's first chunk in the program's walk

        def square(c, acc):
            hv = rows_in(chunk_refs(0, c))
            if h is not None:
                store(hv, rings[1], q0 + c, chunk(h, plan, row, c))
            hf = hv.astype(F32)
            sq = hf * hf if spec.k == spec.n else jnp.where(columns(plan, c) < spec.k, hf * hf, 0.0)
            return acc + sq

        ms = row_total(plan, lax.fori_loop(0, plan.chunks, square, zeros(plan))) * (1.0 / spec.k)
        st = stat_from_ms(spec, ms)
        if plan.split:
            stat[block] = st
        else:
            store(st, stat_ring, i * plan.tiles + t, stat.at[pl.ds(row, plan.T)])
        st_chunk = spread(plan, st)

        def write(c, carry):
            hf = rows_in(chunk_refs(1, c)).astype(F32)
            out = normalized(spec, hf, st_chunk, param(scale, plan, c), param(bias, plan, c))
            store(out, rings[0], q0 + c, chunk(y, plan, row, c))
            return carry

        lax.fori_loop(0, plan.chunks, write, 0)

    walk(plan, rows, programs, [x] if res is None else [x, res], stage, bar, tile)
    plgpu.wait_smem_to_gmem(0)


def _forward_scratch(plan: Plan, staged, y_dtype, h_dtype):
    rings = [plgpu.SMEM((2, plan.T, plan.S), y_dtype)]
    if h_dtype is not None:
        rings.append(plgpu.SMEM((2, plan.T, plan.S), h_dtype))
    scratch = [*stage_types(plan, staged), rings]
    if not plan.split:
        scratch.append(plgpu.SMEM((2, plan.T), F32))
    return scratch


# ---------------------------------------------------------------- backward


def _backward_kernel(*kernel_refs, spec: KernelSpec, plan: Plan, rows, programs, has_dh):
    refs = list(kernel_refs)
    x, dy, stat = refs.pop(0), refs.pop(0), refs.pop(0)
    scale = refs.pop(0) if spec.has_scale else None
    dh = refs.pop(0) if has_dh else None
    dx = refs.pop(0)
    partials = [refs.pop(0) for present in (spec.has_scale, spec.has_bias) if present]
    stage, bar, ring, sums = refs
    for acc in sums:
        acc[...] = jnp.zeros(acc.shape, F32)

    def tile(i, block, t, chunk_refs):
        row = block * plan.R + t * plan.T
        if plan.split:
            st = stat[block]
        else:
            st = load(stage[-1].at[lax.rem(i, plan.slots), pl.ds(t * plan.T, plan.T)], plan, axis=1)
        r = inv_rms(spec, st)

        def dot(c, acc):
            views = chunk_refs(0, c)
            return acc + load(views[1], plan) * gain(spec, param(scale, plan, c)) * load(
                views[0], plan
            )

        # input_grad's terms (_contract.py), its row sum taken over the row's chunks.
        mean_term = row_total(plan, lax.fori_loop(0, plan.chunks, dot, zeros(plan)))
        mean_term = mean_term * (r * (1.0 / spec.k))
        if spec.inside:
            alpha = r
        else:
            alpha = jnp.where(st > 0, 1.0 / jnp.where(st > 0, st, 1.0), 0.0)
        coef, r_wide = spread(plan, mean_term * alpha * r), spread(plan, r)
        valid = None if plan.split else row + iota(plan, 0) < rows

        def write(c, carry):
            views = chunk_refs(1, c)
            xv, dyv = load(views[0], plan), load(views[1], plan)
            correction = xv * coef
            if spec.k < spec.n:
                correction = jnp.where(columns(plan, c) < spec.k, correction, 0.0)
            d = r_wide * (dyv * gain(spec, param(scale, plan, c))) - correction
            if has_dh:
                d = d + load(views[2], plan)
            store(d, ring, (i * plan.tiles + t) * plan.chunks + c, chunk(dx, plan, row, c))
            terms = [dyv * (xv * r_wide)] if spec.has_scale else []
            terms += [dyv] if spec.has_bias else []
            for acc, term in zip(sums, terms, strict=True):
                view = chunk(acc, plan, 0, c)
                if valid is not None:  # rows past the end: their statistic may be inf
                    term = jnp.where(valid, term, 0.0)
                view[...] = load(view, plan) + term
            return carry

        lax.fori_loop(0, plan.chunks, write, 0)

    sources = [x, dy] + ([dh] if has_dh else []) + ([] if plan.split else [stat])
    walk(plan, rows, programs, sources, stage, bar, tile)
    plgpu.commit_smem()
    pid = lax.axis_index("programs")
    for acc, out in zip(sums, partials, strict=True):
        plgpu.copy_smem_to_gmem(acc, out.at[pl.ds(pid * plan.acc_rows, plan.acc_rows)])
    plgpu.wait_smem_to_gmem(0)


def _backward_scratch(plan: Plan, spec: KernelSpec, staged, dx_dtype):
    sums = [
        plgpu.SMEM((plan.acc_rows, plan.J, plan.S), F32)
        for present in (spec.has_scale, spec.has_bias)
        if present
    ]
    stage = stage_types(plan, staged, stat=not plan.split)
    return [*stage, plgpu.SMEM((2, plan.T, plan.S), dx_dtype), sums]


def _call(body, name, programs, out_type, scratch, interpret):
    if interpret and not available():
        raise RuntimeError(
            f"interpret=True needs Mosaic GPU's interpret mode (jax >= 0.11.2); this is jax "
            f"{jax.__version__}. Upgrade jax, or run on a Hopper or Blackwell GPU."
        )
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=(programs,),
        grid_names=("programs",),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=(plgpu.InterpretGPUParams() if interpret is True else interpret) or None,
        kernel_name=name,
    )


# ---------------------------------------------------------------- the calls


def forward(
    spec: KernelSpec,
    x,
    scale,
    bias,
    residual=None,
    *,
    h_dtype=None,
    interpret=False,
    programs=None,
    sizing: Sizing = SIZING,
):
    """One pass: ``(y, stat, h)`` of rows ``x``, as ``_contract.py`` specifies.

    ``programs`` and ``sizing`` (tuning, tests) override the persistent grid's size
    (``Plan.programs``) and the sizing choices (``mosaic_gpu_sizing.Sizing``);
    ``interpret`` (True or ``plgpu.InterpretGPUParams``) runs on the CPU. y (rows, n)
    is in ``spec.out_dtype``, stat (rows,) float32, h (with ``residual``) in ``h_dtype``.
    """
    rows, h_dtype, y_dtype = check_forward(spec, x, scale, bias, residual, h_dtype, _KERNELS)
    res_dtype = None if residual is None else residual.dtype
    plan = plan_or_raise(
        spec, rows, x.dtype, "forward", sizing, residual_dtype=res_dtype, h_dtype=h_dtype
    )
    programs = grid_size(plan, rows, programs)
    shape3 = (rows, plan.J, plan.S)
    out_type = [out_struct(shape3, y_dtype, x), out_struct((rows,), F32, x)]
    if residual is not None:
        out_type.append(out_struct(shape3, h_dtype, x))
    body = functools.partial(
        _forward_kernel,
        spec=spec,
        plan=plan,
        rows=rows,
        programs=programs,
        has_res=residual is not None,
        interpret=interpret,
    )
    staged = [a.dtype for a in (x, residual) if a is not None]
    scratch = _forward_scratch(plan, staged, y_dtype, None if residual is None else h_dtype)
    kernel = _call(body, "rms_norm_forward", programs, out_type, scratch, interpret)
    rows3 = [a.reshape(shape3) for a in (x, residual) if a is not None]
    params = [a.reshape(plan.J, plan.S) for a in (scale, bias) if a is not None]
    y, stat, *h = kernel(*rows3, *params)
    return y.reshape(rows, spec.n), stat, (h[0].reshape(rows, spec.n) if h else None)


def backward(
    spec: KernelSpec,
    x,
    dy,
    stat,
    scale,
    dh=None,
    *,
    dx_dtype,
    interpret=False,
    programs=None,
    sizing: Sizing = SIZING,
):
    """One pass: ``(dx, dscale_partials, dbias_partials)``, as ``_contract.py`` specifies.

    ``dx = r * gdy - [col < k] * x * r * alpha * (1/k) * sum_j gdy_j x_j r`` with
    ``gdy = (scale + offset) * dy`` (``_contract.input_grad``), plus ``dh`` when given;
    the partial sums are (P, n) float32, summed over disjoint sets of rows. ``programs``,
    ``sizing`` and ``interpret`` as in :func:`forward`.
    """
    rows, dx_dtype = check_backward(spec, x, dy, stat, scale, dh, dx_dtype, _KERNELS)
    dh_dtype = None if dh is None else dh.dtype
    # The plan sizes dy by spec.out_dtype (dy is y's cotangent): here by dy's own dtype.
    dy_spec = dataclasses.replace(spec, out_dtype=check_dtype("dy", dy.dtype, _KERNELS))
    plan = plan_or_raise(
        dy_spec, rows, x.dtype, "backward", sizing, residual_dtype=dh_dtype, dx_dtype=dx_dtype
    )
    programs = grid_size(plan, rows, programs)
    shape3 = (rows, plan.J, plan.S)
    partials = out_struct((programs * plan.acc_rows, plan.J, plan.S), F32, x)
    out_type = [out_struct(shape3, dx_dtype, x)]
    out_type += [partials] * (int(spec.has_scale) + int(spec.has_bias))
    body = functools.partial(
        _backward_kernel, spec=spec, plan=plan, rows=rows, programs=programs, has_dh=dh is not None
    )
    staged = [a.dtype for a in (x, dy, dh) if a is not None]
    scratch = _backward_scratch(plan, spec, staged, dx_dtype)
    kernel = _call(body, "rms_norm_backward", programs, out_type, scratch, interpret)
    args = [x.reshape(shape3), dy.reshape(shape3), stat.astype(F32)]
    args += [scale.reshape(plan.J, plan.S)] if scale is not None else []
    args += [dh.reshape(shape3)] if dh is not None else []
    dx, *sums = kernel(*args)
    sums = [s.reshape(-1, spec.n) for s in sums]
    dscale = sums.pop(0) if spec.has_scale else None
    dbias = sums.pop(0) if spec.has_bias else None
    return dx.reshape(rows, spec.n), dscale, dbias
