"""How the Pallas Mosaic TPU kernels cut a call into blocks, per TPU generation, and the
HBM bytes each kernel moves (:func:`plan`); :func:`fits` says whether a row fits at all.

The kernels ask for a scoped VMEM limit of 3/4 of a TensorCore's VMEM (at most 64 MiB) and
give their blocks 3/4 of that. A block row costs, per padded feature (n rounded up to
128), twice the bytes of every row operand (double buffering) plus 4 bytes per float32
temporary of the body. The rows of a block are the most that fit, rounded to the sublane
tiling (or to 128 rows where the rows allow it: a lane-dense statistic), at most
``_MAX_BLOCK_ROWS`` and about ``1 / _MIN_STEPS`` of the rows (the pipeline overlaps one
block's copies with another's work). ``docs/kernels.md`` gives the resulting sizes.

The generation is read from the mesh being traced for or the default device; where
neither is a TPU (a deviceless compile without a mesh, interpret mode) the sizes are
those of the smallest VMEM (v4), which fit every generation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ._contract import KernelSpec, planned_fits
from ._device import target

__all__ = ["GENERATIONS", "Generation", "Operand", "Plan", "fits", "generation", "plan"]

_MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Generation:
    """What the block sizing needs to know of one TPU generation.

    Attributes:
      name: ``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"`` or ``"tpu7x"``.
      vmem_bytes: VMEM of one TensorCore (``pltpu.get_tpu_info_for_chip``).
      vmem_limit_bytes: the scoped VMEM the kernels ask for: 3/4 of it, at most 64 MiB.
      block_budget_bytes: what the blocks and their float32 temporaries may take:
        3/4 of the limit.
    """

    name: str
    vmem_bytes: int

    @property
    def vmem_limit_bytes(self) -> int:
        return min(self.vmem_bytes * 3 // 4, 64 * _MiB)

    @property
    def block_budget_bytes(self) -> int:
        return self.vmem_limit_bytes * 3 // 4


# VMEM per TensorCore, as jax's `pltpu.get_tpu_info_for_chip` gives it (jax 0.10.2).
GENERATIONS = {
    "v4": Generation("v4", 16 * _MiB),
    "v5e": Generation("v5e", 128 * _MiB),
    "v5p": Generation("v5p", 64 * _MiB),
    "v6e": Generation("v6e", 128 * _MiB),
    "tpu7x": Generation("tpu7x", 64 * _MiB),
}
# Used where the generation is unknown while tracing: the smallest VMEM fits them all.
_ANY = GENERATIONS["v4"]

_DEVICE_KINDS = {
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU7x": "tpu7x",
}

# Float32 temporaries of a block that the bodies hold at once, per element, with one to
# spare (docs/kernels.md says how they were calibrated); the tests compile both kernels
# at the widest rows that fit, on every generation.
_FWD_TEMPS = 3
_BWD_TEMPS = 6
_MAX_BLOCK_ROWS = 1024
_MIN_STEPS = 8
LANES = 128
PARTIAL_ROWS = 8  # the sublanes of one float32 vreg: the partial sums' rows per slot


def generation(name: str | None = None) -> Generation:
    """The :class:`Generation` called ``name``, or the one being compiled for.

    Without a name: the device kind of the abstract mesh being traced for (inside
    ``shard_map`` or ``jax.set_mesh``), else of the default device; where that is no
    TPU, the generation with the least VMEM (its block sizes fit every generation).
    """
    if name is not None:
        if name not in GENERATIONS:
            raise ValueError(
                f"unknown TPU generation {name!r}; give one of {', '.join(GENERATIONS)}."
            )
        return GENERATIONS[name]
    device = target()
    kind = device.kind if device.platform == "tpu" else ""
    return GENERATIONS.get(_DEVICE_KINDS.get(kind, ""), _ANY)


def _sublanes(dtype) -> int:
    """Rows of one (sublanes, 128) VMEM tile: 8 for 32-bit types, 16 for 16-bit ones."""
    return 8 * (4 // min(np.dtype(dtype).itemsize, 4))


def _padded(n: int) -> int:
    return -(-n // LANES) * LANES


# ---------------------------------------------------------------- plan and bytes model


@dataclasses.dataclass(frozen=True)
class Operand:
    """One operand of a kernel: its array, its block and the HBM bytes it moves.

    Attributes:
      name: what it is (``"x"``, ``"dy"``, ``"stat"``, ``"dscale_partials"``, ...).
      shape, block, dtype: the array's shape, its BlockSpec's block shape (None for a
        squeezed dim) and dtype.
      bytes: the bytes copied between HBM and VMEM over the whole grid: a block is copied
        when its index differs from the previous grid step's (so a block whose index
        never changes, like the scale, is copied once), clipped to the array's bounds
        (the last block of rows may be partial). HBM tiling padding is not counted.
    """

    name: str
    shape: tuple[int, ...]
    block: tuple[int | None, ...]
    dtype: np.dtype
    bytes: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one kernel call is cut into blocks, and what it moves.

    Attributes:
      kernel: ``"forward"`` or ``"backward"``.
      generation: the :class:`Generation` the blocks are sized for.
      block_rows: rows per block.
      grid: the Pallas grid.
      inputs, outputs: the operands, in the kernel's order.
    """

    kernel: str
    generation: Generation
    block_rows: int
    grid: tuple[int, ...]
    inputs: tuple[Operand, ...]
    outputs: tuple[Operand, ...]

    @property
    def bytes_moved(self) -> int:
        """HBM bytes read and written by the kernel."""
        return sum(o.bytes for o in (*self.inputs, *self.outputs))

    def operand(self, name: str) -> Operand:
        for o in (*self.inputs, *self.outputs):
            if o.name == name:
                return o
        raise KeyError(name)


