"""Mosaic GPU kernels for Hopper and Blackwell: RMSNorm in one pass forward and one backward.

The contract is ``_contract.py``'s (``fits``, ``forward``, ``backward``) and the maths its
per-row helpers, as in the Pallas-Triton kernels (``triton.py``). The kernels are
``plgpu.kernel``s lowered with Mosaic GPU's lane semantics (explicit register layouts).

Schedule (``mosaic_gpu_sizing.plan``; nothing tuned on a GPU yet):

- A row is viewed as J splits of S <= 256 features, so that a block of R rows is one TMA
  copy ``(R, J, S)`` from HBM into shared memory. One warpgroup (128 threads) per
  kernel block; a persistent grid of blocks (as many as shared memory lets reside, at
  most 4 an SM) walks the row blocks ``p, p + P, ...``, the next block's TMA copies in
  flight while this one is computed where two staging slots fit.
- Rows up to 2048 features: blocks of about 8192 features of rows (R <= 256), computed
  in register chunks of T rows x S features; a warp owns whole rows (or 32 / lanes of
  them), so a row's sums are reduced in registers and across lanes, never across warps.
- Wider rows: one row per block (staged whole: up to 64 KiB of bfloat16 or 32 KiB of
  float32 rows and more, as shared memory allows), in chunks of T splits x S features;
  a row's sum crosses the 4 warps through shared memory once per pass.
- Each thread holds vectors of v features (16 bytes of float32, or of the widest
  operand), so shared-memory transfers are 8 or 16 bytes a thread.
- Two passes over the staged rows in registers: the mean square (forward) or
  ``sum_j gdy_j x_j`` (backward), then the outputs, written chunk by chunk into a
  two-slot shared-memory ring and stored by TMA (clipped at the last row and feature).
- Backward: the scale and bias gradients of a block's rows accumulate in float32 in
  shared memory (a row of partial sums per row of a chunk); each persistent block
  writes its rows once, at the end: ``(programs * rows_per_chunk, n)`` partial sums the
  caller sums (deterministic, no atomics).

``interpret=True`` runs the same kernel bodies on the CPU (``plgpu.InterpretGPUParams``;
jax >= 0.11.2).

Example (interpret mode; FACTS.md's first worked example)::

>>> import jax.numpy as jnp, numpy as np
>>> from rmsnorm_jax.kernels._contract import KernelSpec
>>> spec = KernelSpec(n=8, k=4, eps=0.0, inside=True, scale_offset=0.0,
...                   has_scale=False, has_bias=False, out_dtype=np.dtype("float32"))
>>> x = jnp.array([[1.0, 2, 3, 4, 0, 0, 0, 0], [-1, -2, -3, -4, 0, 0, 0, 0]])
>>> y, stat, h = forward(spec, x, None, None, interpret=True)  # doctest: +SKIP
>>> [round(float(v), 4) for v in y[0, :4]]  # doctest: +SKIP
[0.3651, 0.7303, 1.0954, 1.4606]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from .._rounding import added
from ._contract import KernelSpec, gain, inv_rms, normalized, out_struct, stat_from_ms
from .mosaic_gpu_sizing import Plan, fits, plan

__all__ = ["available", "backward", "fits", "forward", "plan"]

_F32 = jnp.float32
_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def available() -> bool:
    """Whether this jax runs these kernels in interpret mode on a CPU (jax >= 0.11.2)."""
    return hasattr(plgpu, "InterpretGPUParams") and hasattr(plgpu, "kernel")


# ---------------------------------------------------------------- layout and views


@functools.cache
def _layout(lanes: int, v: int):
    """Threads hold v consecutive features; ``lanes`` lanes across a chunk's features,
    the other ``32 / lanes`` lanes and the 4 warps across its rows."""
    rows = 32 // lanes
    tiling = fa.Tiling(((4 * rows, lanes * v), (rows, lanes * v), (1, v)))
    tiled = fa.TiledLayout(
        tiling, warp_dims=(-6, -5), lane_dims=(-4, -3), vector_dim=-1, _check_canonical=False
    ).canonicalize()
    return plgpu.Layout.TILED(
        tiled.tiling,
        warp_dims=tiled.warp_dims,
        lane_dims=tiled.lane_dims,
        vector_dim=tiled.vector_dim,
    )


def _chunk(ref, p: Plan, row, c):
    """The (T, S) chunk c of a (rows, J, S) ref, at ``row``: T rows of split c (row
    tiles), or splits ``c*T ...`` of row ``row`` (split rows)."""
    if p.split:
        return ref.at[row, pl.ds(c * p.T, p.T), :]
    return ref.at[pl.ds(row, p.T), c, :]


def _load(ref, p: Plan):
    return plgpu.load(ref, layout=_layout(p.lanes, p.v)).astype(_F32)


def _iota(p: Plan, axis: int):
    return plgpu.broadcasted_iota(jnp.int32, (p.T, p.S), axis, layout=_layout(p.lanes, p.v))


def _columns(p: Plan, c):
    """The feature index of each element of chunk c."""
    splits = c * p.T + _iota(p, 0) if p.split else c
    return splits * p.S + _iota(p, 1)


def _param(ref, p: Plan, c):
    """Chunk c of a (J, S) parameter in float32, as a (T, S) chunk; None without one."""
    if ref is None:
        return None
    if p.split:
        return _load(ref.at[pl.ds(c * p.T, p.T), :], p)
    # Narrow lanes read less than whole 128-byte lines: element by element.
    whole_lines = p.lanes * p.v * ref.dtype.itemsize % 128 == 0
    row = plgpu.load(ref.at[c], layout=_layout(p.lanes, p.v).reduce(0), optimized=whole_lines)
    row = row.astype(_F32)
    return plgpu.layout_cast(lax.broadcast_in_dim(row, (p.T, p.S), (1,)), _layout(p.lanes, p.v))


def _zeros(p: Plan):
    return plgpu.layout_cast(jnp.zeros((p.T, p.S), _F32), _layout(p.lanes, p.v))


def _row_total(p: Plan, acc):
    """Per row sums of a chunk-shaped accumulator: (T,) for row tiles, a scalar for a
    split row (its chunks' rows are splits of the one row)."""
    return jnp.sum(jnp.sum(acc, axis=1), axis=0) if p.split else jnp.sum(acc, axis=1)


def _spread(p: Plan, per_row):
    """Per-row values (``_row_total``'s shape) as a (T, S) chunk (scalars broadcast)."""
    if p.split:
        return per_row
    wide = lax.broadcast_in_dim(per_row, (p.T, p.S), (0,))
    return plgpu.layout_cast(wide, _layout(p.lanes, p.v))


def _store(value, ring, q, dst) -> None:
    """Writes a chunk into slot q % 2 of a two-slot ring and stores it to ``dst`` by TMA.

    Every TMA store is its own group and the slot was last read two or more groups ago,
    so waiting until at most one group is reading keeps it free."""
    slot = ring.at[lax.rem(q, 2)]
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    slot[...] = value.astype(slot.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(slot, dst)


# ---------------------------------------------------------------- the persistent loops


def _staged(p: Plan, rows: int, programs: int, sources, stage, bar, tile) -> None:
    """Walks row blocks ``pid, pid + programs, ...``: stages each block's rows of the
    ``sources`` (GMEM refs, rows first) into ``stage`` (SMEM, a slot axis first), the
    next block's copies issued before (two slots) or after (one) this block's work, and
    calls ``tile(i, block, t, chunk_refs)`` for each row tile t of block i of the walk;
    ``chunk_refs(pass_, c)`` gives the SMEM views of chunk c of every source."""
    pid = lax.axis_index("programs")
    steps = (p.blocks(rows) - 1 - pid) // programs + 1

    def fetch(i, slot):
        block = pid + i * programs
        for src, dst in zip(sources, stage):
            rows_ = dst.shape[1]  # the statistic's staging may be wider (whole 128 bytes)
            plgpu.copy_gmem_to_smem(src.at[pl.ds(block * p.R, rows_)], dst.at[slot], bar.at[slot])

    fetch(0, 0)

    def body(i, carry):
        slot = lax.rem(i, p.slots)
        plgpu.barrier_wait(bar.at[slot])
        more = i + 1 < steps
        if p.slots == 2:
            pl.when(more)(lambda: fetch(i + 1, 1 - slot))

        def each_tile(t, carry):
            views = [s.at[slot] for s in stage if len(s.shape) == 4]  # not the statistic
            tile(i, pid + i * programs, t, lambda _, c: [_chunk(v, p, t * p.T, c) for v in views])
            return carry

        lax.fori_loop(0, p.tiles, each_tile, 0)
        if p.slots == 1:
            pl.when(more)(lambda: fetch(i + 1, 0))
        return carry

    lax.fori_loop(0, steps, body, 0)


def _streamed(p: Plan, rows: int, programs: int, sources, rings, bar, tile) -> None:
    """As :func:`_staged` for split rows that do not fit shared memory whole: each pass
    over a row loads its chunks again (the second time mostly from L2) through two-slot
    rings, the next chunk's copies in flight while one is computed."""
    pid = lax.axis_index("programs")
    steps = (p.blocks(rows) - 1 - pid) // programs + 1
    loads = steps * 2 * p.chunks  # two passes over each row

    def fetch(g):
        row = pid + g // (2 * p.chunks) * programs
        slot = lax.rem(g, 2)
        for src, ring in zip(sources, rings):
            plgpu.copy_gmem_to_smem(_chunk(src, p, row, lax.rem(g, p.chunks)), ring.at[slot], bar.at[slot])

    def chunk_refs(i, pass_, c):
        g = (2 * i + pass_) * p.chunks + c
        slot = lax.rem(g, 2)
        plgpu.barrier_wait(bar.at[slot])
        pl.when(g + 1 < loads)(lambda: fetch(g + 1))
        return [ring.at[slot] for ring in rings]

    fetch(0)

    def body(i, carry):
        tile(i, pid + i * programs, 0, functools.partial(chunk_refs, i))
        return carry

    lax.fori_loop(0, steps, body, 0)


def _walk(p: Plan, rows, programs, sources, stage, bar, tile) -> None:
    (_streamed if p.stream else _staged)(p, rows, programs, sources, stage, bar, tile)


def _stage_types(p: Plan, dtypes, stat: bool = False):
    """The SMEM that the walk copies rows into, and its barrier."""
    if p.stream:
        stage = [plgpu.SMEM((2, p.T, p.S), d) for d in dtypes]
    else:
        stage = [plgpu.SMEM((p.slots, p.R, p.J, p.S), d) for d in dtypes]
    if stat:  # whole 128-byte rows of statistics (TMA copies move multiples of 128 bytes)
        stage.append(plgpu.SMEM((p.slots, -(-p.R // 32) * 32), _F32))
    slots = 2 if p.stream else p.slots
    return [stage, plgpu.Barrier(num_arrivals=len(stage), num_barriers=slots)]


# ---------------------------------------------------------------- forward


def _forward_kernel(*refs, spec: KernelSpec, p: Plan, rows, programs, has_res, interpret):
    refs = list(refs)
    x, res = refs.pop(0), refs.pop(0) if has_res else None
    scale = refs.pop(0) if spec.has_scale else None
    bias = refs.pop(0) if spec.has_bias else None
    y, stat = refs.pop(0), refs.pop(0)
    h = refs.pop(0) if has_res else None
    stage, bar, rings = refs.pop(0), refs.pop(0), refs.pop(0)
    stat_ring = None if p.split else refs.pop(0)

    def rows_in(views):
        """The normalized rows of a chunk: x, or h = x + residual rounded to h's dtype."""
        xv = plgpu.load(views[0], layout=_layout(p.lanes, p.v))
        if res is None:
            return xv
        rv = plgpu.load(views[1], layout=_layout(p.lanes, p.v))
        return added(xv, rv, h.dtype, keep=interpret)

    def tile(i, block, t, chunk_refs):
        row = block * p.R + t * p.T
        q0 = (i * p.tiles + t) * p.chunks  # this tile's first chunk in the program's walk

        def square(c, acc):
            hv = rows_in(chunk_refs(0, c))
            if h is not None:
                _store(hv, rings[1], q0 + c, _chunk(h, p, row, c))
            hf = hv.astype(_F32)
            sq = hf * hf if spec.k == spec.n else jnp.where(_columns(p, c) < spec.k, hf * hf, 0.0)
            return acc + sq

        ms = _row_total(p, lax.fori_loop(0, p.chunks, square, _zeros(p))) * (1.0 / spec.k)
        st = stat_from_ms(spec, ms)
        if p.split:
            stat[block] = st
        else:
            _store(st, stat_ring, i * p.tiles + t, stat.at[pl.ds(row, p.T)])
        spread = _spread(p, st)

        def write(c, carry):
            hf = rows_in(chunk_refs(1, c)).astype(_F32)
            out = normalized(spec, hf, spread, _param(scale, p, c), _param(bias, p, c))
            _store(out, rings[0], q0 + c, _chunk(y, p, row, c))
            return carry

        lax.fori_loop(0, p.chunks, write, 0)

    _walk(p, rows, programs, [x] if res is None else [x, res], stage, bar, tile)
    plgpu.wait_smem_to_gmem(0)


def _forward_scratch(p: Plan, staged, y_dtype, h_dtype):
    rings = [plgpu.SMEM((2, p.T, p.S), y_dtype)]
    if h_dtype is not None:
        rings.append(plgpu.SMEM((2, p.T, p.S), h_dtype))
    scratch = [*_stage_types(p, staged), rings]
    if not p.split:
        scratch.append(plgpu.SMEM((2, p.T), _F32))
    return scratch


# ---------------------------------------------------------------- backward


def _backward_kernel(*refs, spec: KernelSpec, p: Plan, rows, programs, has_dh):
    refs = list(refs)
    x, dy, stat = refs.pop(0), refs.pop(0), refs.pop(0)
    scale = refs.pop(0) if spec.has_scale else None
    dh = refs.pop(0) if has_dh else None
    dx = refs.pop(0)
    partials = [refs.pop(0) for present in (spec.has_scale, spec.has_bias) if present]
    stage, bar, ring, sums = refs
    for acc in sums:
        acc[...] = jnp.zeros(acc.shape, _F32)

    def tile(i, block, t, chunk_refs):
        row = block * p.R + t * p.T
        if p.split:
            st = stat[block]
        else:
            st = plgpu.load(
                stage[-1].at[lax.rem(i, p.slots), pl.ds(t * p.T, p.T)],
                layout=_layout(p.lanes, p.v).reduce(1),
            )
        r = inv_rms(spec, st)

        def dot(c, acc):
            views = chunk_refs(0, c)
            return acc + _load(views[1], p) * gain(spec, _param(scale, p, c)) * _load(views[0], p)

        # input_grad's terms (_contract.py), its row sum taken over the row's chunks.
        mean_term = _row_total(p, lax.fori_loop(0, p.chunks, dot, _zeros(p)))
        mean_term = mean_term * (r * (1.0 / spec.k))
        if spec.inside:
            alpha = r
        else:
            alpha = jnp.where(st > 0, 1.0 / jnp.where(st > 0, st, 1.0), 0.0)
        coef, r_wide = _spread(p, mean_term * alpha * r), _spread(p, r)
        valid = None if p.split else row + _iota(p, 0) < rows

        def write(c, carry):
            views = chunk_refs(1, c)
            xv, dyv = _load(views[0], p), _load(views[1], p)
            correction = xv * coef
            if spec.k < spec.n:
                correction = jnp.where(_columns(p, c) < spec.k, correction, 0.0)
            d = r_wide * (dyv * gain(spec, _param(scale, p, c))) - correction
            if has_dh:
                d = d + _load(views[2], p)
            _store(d, ring, (i * p.tiles + t) * p.chunks + c, _chunk(dx, p, row, c))
            terms = [dyv * (xv * r_wide)] if spec.has_scale else []
            terms += [dyv] if spec.has_bias else []
            for acc, term in zip(sums, terms):
                view = _chunk(acc, p, 0, c)
                if valid is not None:  # rows past the end: their statistic may be inf
                    term = jnp.where(valid, term, 0.0)
                view[...] = _load(view, p) + term
            return carry

        lax.fori_loop(0, p.chunks, write, 0)

    sources = [x, dy] + ([dh] if has_dh else []) + ([] if p.split else [stat])
    _walk(p, rows, programs, sources, stage, bar, tile)
    plgpu.commit_smem()
    pid = lax.axis_index("programs")
    for acc, out in zip(sums, partials):
        plgpu.copy_smem_to_gmem(acc, out.at[pl.ds(pid * p.acc_rows, p.acc_rows)])
    plgpu.wait_smem_to_gmem(0)


def _backward_scratch(p: Plan, spec: KernelSpec, staged, dx_dtype):
    sums = [
        plgpu.SMEM((p.acc_rows, p.J, p.S), _F32)
        for present in (spec.has_scale, spec.has_bias)
        if present
    ]
    stage = _stage_types(p, staged, stat=not p.split)
    return [*stage, plgpu.SMEM((2, p.T, p.S), dx_dtype), sums]


# ---------------------------------------------------------------- argument checks


def _check_rows(name: str, a, spec: KernelSpec, rows: int | None = None) -> None:
    if a.ndim != 2 or a.shape[1] != spec.n or (rows is not None and a.shape[0] != rows):
        want = f"({'rows' if rows is None else rows}, {spec.n})"
        raise ValueError(
            f"{name} must have shape {want} (rows of spec.n = {spec.n} features), got "
            f"{a.shape}; reshape it to (-1, {spec.n}) first."
        )
    _check_dtype(name, a.dtype)


def _check_dtype(name: str, dtype) -> np.dtype:
    if dtype is None or np.dtype(dtype) not in _DTYPES:
        raise TypeError(
            f"{name} must be float32, bfloat16 or float16 for the Mosaic GPU kernels, got "
            f"{dtype} (use implementation='xla' for other dtypes)."
        )
    return np.dtype(dtype)


def _check_param(name: str, a, present: bool, spec: KernelSpec) -> None:
    flag = f"spec.has_{name}"
    if present and a is None:
        raise ValueError(f"{name} is None but {flag} is True; pass the {name} or fix the spec.")
    if not present and a is not None:
        raise ValueError(f"{name} was given but {flag} is False; pass None or fix the spec.")
    if a is not None and (a.shape != (spec.n,) or np.dtype(a.dtype) not in _DTYPES):
        raise ValueError(
            f"{name} must have shape ({spec.n},) and dtype float32, bfloat16 or float16, "
            f"got {a.shape} {a.dtype}; reshape or cast it."
        )


def _plan_or_raise(spec, rows, x_dtype, kind, **dtypes) -> Plan:
    found = plan(spec, rows, x_dtype, kind, **dtypes)
    if found is None:
        raise ValueError(
            f"the Mosaic GPU {kind} kernel does not take {rows} rows of {spec.n} features "
            f"({np.dtype(x_dtype)}, {dtypes}): check fits(spec, rows, x.dtype, kind={kind!r}, "
            f"...) first and use another implementation where it is False."
        )
    return found


def _call(body, name, p: Plan, programs, out_type, scratch, interpret):
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
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=name,
    )


def _sms() -> int:
    from .triton_sizing import multiprocessors  # the GPU being compiled for, or an H100

    return multiprocessors()


# ---------------------------------------------------------------- the calls


def forward(spec: KernelSpec, x, scale, bias, residual=None, *, h_dtype=None, interpret=False):
    """One pass: ``(y, stat, h)`` of rows ``x`` (``_contract.py``'s contract).

    Arguments:
      spec: the static description of the call (n, k, eps, placement, offset, dtypes).
      x: (rows, n) float32, bfloat16 or float16.
      scale, bias: (n,) in any of those dtypes, or None (as ``spec`` says).
      residual: (rows, n) or None. Given, ``h = x.astype(h_dtype) + residual.astype(h_dtype)``
        is written and normalized (``add_rms_norm``).
      h_dtype: dtype of h; required with ``residual``.
      interpret: run on the CPU in Mosaic GPU interpret mode (tests).

    Returns:
      y (rows, n) in ``spec.out_dtype``; stat (rows,) float32, rsqrt(ms + eps) for
      "inside" or sqrt(ms) for "outside"; h (rows, n) in ``h_dtype``, or None.
    """
    _check_rows("x", x, spec)
    rows = x.shape[0]
    if residual is not None:
        _check_rows("residual", residual, spec, rows)
        h_dtype = _check_dtype("h_dtype", h_dtype)
    _check_param("scale", scale, spec.has_scale, spec)
    _check_param("bias", bias, spec.has_bias, spec)
    y_dtype = _check_dtype("spec.out_dtype", spec.out_dtype)
    res_dtype = None if residual is None else residual.dtype
    p = _plan_or_raise(spec, rows, x.dtype, "forward", residual_dtype=res_dtype, h_dtype=h_dtype)
    programs = p.programs(rows, _sms())
    shape3 = (rows, p.J, p.S)
    out_type = [out_struct(shape3, y_dtype, x), out_struct((rows,), _F32, x)]
    if residual is not None:
        out_type.append(out_struct(shape3, h_dtype, x))
    body = functools.partial(
        _forward_kernel,
        spec=spec,
        p=p,
        rows=rows,
        programs=programs,
        has_res=residual is not None,
        interpret=interpret,
    )
    staged = [a.dtype for a in (x, residual) if a is not None]
    scratch = _forward_scratch(p, staged, y_dtype, None if residual is None else h_dtype)
    kernel = _call(body, "rms_norm_forward", p, programs, out_type, scratch, interpret)
    rows3 = [a.reshape(shape3) for a in (x, residual) if a is not None]
    params = [a.reshape(p.J, p.S) for a in (scale, bias) if a is not None]
    y, stat, *h = kernel(*rows3, *params)
    return y.reshape(rows, spec.n), stat, (h[0].reshape(rows, spec.n) if h else None)


def backward(spec: KernelSpec, x, dy, stat, scale, dh=None, *, dx_dtype, interpret=False):
    """One pass: ``(dx, dscale_partials, dbias_partials)`` (``_contract.py``'s contract).

    ``dx = r * gdy - [col < k] * x * r * alpha * (1/k) * sum_j gdy_j x_j r`` with
    ``gdy = (scale + offset) * dy`` (``_contract.input_grad``), plus ``dh`` when given.

    Arguments:
      spec: the static description of the call.
      x: (rows, n), the normalized rows (h for ``add_rms_norm``).
      dy: (rows, n), the cotangent of y. stat: (rows,) float32, the forward's statistic.
      scale: (n,) or None. dh: (rows, n) or None, added to dx.
      dx_dtype: dtype of dx (float32, bfloat16 or float16).
      interpret: run on the CPU in Mosaic GPU interpret mode (tests).

    Returns:
      dx (rows, n) in ``dx_dtype``; dscale_partials and dbias_partials (P, n) float32,
      sums of dy * xhat and of dy over disjoint sets of rows (None where ``spec`` has no
      scale / bias); their sum over axis 0 is the gradient.
    """
    _check_rows("x", x, spec)
    rows = x.shape[0]
    _check_rows("dy", dy, spec, rows)
    if dh is not None:
        _check_rows("dh", dh, spec, rows)
    if stat.shape != (rows,):
        raise ValueError(
            f"stat must have shape ({rows},) (one float32 per row), got {stat.shape}; "
            f"pass the forward's stat reshaped to ({rows},)."
        )
    _check_param("scale", scale, spec.has_scale, spec)
    dx_dtype = _check_dtype("dx_dtype", dx_dtype)
    dh_dtype = None if dh is None else dh.dtype
    p = _plan_or_raise(spec, rows, x.dtype, "backward", residual_dtype=dh_dtype, dx_dtype=dx_dtype)
    programs = p.programs(rows, _sms())
    shape3 = (rows, p.J, p.S)
    partials = out_struct((programs * p.acc_rows, p.J, p.S), _F32, x)
    out_type = [out_struct(shape3, dx_dtype, x)]
    out_type += [partials] * (int(spec.has_scale) + int(spec.has_bias))
    body = functools.partial(
        _backward_kernel, spec=spec, p=p, rows=rows, programs=programs, has_dh=dh is not None
    )
    staged = [a.dtype for a in (x, dy, dh) if a is not None]
    scratch = _backward_scratch(p, spec, staged, dx_dtype)
    kernel = _call(body, "rms_norm_backward", p, programs, out_type, scratch, interpret)
    args = [x.reshape(shape3), dy.reshape(shape3), stat.astype(_F32)]
    args += [scale.reshape(p.J, p.S)] if scale is not None else []
    args += [dh.reshape(shape3)] if dh is not None else []
    dx, *sums = kernel(*args)
    sums = [s.reshape(-1, spec.n) for s in sums]
    dscale = sums.pop(0) if spec.has_scale else None
    dbias = sums.pop(0) if spec.has_bias else None
    return dx.reshape(rows, spec.n), dscale, dbias
