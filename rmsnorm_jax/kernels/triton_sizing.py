"""How the Pallas-Triton kernels cut a call: rows per program, warps, and the backward's
persistent programs.

A program holds its block of rows in registers, in float32 once loaded. Triton needs
power-of-two blocks, so a row of n features is a block of :func:`padded_features` columns
(5120 is padded to 8192) with masked loads and stores. The choices that were measured
(warps and programs per SM of the backward, the widest row) are read from
``data/triton_sizing.json``, which names the run that chose them; ``docs/kernels.md`` says
why. Nothing is autotuned; ``block_rows``, ``warps`` and ``programs`` can be given per call.
"""

from __future__ import annotations

import json
from importlib import resources

from jax.experimental import pallas as pl

from ._device import target

SIZING = json.loads(resources.files(__package__).joinpath("data/triton_sizing.json").read_text())
# Rows per block: this many elements // padded features (16 KiB of float32 in flight).
_BLOCK_ELEMENTS = SIZING["block_elements"]
# Warps: this many float32 elements per thread per array, up to _MAX_WARPS.
_ELEMENTS_PER_THREAD = SIZING["elements_per_thread"]
_MAX_WARPS = SIZING["max_warps"]
# Wider rows spill registers in the backward: they stay on XLA.
MAX_FEATURES = SIZING["max_features"]
# (largest n, warps or None for num_warps, programs per SM), by padded width.
_BACKWARD_SIZING = tuple(
    (row["max_features"], row["warps"], row["programs_per_sm"]) for row in SIZING["backward"]
)
_MIN_ROWS_PER_PROGRAM = 4
# Interpret mode copies the whole array for every block it loads (CPU tests), so there
# blocks grow until a call has at most this many.
_INTERPRET_MAX_BLOCKS = 64


def padded_features(n: int) -> int:
    """The block's columns: n rounded up to a power of two (at least 16)."""
    return max(16, pl.next_power_of_2(n))


def default_block_rows(n: int, rows: int) -> int:
    """Rows per block: ``_BLOCK_ELEMENTS // padded_features(n)``, at least 1, and no
    more than ``rows`` rounded up to a power of two (a 3-row call gets blocks of 4)."""
    per_block = max(1, _BLOCK_ELEMENTS // padded_features(n))
    return min(per_block, pl.next_power_of_2(max(rows, 1)))


def num_warps(n: int, rows_per_block: int) -> int:
    """Warps per program: 16 float32 elements per thread, between 1 and 8 warps."""
    elements = rows_per_block * padded_features(n)
    return int(min(max(elements // (32 * _ELEMENTS_PER_THREAD), 1), _MAX_WARPS))


def backward_warps(n: int, rows_per_block: int) -> int:
    """The backward's warps per program (``_BACKWARD_SIZING``)."""
    for largest, warps, _ in _BACKWARD_SIZING:
        if n <= largest:
            return num_warps(n, rows_per_block) if warps is None else warps
    return num_warps(n, rows_per_block)


def backward_programs(n: int, rows: int, rows_per_block: int, sms: int | None = None) -> int:
    """The backward's persistent programs: ``_BACKWARD_SIZING``'s programs per SM on
    each of the ``sms`` SMs (default: the GPU being compiled for's), fewer (down to one per
    SM) where a program would get fewer than 4 rows, at most one per row block, and
    above one per SM a whole multiple of the SMs (no partial wave)."""
    sms = target().sms if sms is None else sms
    per_sm = next((p for largest, _, p in _BACKWARD_SIZING if n <= largest), 1)
    enough_rows = max(sms, pl.cdiv(rows, _MIN_ROWS_PER_PROGRAM))
    programs = max(1, min(pl.cdiv(rows, rows_per_block), sms * per_sm, enough_rows))
    return programs // sms * sms if programs > sms else programs


def block_sizes(n: int, rows: int, rows_per_block, interpret: bool) -> tuple[int, int]:
    """(padded features, rows per block) of a call."""
    npad = padded_features(n)
    if rows_per_block is None:
        rows_per_block = default_block_rows(n, rows)
        if interpret:
            while pl.cdiv(rows, rows_per_block) > _INTERPRET_MAX_BLOCKS:
                rows_per_block *= 2
    elif rows_per_block < 1 or rows_per_block & (rows_per_block - 1):
        raise ValueError(
            f"block_rows must be a positive power of two (Triton's block shapes are), got "
            f"{rows_per_block}; pass e.g. {pl.next_power_of_2(max(rows_per_block, 1))}, or "
            f"None for the default sizing."
        )
    return npad, rows_per_block


def warps_or_default(warps: int | None, default: int) -> int:
    if warps is None:
        return default
    if warps < 1 or warps & (warps - 1) or warps > 32:
        raise ValueError(
            f"warps must be a power of two from 1 to 32 (Triton's num_warps), got {warps}; "
            f"pass None for the default sizing."
        )
    return warps
