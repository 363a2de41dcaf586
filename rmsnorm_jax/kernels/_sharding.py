"""Row-local kernel calls under every kind of sharding, and under ``vmap``.

A Pallas call cannot be partitioned by XLA (on TPU it refuses: "Mosaic kernels cannot be
automatically partitioned"; on GPU it gathers the whole array onto every device). Every
kernel here is row-wise, so :func:`rowwise` runs it on each device's own rows, with the
features of a row gathered where they were split, and sums the per-device parameter
gradients across the mesh axes of the rows:

- explicit mesh axes (the sharding of ``x`` is known while tracing): ``jax.shard_map``;
- automatic axes (known only to the partitioner): ``custom_partitioning``, whose
  partition rule keeps the rows' sharding and replicates the features;
- inside a user's ``shard_map`` (the arrays are already local): the call itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._types import explicit_spec

# What each output of a row-wise call is: "rows" has x's shape, "stat" x's shape with a
# last dim of 1, "sum" is a parameter gradient of shape (n,), summed over all rows.
ROWS, STAT, SUM = "rows", "stat", "sum"

Local = Callable[[list, list], Sequence]


def rowwise(local: Local, rows: list, params: list, kinds: Sequence[str]) -> tuple:
    """``local(rows, params)`` on each device's rows; see the module docstring.

    ``rows``: arrays of x's shape (``rows[0]`` is x; None allowed after it);
    ``params``: arrays of shape ``(n,)`` or None; ``kinds``: one of ``ROWS``, ``STAT``,
    ``SUM`` per output of ``local``.
    """
    x = rows[0]
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        return tuple(local(rows, params))
    pspec = explicit_spec(jax.typeof(x))
    if pspec is not None:
        return _shard_mapped(local, rows, params, kinds, jax.typeof(x).sharding.mesh, pspec)
    return _custom_partitioned(local, rows, params, kinds)


def _row_pspec(pspec: tuple) -> tuple:
    return (*pspec[:-1], None)


def _row_axes(pspec: tuple) -> tuple[str, ...]:
    """The mesh axes that split the rows (every entry of the partition spec but the last)."""
    axes: list[str] = []
    for entry in pspec[:-1]:
        if entry is None:
            continue
        axes.extend((entry,) if isinstance(entry, str) else entry)
    return tuple(axes)


def _summed(outs, kinds, axes):
    if not axes:
        return tuple(outs)
    return tuple(lax.psum(o, axes) if k == SUM else o for o, k in zip(outs, kinds, strict=True))


def _flat(rows: list, params: list):
    """The non-None arrays, and how to put the lists back together."""
    arrays = [a for a in (*rows, *params) if a is not None]
    is_row = [True] * sum(a is not None for a in rows) + [False] * sum(
        a is not None for a in params
    )

    def rebuild(flat):
        it = iter(flat)
        return [None if a is None else next(it) for a in rows], [
            None if a is None else next(it) for a in params
        ]

    return arrays, is_row, rebuild


def _shard_mapped(local, rows, params, kinds, mesh, pspec):
    row_pspec = P(*_row_pspec(pspec))
    axes = _row_axes(pspec)
    arrays, is_row, rebuild = _flat(rows, params)
    arrays = [
        jax.sharding.reshard(a, row_pspec if r else P())
        for a, r in zip(arrays, is_row, strict=True)
    ]

    def body(*flat):
        return _summed(local(*rebuild(flat)), kinds, axes)

    outs = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(row_pspec if r else P() for r in is_row),
        out_specs=tuple(P() if k == SUM else row_pspec for k in kinds),
        check_vma=False,
    )(*arrays)
    if pspec[-1] is None:
        return outs
    # Features split explicitly: the kernels ran on whole rows; the row outputs go back
    # to x's own sharding, as the XLA path's do (a scan carry must keep its type).
    return tuple(
        jax.sharding.reshard(o, P(*pspec)) if k == ROWS else o
        for o, k in zip(outs, kinds, strict=True)
    )


def _custom_partitioned(local, rows, params, kinds):
    arrays, is_row, rebuild = _flat(rows, params)
    ndim = rows[0].ndim

    def call(*flat):
        return tuple(local(*rebuild(flat)))

    def row_pspec_of(arg_shapes):
        sharding = arg_shapes[0].sharding
        pspec = tuple(getattr(sharding, "spec", ()))
        return _row_pspec(pspec + (None,) * (ndim - len(pspec)))

    def out_shardings(mesh, pspec):
        return tuple(NamedSharding(mesh, P() if k == SUM else P(*pspec)) for k in kinds)

    def infer(mesh, arg_shapes, result_shape):
        return out_shardings(mesh, row_pspec_of(arg_shapes))

    def partition(mesh, arg_shapes, result_shape):
        pspec = row_pspec_of(arg_shapes)
        axes = _row_axes(pspec)

        def lower(*flat):
            return _summed(call(*flat), kinds, axes)

        arg_shardings = tuple(NamedSharding(mesh, P(*pspec) if r else P()) for r in is_row)
        return mesh, lower, out_shardings(mesh, pspec), arg_shardings

    operands = ", ".join("... n" if r else "n" for r in is_row)
    results = ", ".join({ROWS: "... n", STAT: "... o", SUM: "n"}[k] for k in kinds)
    partitioned = custom_partitioning(call)
    partitioned.def_partition(
        partition,
        infer_sharding_from_operands=infer,
        sharding_rule=f"{operands} -> {results}",
        need_replication_factors=("n",),
    )
    return partitioned(*arrays)
