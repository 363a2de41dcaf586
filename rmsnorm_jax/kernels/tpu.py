"""Pallas Mosaic kernels for TPU (v4 to TPU7x): one pass forward, one pass backward.

The contract (``fits``, ``forward``, ``backward``) is ``_spec.py``'s and so is the maths:
the kernel bodies call its per-row helpers on float32 blocks loaded from VMEM.

Schedule. Every kernel walks over blocks of ``block_rows`` whole rows, so a row's
statistic and its normalisation happen in the same pass over HBM:

- forward, grid ``(blocks,)``, "parallel": reads x (and the residual) once, writes y
  (and h) once, and the per-row float32 statistic;
- backward, grid ``(slots, steps)``: "parallel" over ``slots`` (the two TensorCores of a
  megacore v4/v5p chip each take one), "arbitrary" over ``steps``. Reads x, dy (and dh)
  once, writes dx once; the scale and bias gradients are summed over the rows of every
  block into an (8, n) float32 accumulator that stays in VMEM for all the steps of a slot
  (rows past the end of the array are masked out by row index), so the partial sums
  written to HBM are ``(8 * slots, n)``, whatever the number of rows.

Layouts. A block is ``(block_rows, n)``: its last dim is the array's full feature dim,
which Mosaic accepts for any n (1000, 5120, ...); the feature iota ``col`` masks the
mean square to the first k features. The per-row statistic is stored lane-dense, as a
``(blocks, 1, block_rows)`` float32 array (XLA:TPU tiles it ``T(1, 128)``: 4 bytes a row
when ``block_rows`` is a multiple of 128, 512 bytes a block below that), not as
``(rows, 1)``, which XLA:TPU pads to 128 lanes (512 bytes a row). In VMEM the forward
turns its column into a row by a transpose of one (rows, 128) tile (a reshape would need
a sublane gather, which v4 lacks), the backward the row into a column by a reshape.

Layout copies. For n not a multiple of 128 (1000), a standalone program's x, dy, y and dx
are given a column-major layout by XLA:TPU (seen on v4, v5e, v5p, v6e and TPU7x at 2048 x
1000 and 8192 x 1000 bfloat16), and XLA copies them around the kernels, which need
row-major. Where x comes from a matmul, as in a model, or with the program's layouts
pinned row-major, there are no copies (the tests compile the latter).

Block sizes (:func:`plan`). Per generation, the kernels ask for a scoped VMEM limit of
3/4 of a TensorCore's VMEM, at most 64 MiB (v4 12, v5p and TPU7x 48, v5e and v6e 64), and
give their blocks 3/4 of that (the rest: Mosaic's own scratch, and the error of the count
that follows). A block row costs, per padded feature (n rounded up to 128), twice the
bytes of every row operand (inputs and outputs are double-buffered) plus 4 bytes for each
float32 temporary of the body (``_FWD_TEMPS``, ``_BWD_TEMPS``): counting only the
operands is what ran out of scoped VMEM on v5e (a backward of 256 x 4096 blocks under the
default 16 MiB limit). The rows of a block are the most that fit, rounded down to the
sublane tiling (8 for float32, 16 for 16-bit types) or to 128 rows where the rows allow
it (a lane-dense statistic), at most ``_MAX_BLOCK_ROWS`` and about an eighth of the rows
(so that the pipeline overlaps the copies of one block with the work on another). E.g.
8192 x 4096 bfloat16: forward blocks of 512 rows on v5e/v6e, 384 on v5p/TPU7x, 112 on v4;
backward 256 rows (64 on v4). Where one sublane tile of rows does not fit, ``fits`` is
False and XLA computes the call (bfloat16: above 12288 features on v4, 49152 on v5p and
TPU7x, 65536 on v5e and v6e).

The generation is read from the mesh being traced for (``shard_map``, ``jax.set_mesh``)
or from the default device; where neither is a TPU (a deviceless compile without a mesh,
interpret mode) the sizes are those of the smallest VMEM (v4), which fit every
generation.

Not measured: the kernels' speed (no TPU in the sessions that wrote them, and XLA gives
no cost estimate for a custom call). :func:`plan` gives the bytes each kernel moves.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._rounding import added
from ._spec import (
    KernelSpec,
    input_grad,
    inv_rms,
    mean_square,
    normalized,
    out_struct,
    stat_from_ms,
)

__all__ = [
    "GENERATIONS",
    "Generation",
    "Operand",
    "Plan",
    "backward",
    "fits",
    "forward",
    "generation",
    "plan",
]

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

# Float32 temporaries of a block that the bodies hold at once, per element (the upcast
# x, its square or product with dy, the float32 result before its cast, ...), one more
# than Mosaic was found to need: deviceless compiles at 4096 features on v4 (12 MiB
# limit) fit at most 96 bfloat16 / 80 float32 backward rows (about 4.3 / 2.8 float32
# temporaries beyond the double-buffered operands) and 128 float32 forward rows (1.3).
# The tests compile both kernels at the widest rows that fit, on every generation.
_FWD_TEMPS = 3
_BWD_TEMPS = 6
_MAX_BLOCK_ROWS = 1024
_MIN_STEPS = 8
_LANES = 128
_PARTIAL_ROWS = 8  # the sublanes of one float32 vreg: the partial sums' rows per slot


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
    device = jax.sharding.get_abstract_mesh().abstract_device
    kind = getattr(device, "device_kind", None)
    if kind is None:
        default = jax.devices()[0]
        kind = default.device_kind if default.platform == "tpu" else None
    return GENERATIONS.get(_DEVICE_KINDS.get(kind, ""), _ANY)


def _sublanes(dtype) -> int:
    """Rows of one (sublanes, 128) VMEM tile: 8 for 32-bit types, 16 for 16-bit ones."""
    return 8 * (4 // min(np.dtype(dtype).itemsize, 4))


def _padded(n: int) -> int:
    return -(-n // _LANES) * _LANES


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
    unit = _LANES if want >= _LANES and fit >= _LANES else tile
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
    residual = residual_dtype is not None
    if kind not in ("forward", "backward"):
        raise ValueError(f"kind must be 'forward' or 'backward', got {kind!r}.")
    row_dtypes = _row_dtypes(spec, x_dtype, kind, residual_dtype, h_dtype, dx_dtype)
    br = _block_rows(spec, rows, kind, gen, row_dtypes)
    if br == 0 or rows == 0:
        return None
    n, blocks = spec.n, -(-rows // br)
    f32 = np.dtype(jnp.float32)

    def operand(name, shape, block, index_map, dtype):
        size = _block_bytes(shape, block, index_map, grid, dtype)
        return Operand(name, shape, block, np.dtype(dtype), size)

    params = [("scale", spec.has_scale), ("bias", spec.has_bias and kind == "forward")]
    if kind == "forward":
        grid = (blocks,)
        row_map = lambda i: (i, 0)
        const_map = lambda i: (0, 0)
        inputs = [operand("x", (rows, n), (br, n), row_map, x_dtype)]
        if residual:
            inputs.append(operand("residual", (rows, n), (br, n), row_map, residual_dtype))
        inputs += [operand(p, (1, n), (1, n), const_map, f32) for p, on in params if on]
        outputs = [
            operand("y", (rows, n), (br, n), row_map, spec.out_dtype),
            operand("stat", (blocks, 1, br), (None, 1, br), lambda i: (i, 0, 0), f32),
        ]
        if residual:
            outputs.append(operand("h", (rows, n), (br, n), row_map, h_dtype))
    else:
        slots = min(2, blocks)
        steps = -(-blocks // slots)
        grid = (slots, steps)
        row_map = _backward_row_map(steps, blocks)
        const_map = lambda c, i: (0, 0)
        slot_map = lambda c, i: (c, 0)
        inputs = [
            operand("x", (rows, n), (br, n), row_map, x_dtype),
            operand("dy", (rows, n), (br, n), row_map, x_dtype),
            operand(
                "stat",
                (blocks, 1, br),
                (None, 1, br),
                lambda c, i: (*row_map(c, i)[:1], 0, 0),
                f32,
            ),
        ]
        if spec.has_scale:
            inputs.append(operand("scale", (1, n), (1, n), const_map, f32))
        if residual:
            inputs.append(operand("dh", (rows, n), (br, n), row_map, residual_dtype))
        outputs = [operand("dx", (rows, n), (br, n), row_map, dx_dtype or x_dtype)]
        partial = (_PARTIAL_ROWS * slots, n)
        for name, on in (("dscale_partials", spec.has_scale), ("dbias_partials", spec.has_bias)):
            if on:
                outputs.append(operand(name, partial, (_PARTIAL_ROWS, n), slot_map, f32))
    return Plan(kind, gen, br, grid, tuple(inputs), tuple(outputs))


def _backward_row_map(steps: int, blocks: int):
    """Block of rows of grid point (slot, step): the slots take consecutive runs of
    blocks; a last slot with one step too many repeats its last block (its index does
    not change, so nothing is copied again, and its rows are masked out of the sums)."""
    return lambda c, i: (_index_min(c * steps + i, blocks - 1), 0)


def fits(
    spec: KernelSpec,
    rows: int,
    x_dtype,
    *,
    kind: str | None = None,
    residual_dtype=None,
    h_dtype=None,
    dx_dtype=None,
) -> bool:
    """Whether a block of one sublane tile of rows fits the VMEM of the generation being
    compiled for (see the module doc); False for zero rows.

    With ``kind`` (``"forward"`` or ``"backward"``) and the call's dtypes: whether that
    kernel takes that call (what :func:`forward` and :func:`backward` need). Without:
    whether both kernels take every form of it, the residual forms with float32 or
    16-bit residual, h and dx included (a 16-bit operand makes the sublane tile 16 rows,
    a float32 one makes each row wide: the two together are the tightest)."""
    if kind is not None:
        dtypes = dict(residual_dtype=residual_dtype, h_dtype=h_dtype, dx_dtype=dx_dtype)
        return plan(spec, rows, x_dtype, kind, **dtypes) is not None
    f32, bf16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
    forms = [dict()] + [
        dict(residual_dtype=r, h_dtype=h, dx_dtype=d)
        for r, h, d in itertools.product((f32, bf16), repeat=3)
    ]
    return all(
        plan(spec, rows, x_dtype, k, **form) is not None
        for k in ("forward", "backward")
        for form in forms
    )


# ---------------------------------------------------------------- kernels


def _params(semantics, gen: Generation):
    return pltpu.CompilerParams(
        dimension_semantics=semantics, vmem_limit_bytes=gen.vmem_limit_bytes
    )


def _interpret(interpret: bool):
    return pltpu.InterpretParams() if interpret else False


def _lane_row(column: jax.Array) -> jax.Array:
    """(rows, 1) -> (1, rows), for the lane-dense statistic. A transpose of a (rows, 128)
    tile: ``column.reshape(1, rows)`` needs a sublane gather, which v4 lacks."""
    rows = column.shape[0]
    return jnp.transpose(jnp.broadcast_to(column, (rows, _LANES)))[:1, :]


def _col(shape) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)


def forward(spec: KernelSpec, x, scale, bias, residual=None, *, h_dtype=None, interpret=False):
    """One pass: ``(y, stat, h)`` of ``x`` (rows, n) as ``_spec.py`` documents.

    y = (scale + scale_offset) * h * r + bias in spec.out_dtype, h = x (or x + residual
    in h_dtype), r = 1 / RMS of the first spec.k features, computed in float32;
    stat: (rows,) float32, rsqrt(ms + eps) ("inside") or sqrt(ms) ("outside").
    ``interpret=True`` runs the kernel on CPU (Pallas TPU interpret mode).
    """
    rows, n = x.shape
    residual_dtype = None if residual is None else residual.dtype
    h_dtype = None if residual is None else np.dtype(h_dtype or x.dtype)
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
            # ``added`` keeps the roundings there (_rounding.py).
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
    outs = pl.pallas_call(
        body,
        grid=p.grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(("parallel",), p.generation),
        interpret=_interpret(interpret),
        name="rms_norm_forward",
    )(*operands)
    y, stat = outs[0], outs[1].reshape(blocks * br)[:rows]
    return y, stat, (outs[2] if with_residual else None)


def backward(spec: KernelSpec, x, dy, stat, scale, dh=None, *, dx_dtype, interpret=False):
    """One pass: ``(dx, dscale_partials, dbias_partials)`` as ``_spec.py`` documents.

    dx = r * gdy - [col < k] * x * r * alpha * (1/k) * sum_j gdy_j x_j r (+ dh), in
    dx_dtype, with gdy = (scale + offset) * dy (``_spec.input_grad``); the partials are
    float32 (8 * slots, n) sums of dy * x * r and of dy over the rows (sum them over
    axis 0). ``interpret=True`` runs the kernel on CPU (Pallas TPU interpret mode).
    """
    rows, n = x.shape
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
                ref[...] += value.reshape(br // _PARTIAL_ROWS, _PARTIAL_ROWS, n).sum(0)

            if "dscale" in sum_refs:
                accumulate(sum_refs["dscale"], dyf * (xf * inv_rms(spec, stat)))
            if "dbias" in sum_refs:
                accumulate(sum_refs["dbias"], dyf)

    row_map = _backward_row_map(steps, blocks)
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
    partial = out_struct((_PARTIAL_ROWS * slots, n), jnp.float32, x)
    out_shape = [out_struct((rows, n), dx_dtype, x)] + [partial] * len(sums)
    out_specs = [row_spec] + [pl.BlockSpec((_PARTIAL_ROWS, n), lambda c, i: (c, 0))] * len(sums)
    outs = pl.pallas_call(
        body,
        grid=p.grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(("parallel", "arbitrary"), p.generation),
        interpret=_interpret(interpret),
        name="rms_norm_backward",
    )(*operands)
    partials = dict(zip(sums, outs[1:], strict=True))
    return outs[0], partials.get("dscale"), partials.get("dbias")
