"""How the Mosaic GPU kernels cut a call (:func:`plan`) and whether they take it (:func:`fits`).

A row of n features is viewed as ``(J, S)``: J splits of S features, S <= 256 (a TMA box
holds at most 256 elements along each axis), so that a block of R rows is one TMA copy of
shape ``(R, J, S)``. The kernels compute on register chunks of shape ``(T, S)`` in a
layout where each thread holds vectors of ``v`` consecutive features (``v * 4`` bytes of
float32 at most: 16-byte shared-memory transfers), ``lanes`` lanes of a warp span a chunk's
S features and ``32 / lanes`` of its rows, and the 4 warps of the warpgroup split its rows:

- ``split=False`` (row tiles, narrow rows): a chunk is T rows of one split; a row's sum is
  reduced in registers over its splits, then across the lanes of its warp.
- ``split=True`` (one row per block, wide rows): a chunk is T splits of one row; its sum is
  reduced over the chunk's elements, then across the 4 warps (through shared memory). The
  row is staged whole where it fits, else ``stream``ed: loaded chunk by chunk per pass.

What the kernels take (:func:`fits`): rows whose features split into 16-byte TMA rows
(n a multiple of 8 with a 16-bit operand, of 4 with float32 ones) and whose blocks fit
shared memory: every such width up to 32768 features in both directions with one
parameter sum (the backward keeps a float32 row per sum in shared memory, so scale and
bias together stop at 24576), the forward up to 65536 (bfloat16; float32 streamed).
Wider rows, and widths that tile neither way (2880 with both sums), stay on XLA: a row
split over a cluster's shared memory is not written.

The hardware's limits are constants below; the choices a GPU run tunes (chunk and
block sizes, the widest row tile, blocks an SM) are data, ``data/mosaic_gpu_sizing.json``,
which says where they come from.
"""

from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources

import numpy as np

from ._contract import KERNEL_DTYPES, KernelSpec, planned_fits
from ._device import DEFAULT_SMS, target

__all__ = [
    "SIZING",
    "Plan",
    "Sizing",
    "fits",
    "grid_size",
    "plan",
    "plan_or_raise",
]

# Dynamic shared memory a block may use on sm_90 (227 KiB, the opt-in maximum that
# Mosaic GPU checks), and what Mosaic GPU adds to the kernel's buffers (barriers and the
# cross-warp reduction scratch, each aligned to 1024 bytes).
SMEM_BYTES = 227 * 1024
_MOSAIC_SMEM = 2048
# Mosaic GPU's barriers (8 bytes each) come after the aligned scratch and are not in
# ``smem_scratch_bytes``: room for 16 of them.
_BARRIER_BYTES = 128
# Shared memory of one SM (228 KiB), of which each resident block also reserves 1 KiB.
_SM_SMEM_BYTES = 228 * 1024


@dataclasses.dataclass(frozen=True)
class Sizing:
    """The choices a GPU run tunes; :data:`SIZING` holds ``data/mosaic_gpu_sizing.json``'s,
    which :func:`plan` takes unless given others (``python -m benchmarks.kernel_sizes
    --backend mosaic_gpu`` times the kernels under others).

    Attributes:
      forward_chunk, backward_chunk: float32 elements of one array per thread in a
        register chunk: the forward's chunk math holds a few such arrays, the backward's
        about eight (x, dy, dx, dh, two sums), under 128 registers a thread, so that 4
        warpgroups may share an SM.
      block_elements: features of a block of rows staged at once (row tiles), so that
        one TMA copy moves enough bytes to keep the memory system busy.
      max_tile_features: the widest row kept in row tiles; wider rows take one row per
        block (a tile of 8 rows of 4096 features leaves no room for the backward's
        partial sums in shared memory).
      max_blocks_per_sm: blocks (warpgroups) resident on one SM: enough to overlap one
        block's TMA copies with another's arithmetic; more would cap registers below
        128 a thread.
    """

    forward_chunk: int
    backward_chunk: int
    block_elements: int
    max_tile_features: int
    max_blocks_per_sm: int

    @classmethod
    def from_data(cls, data: dict) -> Sizing:
        chunk = data["chunk_elements"]
        return cls(
            chunk["forward"],
            chunk["backward"],
            data["block_elements"],
            data["max_tile_features"],
            data["max_blocks_per_sm"],
        )

    def chunk(self, kind: str) -> int:
        return self.forward_chunk if kind == "forward" else self.backward_chunk


