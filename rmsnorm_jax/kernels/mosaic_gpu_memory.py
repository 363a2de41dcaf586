"""How the Mosaic GPU kernels (``mosaic_gpu.py``) move their data: the register layout of
a chunk and its views, loads and stores, and the persistent walk over blocks of rows
through shared memory, staged (the next block's TMA copies in flight while this one is
computed) or streamed (a row too wide for shared memory, loaded chunk by chunk per pass).
A chunk is ``(T, S)``: T rows of one split (row tiles) or T splits of one row (``split``
plans); ``mosaic_gpu_sizing.Plan`` says which.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from .mosaic_gpu_sizing import Plan

F32 = jnp.float32
# plgpu.load(ref, *, layout, optimized) since jax 0.11 (0.10 also took an index): typed
# loosely so that a type check against either passes.
_plgpu_load: Callable[..., Any] = plgpu.load


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
    fields = ("tiling", "warp_dims", "lane_dims", "vector_dim")
    return plgpu.Layout.TILED(*(getattr(tiled, name) for name in fields))


def chunk(ref, plan: Plan, row, c):
    """The (T, S) chunk c of a (rows, J, S) ref, at ``row``: T rows of split c (row
    tiles), or splits ``c*T ...`` of row ``row`` (split rows)."""
    if plan.split:
        return ref.at[row, pl.ds(c * plan.T, plan.T), :]
    return ref.at[pl.ds(row, plan.T), c, :]


def load(ref, plan: Plan, *, axis=None, optimized=True, raw=False):
    """A chunk (or, with ``axis``, its rows reduced along ``axis``) in float32 (``raw``:
    in its own dtype), ``optimized``: vector transfers free of bank conflicts."""
    layout = (
        _layout(plan.lanes, plan.v) if axis is None else _layout(plan.lanes, plan.v).reduce(axis)
    )
    value = _plgpu_load(ref, layout=layout, optimized=optimized)
    return value if raw else value.astype(F32)


def iota(plan: Plan, axis: int):
    return plgpu.broadcasted_iota(
        jnp.int32, (plan.T, plan.S), axis, layout=_layout(plan.lanes, plan.v)
    )


def columns(plan: Plan, c):
    """The feature index of each element of chunk c."""
    splits = c * plan.T + iota(plan, 0) if plan.split else c
    return splits * plan.S + iota(plan, 1)


def param(ref, plan: Plan, c):
    """Chunk c of a (J, S) parameter in float32, as a (T, S) chunk; None without one.

    Read from HBM (through L1) where needed, as plain vector loads: ``optimized`` GMEM
    transfers are not lowered by jax 0.11.2 and need whole 128-byte lines in 0.12."""
    if ref is None:
        return None
    if plan.split:
        return load(ref.at[pl.ds(c * plan.T, plan.T), :], plan, optimized=False)
    return broadcast(plan, load(ref.at[c], plan, axis=0, optimized=False), 0)


def zeros(plan: Plan):
    return plgpu.layout_cast(jnp.zeros((plan.T, plan.S), F32), _layout(plan.lanes, plan.v))


def row_total(plan: Plan, acc):
    """Per row sums of a chunk-shaped accumulator: (T,) for row tiles, a scalar for a
    split row (its chunks' rows are splits of the one row)."""
    return jnp.sum(jnp.sum(acc, axis=1), axis=0) if plan.split else jnp.sum(acc, axis=1)


def broadcast(plan: Plan, value, dim: int):
    """A (T,) or (S,) value as a (T, S) chunk, repeated along ``dim``."""
    wide = lax.broadcast_in_dim(value, (plan.T, plan.S), (1 - dim,))
    return plgpu.layout_cast(wide, _layout(plan.lanes, plan.v))


def spread(plan: Plan, per_row):
    """Per-row values (``row_total``'s shape) as a (T, S) chunk (scalars broadcast)."""
    return per_row if plan.split else broadcast(plan, per_row, 1)


def store(value, ring, q, dst) -> None:
    """Writes a chunk into slot q % 2 of a two-slot ring and stores it to ``dst`` by TMA.

    Every TMA store is its own group and the slot was last read two or more groups ago,
    so waiting until at most one group is reading keeps it free."""
    slot = ring.at[lax.rem(q, 2)]
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    slot[...] = value.astype(slot.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(slot, dst)


# ---------------------------------------------------------------- the persistent loops


def _staged(plan: Plan, rows: int, programs: int, sources, stage, bar, tile) -> None:
    """Walks row blocks ``pid, pid + programs, ...``: stages each block's rows of the
    ``sources`` (GMEM refs, rows first) into ``stage`` (SMEM, a slot axis first), the
    next block's copies issued before (two slots) or after (one) this block's work, and
    calls ``tile(i, block, t, chunk_refs)`` for each row tile t of block i of the walk;
    ``chunk_refs(pass_, c)`` gives the SMEM views of chunk c of every source."""
    pid = lax.axis_index("programs")
    steps = (plan.blocks(rows) - 1 - pid) // programs + 1

    def fetch(i, slot):
        block = pid + i * programs
        plgpu.commit_smem()  # the slot's reads before the TMA's writes (generic -> async)
        for src, dst in zip(sources, stage, strict=True):
            rows_ = dst.shape[1]  # the statistic's staging may be wider (whole 128 bytes)
            plgpu.copy_gmem_to_smem(
                src.at[pl.ds(block * plan.R, rows_)], dst.at[slot], bar.at[slot]
            )

    fetch(0, 0)

    def body(i, carry):
        slot = lax.rem(i, plan.slots)
        plgpu.barrier_wait(bar.at[slot])
        more = i + 1 < steps
        if plan.slots == 2:
            pl.when(more)(lambda: fetch(i + 1, 1 - slot))

        def each_tile(t, carry):
            views = [s.at[slot] for s in stage if len(s.shape) == 4]  # not the statistic
            tile(
                i,
                pid + i * programs,
                t,
                lambda _, c: [chunk(v, plan, t * plan.T, c) for v in views],
            )
            return carry

        lax.fori_loop(0, plan.tiles, each_tile, 0)
        if plan.slots == 1:
            pl.when(more)(lambda: fetch(i + 1, 0))
        return carry

    lax.fori_loop(0, steps, body, 0)


def _streamed(plan: Plan, rows: int, programs: int, sources, rings, bar, tile) -> None:
    """As :func:`_staged` for split rows that do not fit shared memory whole: each pass
    over a row loads its chunks again (the second time mostly from L2) through two-slot
    rings, the next chunk's copies in flight while one is computed."""
    pid = lax.axis_index("programs")
    steps = (plan.blocks(rows) - 1 - pid) // programs + 1
    loads = steps * 2 * plan.chunks  # two passes over each row

    def fetch(g):
        row = pid + g // (2 * plan.chunks) * programs
        slot = lax.rem(g, 2)
        plgpu.commit_smem()  # the slot's reads before the TMA's writes (generic -> async)
        for src, ring in zip(sources, rings, strict=True):
            plgpu.copy_gmem_to_smem(
                chunk(src, plan, row, lax.rem(g, plan.chunks)), ring.at[slot], bar.at[slot]
            )

    def chunk_refs(i, pass_, c):
        g = (2 * i + pass_) * plan.chunks + c
        slot = lax.rem(g, 2)
        plgpu.barrier_wait(bar.at[slot])
        pl.when(g + 1 < loads)(lambda: fetch(g + 1))
        return [ring.at[slot] for ring in rings]

    fetch(0)

    def body(i, carry):
        tile(i, pid + i * programs, 0, functools.partial(chunk_refs, i))
        return carry

    lax.fori_loop(0, steps, body, 0)


def walk(plan: Plan, rows, programs, sources, stage, bar, tile) -> None:
    (_streamed if plan.stream else _staged)(plan, rows, programs, sources, stage, bar, tile)


def stage_types(plan: Plan, dtypes, stat: bool = False):
    """The SMEM that the walk copies rows into, and its barrier."""
    if plan.stream:
        stage = [plgpu.SMEM((2, plan.T, plan.S), d) for d in dtypes]
    else:
        stage = [plgpu.SMEM((plan.slots, plan.R, plan.J, plan.S), d) for d in dtypes]
    if stat:  # whole 128-byte rows of statistics (TMA copies move multiples of 128 bytes)
        stage.append(plgpu.SMEM((plan.slots, -(-plan.R // 32) * 32), F32))
    slots = 2 if plan.stream else plan.slots
    return [stage, plgpu.Barrier(num_arrivals=len(stage), num_barriers=slots)]