def _block_bytes(shape, block, index_map, grid, dtype) -> int:
    """Bytes that the pipeline copies for one operand over ``grid`` (see :class:`Operand`)."""
    itemsize = np.dtype(dtype).itemsize
    dims = [1 if b is None else b for b in block]
    total, previous = 0, None
    for point in np.ndindex(*grid):
        index = tuple(int(i) for i in index_map(*point))
        if index == previous:
            continue
        previous = index
        elements = 1
        for i, d, size in zip(index, dims, shape, strict=True):
            elements *= max(0, min(d, size - i * d))
        total += elements * itemsize
    return total


def _index_min(a, b):
    """``min`` for grid indices, traced (in the kernel) or plain ints (in :func:`plan`)."""
    return jnp.minimum(a, b) if isinstance(a, jax.Array) else min(a, b)


def _row_dtypes(spec, x_dtype, kind, residual_dtype=None, h_dtype=None, dx_dtype=None):
    """The dtypes of a kernel's (rows, n) operands, inputs and outputs."""
    if kind == "forward":
        extra = [] if residual_dtype is None else [residual_dtype, h_dtype]
        return [x_dtype, spec.out_dtype, *extra]
    extra = [] if residual_dtype is None else [residual_dtype]  # dh
    return [x_dtype, x_dtype, dx_dtype or x_dtype, *extra]