SIZING = Sizing.from_data(
    json.loads(resources.files(__package__).joinpath("data/mosaic_gpu_sizing.json").read_text())
)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static schedule of one kernel call.

    Attributes:
      kind: ``"forward"`` or ``"backward"``.
      split: one row per block, chunks across its splits (else row tiles).
      S, J: a row is J splits of S features.
      v: features per vector a thread holds; lanes: lanes across S.
      T: rows (row tiles) or splits (``split``) of a register chunk.
      R: rows per block (one TMA copy per staged array).
      slots: staging buffers per staged array (2: the next block loads during this one).
      smem: shared-memory bytes of one block.
      stream: (split rows only) the row's chunks are loaded for each pass through
        two-slot rings instead of staged whole (rows too wide for shared memory).
      max_blocks_per_sm: the :class:`Sizing`'s, which :meth:`programs` keeps to.
    """

    kind: str
    split: bool
    S: int
    J: int
    v: int
    lanes: int
    T: int
    R: int
    slots: int
    smem: int
    stream: bool = False
    max_blocks_per_sm: int = SIZING.max_blocks_per_sm

    @property
    def tiles(self) -> int:
        """Register chunks a block holds along its rows."""
        return 1 if self.split else self.R // self.T

    @property
    def chunks(self) -> int:
        """Register chunks along a row."""
        return self.J // self.T if self.split else self.J

    @property
    def acc_rows(self) -> int:
        """Rows of the backward's partial sums a block writes."""
        return 1 if self.split else self.T

    def blocks(self, rows: int) -> int:
        return -(-rows // self.R)

    def programs(self, rows: int, sms: int | None = None) -> int:
        """Persistent blocks: as many as fit the SMs' shared memory (at most
        ``max_blocks_per_sm`` an SM), at most one per block of rows."""
        per_sm = min(self.max_blocks_per_sm, _SM_SMEM_BYTES // (self.smem + 1024))
        return max(1, min(self.blocks(rows), (sms or DEFAULT_SMS) * per_sm))


def _pow2_part(m: int, cap: int = 32) -> int:
    return math.gcd(m, cap)


def _split_width(n: int, v: int, sector: int) -> tuple[int, int] | None:
    """(S, lanes): the split of n with the most lanes across it (then the widest), S a
    multiple of v and of the 16-byte ``sector`` (TMA strides), at most 256."""
    best = None
    for s in range(v, min(n, 256) + 1, v):
        if n % s or s % sector:
            continue
        key = (_pow2_part(s // v), s)
        best = max(best or key, key)
    return None if best is None else (best[1], best[0])


def _row_dtypes(spec: KernelSpec, x_dtype, kind, residual_dtype, h_dtype, dx_dtype):
    """(dtypes staged per row, dtypes written per row) of a call."""
    x = np.dtype(x_dtype)
    if kind == "forward":
        staged = [x] if residual_dtype is None else [x, np.dtype(residual_dtype)]
        outs = [np.dtype(spec.out_dtype)]
        if residual_dtype is not None:
            outs.append(np.dtype(h_dtype if h_dtype is not None else x))
        return staged, outs
    staged = [x, np.dtype(spec.out_dtype)]  # x (h for the residual form) and dy
    if residual_dtype is not None:
        staged.append(np.dtype(residual_dtype))  # dh
    return staged, [np.dtype(dx_dtype if dx_dtype is not None else x)]


def _smem(spec, kind, split, S, T, R, slots, staged, outs, stream=False) -> int:
    """Shared-memory bytes of one block: every buffer starts at a multiple of 1024 bytes
    (Pallas Mosaic GPU's alignment), and Mosaic adds its barriers and reduction scratch."""
    n = spec.n
    buffers = [2 * T * S * d.itemsize if stream else slots * R * n * d.itemsize for d in staged]
    buffers += [2 * T * S * d.itemsize for d in outs]  # the output rings
    if not split:  # the forward's statistic ring, the backward's staged statistic
        buffers.append(2 * T * 4 if kind == "forward" else slots * -(-R // 32) * 32 * 4)
    if kind == "backward":
        sums = int(spec.has_scale) + int(spec.has_bias)
        buffers += [(1 if split else T) * n * 4] * sums
    return sum(-(-b // 1024) * 1024 for b in buffers) + _MOSAIC_SMEM


def plan(
    spec: KernelSpec,
    rows: int,
    x_dtype,
    kind: str,
    *,
    residual_dtype=None,
    h_dtype=None,
    dx_dtype=None,
    sizing: Sizing = SIZING,
) -> Plan | None:
    """The schedule of a ``kind`` call under ``sizing``, or None when the kernels cannot
    take it (a dtype they do not take, a row whose features do not split into 16-byte TMA
    rows, or a block that does not fit shared memory)."""
    staged, outs = _row_dtypes(spec, x_dtype, kind, residual_dtype, h_dtype, dx_dtype)
    if rows < 1 or any(d not in KERNEL_DTYPES for d in (*staged, *outs)):
        return None
    if not 1 <= spec.k <= spec.n <= 256 * 256:
        return None
    widest = max(d.itemsize for d in (*staged, *outs))
    if spec.has_scale or spec.has_bias or kind == "backward":
        widest = 4  # float32 parameters and partial sums share the chunks' layout
    sector = 16 // min(d.itemsize for d in (*staged, *outs))
    wide = spec.n > sizing.max_tile_features
    for split in (wide, not wide):
        found = _plan(spec, rows, kind, split, widest, sector, staged, outs, sizing)
        if found is not None:
            return found
    return None


def _plan(spec, rows, kind, split, widest, sector, staged, outs, sizing) -> Plan | None:
    # The widest vectors that leave 8 lanes or more across a split (a quarter warp reads
    # 128 contiguous bytes), else the most lanes.
    found = []
    for v in (8, 4, 2, 1):
        sw = _split_width(spec.n, v, sector) if v * widest <= 16 else None
        if sw is not None and (sw[1] == 32 or not split):
            found.append((min(sw[1], 8), v, sw[1], sw[0]))
    if not found:
        return None
    _, v, lanes, S = max(found)
    J = spec.n // S
    unit = 4 * (32 // lanes)  # rows (splits) of the layout's base tile
    T = max(unit, sizing.chunk(kind) * 128 // S // unit * unit)
    if split:
        if J % unit:
            return None
        T = max(d for d in range(unit, min(T, J) + 1, unit) if J % d == 0)
        R = 1
    else:
        # TMA copies into shared memory move whole multiples of 128 bytes.
        unit = max(T, *(128 // math.gcd(128, spec.n * d.itemsize) for d in staged))
        unit = unit * T // math.gcd(unit, T)
        R = unit * max(1, sizing.block_elements // (unit * spec.n))
        R = min(R, 256 // unit * unit, -(-rows // unit) * unit)
        if R < unit:
            return None
    for slots, stream in ((2, False), (1, False), (2, True)):
        if stream and not split:
            break
        smem = _smem(spec, kind, split, S, T, R, slots, staged, outs, stream)
        if smem + _BARRIER_BYTES <= SMEM_BYTES:
            per_sm = sizing.max_blocks_per_sm
            return Plan(kind, split, S, J, v, lanes, T, R, slots, smem, stream, per_sm)
    return None


def fits(spec: KernelSpec, rows: int, x_dtype, **call) -> bool:
    """Whether the Mosaic GPU kernels take the call: float32, bfloat16 or float16 rows
    whose features split into TMA rows of 16-byte multiples (n a multiple of 8 with a
    16-bit operand, of 4 with float32 ones), at most 65536 features, and a block that fits
    shared memory (see :func:`plan`). With ``kind`` and the call's dtypes: whether that
    kernel takes that call; without, whether both take every form of it (residual, h and
    dx float32 or bfloat16).

    >>> import numpy as np
    >>> spec = KernelSpec(n=32768, k=32768, eps=1e-6, inside=True, scale_offset=0.0,
    ...                   has_scale=True, has_bias=True, out_dtype=np.dtype("float32"))
    >>> fits(spec, 8, np.float32, kind="forward"), fits(spec, 8, np.float32, kind="backward")
    (True, False)
    >>> import dataclasses  # one float32 sum of 32768 features fits, two (256 KiB) do not
    >>> fits(dataclasses.replace(spec, has_bias=False), 8, np.float32, kind="backward")
    True
    """
    return planned_fits(plan, spec, rows, x_dtype, **call)


# ---------------------------------------------------------------- the calls' arguments


def plan_or_raise(spec, rows, x_dtype, kind, sizing: Sizing = SIZING, **dtypes) -> Plan:
    found = plan(spec, rows, x_dtype, kind, sizing=sizing, **dtypes)
    if found is None:
        raise ValueError(
            f"the Mosaic GPU {kind} kernel does not take {rows} rows of {spec.n} features "
            f"({np.dtype(x_dtype)}, {dtypes}): check fits(spec, rows, x.dtype, kind={kind!r}, "
            f"...) first and use another implementation where it is False."
        )
    return found


def grid_size(p: Plan, rows: int, programs: int | None = None) -> int:
    """The persistent grid of a call: ``programs`` if given (checked), else
    :meth:`Plan.programs` on the SMs of the GPU being compiled for (an H100's 132 where
    none is known)."""
    if programs is None:
        return p.programs(rows, target().sms)
    if not 1 <= programs <= p.blocks(rows):
        raise ValueError(
            f"programs must be between 1 and the {p.blocks(rows)} row blocks of this call, "
            f"got {programs}; pass None for the default."
        )
    return programs