def _block_rows(spec, rows, kind, gen, row_dtypes) -> int:
    """Rows per block (see the module doc); 0 when one sublane tile of rows does not fit.

    A block row takes, per padded feature, twice (double buffering) the bytes of every
    row operand plus 4 bytes for each float32 temporary of the body.
    """
    temps = _FWD_TEMPS + (len(row_dtypes) > 2) if kind == "forward" else _BWD_TEMPS
    io = sum(np.dtype(d).itemsize for d in row_dtypes)
    row_bytes = (2 * io + 4 * temps) * _padded(spec.n)
    tile = max(_sublanes(d) for d in row_dtypes)
    fit = min(gen.block_budget_bytes // row_bytes, _MAX_BLOCK_ROWS) // tile * tile
    if fit == 0:
        return 0
    # Enough steps for the pipeline; a multiple of 128 rows (a lane-dense statistic)
    # where that is no more than the rows allow.
    want = -(-rows // _MIN_STEPS)
    unit = LANES if want >= LANES and fit >= LANES else tile
    return max(tile, min(fit, -(-want // unit) * unit) // unit * unit)


def plan(
    spec: KernelSpec,
    rows: int,
    x_dtype,
    kind: str = "forward",
    *,
    residual_dtype=None,
    h_dtype=None,
    dx_dtype=None,
    generation_name: str | None = None,
) -> Plan | None:
    """The blocks, grid and bytes of the ``kind`` kernel (``"forward"`` or ``"backward"``)
    for ``rows`` rows of ``spec.n`` features, or None where a row does not fit.

    ``residual_dtype`` / ``h_dtype``: the residual form (forward: the residual's and h's
    dtypes; backward: ``residual_dtype`` is dh's). ``dx_dtype`` defaults to ``x_dtype``.
    ``generation_name``: the generation to size for (default: see :func:`generation`).

    A bfloat16 forward of 8192 x 4096 moves two x-sizes plus the statistic:

    >>> import numpy as np, jax.numpy as jnp
    >>> spec = KernelSpec(4096, 4096, 1e-6, True, 0.0, True, False, np.dtype(jnp.bfloat16))
    >>> p = plan(spec, 8192, jnp.bfloat16, generation_name="v5e")
    >>> p.block_rows, p.grid, p.bytes_moved - 2 * 8192 * 4096 * 2
    (512, (16,), 49152)
    """
    gen = generation(generation_name)
    x_dtype = np.dtype(x_dtype)
    if kind not in ("forward", "backward"):
        raise ValueError(f"kind must be 'forward' or 'backward', got {kind!r}.")
    row_dtypes = _row_dtypes(spec, x_dtype, kind, residual_dtype, h_dtype, dx_dtype)
    br = _block_rows(spec, rows, kind, gen, row_dtypes)
    if br == 0 or rows == 0:
        return None
    if kind == "forward":
        grid, inputs, outputs = _forward_operands(spec, rows, br, x_dtype, residual_dtype, h_dtype)
    else:
        dx_dtype = np.dtype(dx_dtype or x_dtype)
        grid, inputs, outputs = _backward_operands(
            spec, rows, br, x_dtype, residual_dtype, dx_dtype
        )
    return Plan(kind, gen, br, grid, tuple(inputs), tuple(outputs))


_F32 = np.dtype(jnp.float32)


def _operand(grid, name, shape, block, index_map, dtype) -> Operand:
    size = _block_bytes(shape, block, index_map, grid, dtype)
    return Operand(name, shape, block, np.dtype(dtype), size)


def _forward_operands(spec: KernelSpec, rows: int, br: int, x_dtype, residual_dtype, h_dtype):
    """The forward's grid ``(blocks,)`` and its operands."""
    n, blocks = spec.n, -(-rows // br)
    grid = (blocks,)
    rows_block = functools.partial(_operand, grid, shape=(rows, n), block=(br, n))
    row_map = lambda i: (i, 0)
    inputs = [rows_block("x", index_map=row_map, dtype=x_dtype)]
    if residual_dtype is not None:
        inputs.append(rows_block("residual", index_map=row_map, dtype=residual_dtype))
    for name, present in (("scale", spec.has_scale), ("bias", spec.has_bias)):
        if present:
            inputs.append(_operand(grid, name, (1, n), (1, n), lambda i: (0, 0), _F32))
    stat_map = lambda i: (i, 0, 0)
    outputs = [
        rows_block("y", index_map=row_map, dtype=spec.out_dtype),
        _operand(grid, "stat", (blocks, 1, br), (None, 1, br), stat_map, _F32),
    ]
    if residual_dtype is not None:
        outputs.append(rows_block("h", index_map=row_map, dtype=h_dtype))
    return grid, inputs, outputs


def _backward_operands(spec: KernelSpec, rows: int, br: int, x_dtype, dh_dtype, dx_dtype):
    """The backward's grid ``(slots, steps)`` and its operands."""
    n, blocks = spec.n, -(-rows // br)
    slots = min(2, blocks)
    steps = -(-blocks // slots)
    grid = (slots, steps)
    rows_block = functools.partial(_operand, grid, shape=(rows, n), block=(br, n))
    row_map = backward_row_map(steps, blocks)
    stat_map = functools.partial(_stat_block, row_map)
    inputs = [
        rows_block("x", index_map=row_map, dtype=x_dtype),
        rows_block("dy", index_map=row_map, dtype=x_dtype),
        _operand(grid, "stat", (blocks, 1, br), (None, 1, br), stat_map, _F32),
    ]
    if spec.has_scale:
        inputs.append(_operand(grid, "scale", (1, n), (1, n), lambda c, i: (0, 0), _F32))
    if dh_dtype is not None:
        inputs.append(rows_block("dh", index_map=row_map, dtype=dh_dtype))
    outputs = [rows_block("dx", index_map=row_map, dtype=dx_dtype)]
    partial = (PARTIAL_ROWS * slots, n)
    for name, present in (("dscale_partials", spec.has_scale), ("dbias_partials", spec.has_bias)):
        if present:
            slot_map = lambda c, i: (c, 0)
            outputs.append(_operand(grid, name, partial, (PARTIAL_ROWS, n), slot_map, _F32))
    return grid, inputs, outputs


def _backward_block(steps: int, blocks: int, c, i):
    return (_index_min(c * steps + i, blocks - 1), 0)


def _stat_block(row_map, c, i):
    return (row_map(c, i)[0], 0, 0)


def backward_row_map(steps: int, blocks: int):
    """Block of rows of grid point (slot, step): the slots take consecutive runs of
    blocks; a last slot with one step too many repeats its last block (its index does
    not change, so nothing is copied again, and its rows are masked out of the sums)."""
    return functools.partial(_backward_block, steps, blocks)


def fits(spec: KernelSpec, rows: int, x_dtype, **call) -> bool:
    """Whether a block of one sublane tile of rows fits the VMEM of the generation being
    compiled for (see the module doc); False for zero rows. ``call``: ``kind`` and the
    call's dtypes, as :func:`_contract.planned_fits` reads them (without a kind: every
    form; a 16-bit operand makes the sublane tile 16 rows, a float32 one each row wide:
    the two together are the tightest)."""
    return planned_fits(plan, spec, rows, x_dtype, **call)
