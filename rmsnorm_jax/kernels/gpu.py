"""Pallas-Triton kernels for NVIDIA GPUs: RMSNorm in one pass forward and one pass backward.

The contract is ``_spec.py``'s (``fits``, ``forward``, ``backward``); the maths is its
per-row helpers, called on float32 blocks inside the kernel bodies, so these kernels and
the XLA path of ``_vjp.py`` compute the same formula:

    ms   = (1/k) sum_{i<k} x_i^2           (float32, the first k of the n features)
    stat = rsqrt(ms + eps)  ("inside")  or  sqrt(ms)  ("outside")
    y    = (scale + scale_offset) * x * r + bias,  r = stat or 1 / (stat + eps)

Dtypes: x (and residual, dy, dh) float32, bfloat16 or float16; everything is computed in
float32; y is written in ``spec.out_dtype``, h in ``h_dtype``, dx in ``dx_dtype``, the
statistic and the parameter-gradient partial sums in float32.

Memory schedule (one HBM pass each way):

- forward: a grid of ``cdiv(rows, block_rows)`` programs; each loads ``block_rows`` whole
  rows once (x, and the residual for ``add_rms_norm``), keeps them in registers, and writes
  y (and h) and the per-row statistic. Nothing else of full size is read or written.
- backward: a persistent grid of a fixed number of programs (:func:`backward_programs`,
  a few per H100 SM); program ``p`` walks the row blocks ``p, p + P, p + 2P, ...``, reads
  x, dy (and dh) and the statistic once, writes dx, and accumulates the scale and bias
  gradients of its rows in registers. It writes one float32 row of partial sums per
  program, shape ``(programs, n)``, which the caller sums over axis 0: deterministic
  (a fixed order, no atomics), and small beside x.

Triton needs power-of-two block shapes, so a row of n features is loaded as a block of
``next_power_of_2(n)`` columns with a masked load (padding reads 0) and a masked store;
rows past the end of the array (the last partial block) are masked the same way and
never enter the partial sums.

``interpret=True`` runs the same kernel bodies on CPU in Pallas interpret mode (tests).

Example (interpret mode, on CPU; FACTS.md's first worked example)::

>>> import jax.numpy as jnp, numpy as np
>>> from rmsnorm_jax.kernels._spec import KernelSpec
>>> spec = KernelSpec(n=4, k=4, eps=0.0, inside=True, scale_offset=0.0,
...                   has_scale=False, has_bias=False, out_dtype=np.dtype("float32"))
>>> x = jnp.array([[1.0, 2.0, 3.0, 4.0], [-1.0, -2.0, -3.0, -4.0]])
>>> y, stat, h = forward(spec, x, None, None, interpret=True)
>>> [[round(float(v), 4) for v in row] for row in y]
[[0.3651, 0.7303, 1.0954, 1.4606], [-0.3651, -0.7303, -1.0954, -1.4606]]
>>> round(float(1 / stat[0] ** 2), 5)   # the mean square: (1 + 4 + 9 + 16) / 4
7.5
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

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
    "backward",
    "backward_programs",
    "backward_warps",
    "default_block_rows",
    "fits",
    "forward",
    "num_warps",
    "padded_features",
]

_F32 = jnp.float32
_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))

# ---------------------------------------------------------------- block sizing
#
# A program holds its block of rows in registers, in float32 once loaded. Triton needs
# power-of-two blocks, so a row of n features is a block of ``padded_features(n)``
# columns (5120 is padded to 8192, 3000 to 4096) with masked loads and stores.
#
# - Rows per block: _BLOCK_ELEMENTS (4096) // padded features, at least 1 (1 row for
#   n >= 4096, 4 rows for n = 1000, 32 rows for n = 128): short rows still give a
#   program 16 KiB of float32 in flight.
# - num_warps (the forward's, and the backward's up to 4096 features): 16 float32
#   elements per thread per array, between 1 and 8 warps (Triton's LayerNorm tutorial's
#   shape). The forward's warps were 16 for one row padded to 8192 until the H200 sweep
#   below: 8 warps are as fast or faster at every width there (bfloat16 n = 5120:
#   21.7 against 24.3 us).
# - The backward is persistent: a fixed grid of programs, each walking the row blocks
#   ``p, p + P, ...`` and keeping its scale/bias gradient sums in registers, so it writes
#   one float32 row of partial sums per program. Its (warps, programs per SM) come from
#   _BACKWARD_SIZING, by padded width, measured on an H200 (132 SMs, jax 0.11.2): the
#   kernels alone, CUPTI device time, x of 32 MiB, every (warps, programs) pair of
#   {default, 4, 8} x {1, 2, 4 per SM, one per row block}
#   (``python -m benchmarks.kernel_sizes``, benchmarks/results/kernel-sizes-h200.json):
#
#   padded 4096: 8 warps, 2 programs per SM. float32 4096 (2048 rows) 29.7 us against
#     40.4 with the former 1 per SM (the former rule dropped to one per SM below 8 rows a
#     program; 7.75 rows a program is faster); bfloat16 4096: 33.6 (as before).
#   padded 8192, n <= 6144: 4 warps, 2 programs per SM. bfloat16 5120: 34.2 us against
#     47.2 with the former 16 warps x 1 per SM; float32 5120: 32.3 against 38.0.
#   padded 8192, n > 6144: 8 warps, 1 program per SM. bfloat16 8192: 43.8 against 45.5
#     (4 warps: 66-77, they spill); float32 8192: 36.6 against 36.3.
#
#   Why, from ``ptxas -v`` (sm_90a) on the deviceless H100 compile's PTX (jax 0.10.2),
#   registers a thread of the backward (none spills unless said): bfloat16 5120: 4 warps
#   237, 8 warps 152, 16 warps 108; float32 5120: 232, 128, 80; bfloat16 8192: 255 and
#   476 bytes of spills, 192, 108; float32 8192: 255 and 376 bytes of spills, 193, 110.
#   An SM has 65536 registers, so two programs fit on one SM only at 5120 with 4 warps
#   (2 x 128 x 237) or float32 5120 with 8 (2 x 256 x 128); those are the fast pairs at
#   two programs an SM, and every pair that leaves a second wave (bfloat16 5120 with 8
#   warps and 264 programs: 49.2 us) or one program an SM is slower. A program syncs its
#   warps for each row's sums; a second resident program keeps the SM's loads going
#   meanwhile (the likely reason; not profiled). At 8192 no width of program fits twice
#   without spilling: one an SM, 8 warps.
# - _MAX_FEATURES = 8192: at 16384 the backward reaches 128 registers a thread at 16
#   warps and spills 204-2056 bytes a thread (ptxas -v, sm_90a, deviceless H100 compile,
#   jax 0.10.2); the forward never spills. Wider rows stay on XLA (``fits`` is False).
# - At most one program per row block, and at least _MIN_ROWS_PER_PROGRAM (4) rows a
#   program while that leaves one program per SM or more (1024 rows of 4096 get 132).
#
# Nothing here is autotuned; ``block_rows``, ``warps`` and ``programs`` can be
# overridden per call.

_BLOCK_ELEMENTS = 4096
_ELEMENTS_PER_THREAD = 16
_MAX_WARPS = 8
_MAX_FEATURES = 8192
_DEFAULT_SMS = 132  # an H100 SXM, where the GPU being compiled for is not known
_MIN_ROWS_PER_PROGRAM = 4
# (largest n, warps or None for num_warps, programs per SM), by padded width.
_BACKWARD_SIZING = ((4096, None, 2), (6144, 4, 2), (8192, 8, 1))
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


def multiprocessors() -> int:
    """The SMs of the GPU being compiled for: the device of the abstract mesh being
    traced for (``rmsnorm_jax.aot`` targets, ``jax.set_mesh``), else the default GPU,
    else an H100's 132."""
    try:
        cores = getattr(jax.sharding.get_abstract_mesh().abstract_device, "num_cores", None)
    except (AttributeError, ValueError):  # no mesh, or one without a device kind
        cores = None
    if not cores:
        device = jax.devices()[0]
        cores = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(cores) if cores and cores > 1 else _DEFAULT_SMS


def backward_warps(n: int, rows_per_block: int) -> int:
    """The backward's warps per program (``_BACKWARD_SIZING``)."""
    for largest, warps, _ in _BACKWARD_SIZING:
        if n <= largest:
            return num_warps(n, rows_per_block) if warps is None else warps
    return num_warps(n, rows_per_block)


def backward_programs(n: int, rows: int, rows_per_block: int, sms: int | None = None) -> int:
    """The backward's persistent programs: ``_BACKWARD_SIZING``'s programs per SM on
    each of the ``sms`` SMs (default :func:`multiprocessors`), fewer (down to one per
    SM) where a program would get fewer than 4 rows, at most one per row block, and
    above one per SM a whole multiple of the SMs (no partial wave)."""
    sms = multiprocessors() if sms is None else sms
    per_sm = next((p for largest, _, p in _BACKWARD_SIZING if n <= largest), 1)
    enough_rows = max(sms, pl.cdiv(rows, _MIN_ROWS_PER_PROGRAM))
    programs = max(1, min(pl.cdiv(rows, rows_per_block), sms * per_sm, enough_rows))
    return programs // sms * sms if programs > sms else programs


def fits(spec: KernelSpec, rows: int, x_dtype, **call_dtypes) -> bool:
    """Whether these kernels take the call: float32, bfloat16 or float16 input and
    output, at least one row, and at most 8192 features (see the block sizing above:
    wider rows spill registers in the backward, so they stay on XLA). The call's other
    dtypes (``kind``, ``residual_dtype``, ``h_dtype``, ``dx_dtype``, as ``tpu.fits``
    takes them) do not change it.

    >>> import numpy as np
    >>> spec = KernelSpec(n=16384, k=16384, eps=1e-6, inside=True, scale_offset=0.0,
    ...                   has_scale=True, has_bias=False, out_dtype=np.dtype("float32"))
    >>> fits(spec, 8, np.float32)
    False
    """
    return (
        np.dtype(x_dtype) in _DTYPES
        and np.dtype(spec.out_dtype) in _DTYPES
        and 1 <= spec.k <= spec.n <= _MAX_FEATURES
        and 1 <= rows < 2**31
    )


def _sizes(spec: KernelSpec, rows: int, rows_per_block, interpret: bool) -> tuple[int, int]:
    """(padded features, rows per block) of a call."""
    npad = padded_features(spec.n)
    if rows_per_block is None:
        rows_per_block = default_block_rows(spec.n, rows)
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


def _warps(warps: int | None, default: int) -> int:
    if warps is None:
        return default
    if warps < 1 or warps & (warps - 1) or warps > 32:
        raise ValueError(
            f"warps must be a power of two from 1 to 32 (Triton's num_warps), got {warps}; "
            f"pass None for the default sizing."
        )
    return warps


# ---------------------------------------------------------------- argument checks


def _check_rows(name: str, a, spec: KernelSpec, rows: int | None = None) -> None:
    if a.ndim != 2 or a.shape[1] != spec.n or (rows is not None and a.shape[0] != rows):
        want = f"({'rows' if rows is None else rows}, {spec.n})"
        raise ValueError(
            f"{name} must have shape {want} (rows of spec.n = {spec.n} features), got "
            f"{a.shape}; reshape it to (-1, {spec.n}) first."
        )
    if np.dtype(a.dtype) not in _DTYPES:
        raise TypeError(
            f"{name} has dtype {a.dtype}; the GPU kernels take float32, bfloat16 or "
            f"float16 (use implementation='xla' for other dtypes)."
        )


def _check_param(name: str, a, present: bool, spec: KernelSpec) -> None:
    flag = f"spec.has_{name}"
    if present and a is None:
        raise ValueError(f"{name} is None but {flag} is True; pass the {name} or fix the spec.")
    if not present and a is not None:
        raise ValueError(f"{name} was given but {flag} is False; pass None or fix the spec.")
    if a is not None and a.shape != (spec.n,):
        raise ValueError(
            f"{name} must have shape ({spec.n},), got {a.shape}; reshape it to ({spec.n},)."
        )


def _check_out_dtype(name: str, dtype) -> np.dtype:
    if dtype is None or np.dtype(dtype) not in _DTYPES:
        raise TypeError(
            f"{name} must be float32, bfloat16 or float16 for the GPU kernels, got {dtype} "
            f"(use implementation='xla' for other dtypes)."
        )
    return np.dtype(dtype)


# ---------------------------------------------------------------- kernel bodies


def _block(ref, r0, rows_per_block: int, npad: int):
    """The (rows_per_block, npad) window of a (rows, n) ref starting at row r0.

    Indexed by arrays of row and column numbers (Triton's pointer arithmetic), not by
    slices: the window may reach past the array's last row and column, and the caller
    masks those elements. A slice past the end is refused by Pallas since jax 0.12
    ("Out of bound slice"); an index array is bounds-free, as in jax's own Pallas-Triton
    ``rms_norm``.
    """
    return ref.at[_span(r0, rows_per_block)[:, None], _span(0, npad)[None, :]]


def _span(start, size: int) -> jax.Array:
    """The indices ``start, ..., start + size - 1`` (some may lie past the array)."""
    return start + jnp.arange(size)


def _forward_kernel(*refs, spec, rows, rows_per_block, npad, has_residual, interpret):
    refs = list(refs)
    x_ref = refs.pop(0)
    res_ref = refs.pop(0) if has_residual else None
    scale_ref = refs.pop(0) if spec.has_scale else None
    bias_ref = refs.pop(0) if spec.has_bias else None
    y_ref, stat_ref, *h_ref = refs

    r0 = pl.program_id(0) * rows_per_block
    row_ok = (r0 + jnp.arange(rows_per_block)) < rows
    cols = jnp.arange(npad)
    col_ok = cols < spec.n
    col = cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]

    x = plgpu.load(_block(x_ref, r0, rows_per_block, npad), mask=mask, other=0.0)
    if has_residual:
        (h_ref,) = h_ref
        res = plgpu.load(_block(res_ref, r0, rows_per_block, npad), mask=mask, other=0.0)
        # Triton rounds h to h_dtype before it is widened again, so the statistic is
        # that of the h written (the backward's residual). Interpret mode runs this
        # body as XLA ops, which may keep float32 values instead (excess precision);
        # ``added`` keeps the roundings there (float16 subnormals too).
        h = added(x, res, h_ref.dtype, keep=interpret)
        plgpu.store(_block(h_ref, r0, rows_per_block, npad), h, mask=mask)
        x = h
    xf = x.astype(_F32)

    def vector(ref):
        if ref is None:
            return None
        return plgpu.load(ref.at[_span(0, npad)], mask=col_ok, other=0.0).astype(_F32)

    stat = stat_from_ms(spec, mean_square(spec, xf, col))
    y = normalized(spec, xf, stat, vector(scale_ref), vector(bias_ref))
    plgpu.store(_block(y_ref, r0, rows_per_block, npad), y.astype(y_ref.dtype), mask=mask)
    plgpu.store(stat_ref.at[_span(r0, rows_per_block)], stat.reshape(-1), mask=row_ok)


def _backward_kernel(*refs, spec, rows, rows_per_block, npad, programs, steps, has_dh):
    refs = list(refs)
    x_ref, dy_ref, stat_ref = refs[:3]
    del refs[:3]
    scale_ref = refs.pop(0) if spec.has_scale else None
    dh_ref = refs.pop(0) if has_dh else None
    dx_ref = refs.pop(0)
    dscale_ref = refs.pop(0) if spec.has_scale else None
    dbias_ref = refs.pop(0) if spec.has_bias else None

    program = pl.program_id(0)
    cols = jnp.arange(npad)
    col_ok = cols < spec.n
    col = cols[None, :]
    scale_f = None
    if scale_ref is not None:
        scale_f = plgpu.load(scale_ref.at[_span(0, npad)], mask=col_ok, other=0.0)
        scale_f = scale_f.astype(_F32)[None, :]

    def step(i, sums):
        # Row block program + i * programs: consecutive programs read neighbouring rows.
        r0 = (program + i * programs) * rows_per_block
        row_ok = (r0 + jnp.arange(rows_per_block)) < rows
        mask = row_ok[:, None] & col_ok[None, :]
        xf = plgpu.load(_block(x_ref, r0, rows_per_block, npad), mask=mask, other=0.0)
        dyf = plgpu.load(_block(dy_ref, r0, rows_per_block, npad), mask=mask, other=0.0)
        xf, dyf = xf.astype(_F32), dyf.astype(_F32)
        # Rows past the end read a statistic of 1: finite for every eps placement.
        stat = plgpu.load(stat_ref.at[_span(r0, rows_per_block)], mask=row_ok, other=1.0)
        stat = stat[:, None]
        dx = input_grad(spec, xf, dyf, stat, scale_f, col)
        if dh_ref is not None:
            dh = plgpu.load(_block(dh_ref, r0, rows_per_block, npad), mask=mask, other=0.0)
            dx = dx + dh.astype(_F32)
        plgpu.store(_block(dx_ref, r0, rows_per_block, npad), dx.astype(dx_ref.dtype), mask=mask)
        dscale_sum, dbias_sum = sums
        # The masks keep the rows past the end out of the sums even where the
        # statistic's formula gives inf or nan (eps = 0 with "outside").
        if dscale_sum is not None:
            dyhat = jnp.where(mask, dyf * (xf * inv_rms(spec, stat)), 0.0)
            dscale_sum = dscale_sum + jnp.sum(dyhat, axis=0)
        if dbias_sum is not None:
            dbias_sum = dbias_sum + jnp.sum(jnp.where(mask, dyf, 0.0), axis=0)
        return dscale_sum, dbias_sum

    zeros = jnp.zeros((npad,), _F32)
    init = (zeros if spec.has_scale else None, zeros if spec.has_bias else None)
    dscale_sum, dbias_sum = jax.lax.fori_loop(0, steps, step, init)
    for ref, total in ((dscale_ref, dscale_sum), (dbias_ref, dbias_sum)):
        if ref is not None:
            plgpu.store(ref.at[program, _span(0, npad)], total, mask=col_ok)


# ---------------------------------------------------------------- the calls


def forward(
    spec: KernelSpec,
    x: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    residual: jax.Array | None = None,
    *,
    h_dtype=None,
    interpret: bool = False,
    block_rows: int | None = None,
    warps: int | None = None,
):
    """One pass: ``(y, stat, h)`` of rows ``x`` (``_spec.py``'s contract).

    Arguments:
      spec: the static description of the call (n, k, eps, placement, offset, dtypes).
      x: (rows, n) float32, bfloat16 or float16.
      scale, bias: (n,) in any of those dtypes, or None (as ``spec`` says).
      residual: (rows, n) or None. Given, ``h = x.astype(h_dtype) + residual.astype(h_dtype)``
        is written and normalized (``add_rms_norm``).
      h_dtype: dtype of h; required with ``residual``.
      interpret: run in Pallas interpret mode (CPU; tests).
      block_rows: rows per program (a power of two); None for the default sizing.
      warps: warps per program (a power of two); None for :func:`num_warps`.

    Returns:
      y (rows, n) in ``spec.out_dtype``; stat (rows,) float32, rsqrt(ms + eps) for
      "inside" or sqrt(ms) for "outside"; h (rows, n) in ``h_dtype``, or None.
    """
    _check_rows("x", x, spec)
    rows = x.shape[0]
    if residual is not None:
        _check_rows("residual", residual, spec, rows)
        h_dtype = _check_out_dtype("h_dtype", h_dtype)
    _check_param("scale", scale, spec.has_scale, spec)
    _check_param("bias", bias, spec.has_bias, spec)
    out_dtype = _check_out_dtype("spec.out_dtype", spec.out_dtype)
    npad, rows_per_block = _sizes(spec, rows, block_rows, interpret)

    inputs = [a for a in (x, residual, scale, bias) if a is not None]
    out_shape = [out_struct((rows, spec.n), out_dtype, x), out_struct((rows,), _F32, x)]
    if residual is not None:
        out_shape.append(out_struct((rows, spec.n), h_dtype, x))
    kernel = functools.partial(
        _forward_kernel,
        spec=spec,
        rows=rows,
        rows_per_block=rows_per_block,
        npad=npad,
        has_residual=residual is not None,
        interpret=interpret,
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(rows, rows_per_block),),
        compiler_params=plgpu.CompilerParams(
            num_warps=_warps(warps, num_warps(spec.n, rows_per_block))
        ),
        interpret=interpret,
        name="rms_norm_forward",
    )(*inputs)
    y, stat, *h = outs
    return y, stat, (h[0] if h else None)


def backward(
    spec: KernelSpec,
    x: jax.Array,
    dy: jax.Array,
    stat: jax.Array,
    scale: jax.Array | None,
    dh: jax.Array | None = None,
    *,
    dx_dtype,
    interpret: bool = False,
    block_rows: int | None = None,
    programs: int | None = None,
    warps: int | None = None,
):
    """One pass: ``(dx, dscale_partials, dbias_partials)`` (``_spec.py``'s contract).

    ``dx = r * gdy - [col < k] * x * r * alpha * (1/k) * sum_j gdy_j x_j r`` with
    ``gdy = (scale + offset) * dy`` (``_spec.input_grad``), plus ``dh`` when given.

    Arguments:
      spec: the static description of the call.
      x: (rows, n), the normalized rows (h for ``add_rms_norm``).
      dy: (rows, n), the cotangent of y. stat: (rows,) float32, the forward's statistic.
      scale: (n,) or None. dh: (rows, n) or None, added to dx.
      dx_dtype: dtype of dx (float32, bfloat16 or float16).
      interpret: run in Pallas interpret mode (CPU; tests).
      block_rows: rows per block (a power of two); None for the default sizing.
      programs: the persistent grid's size; None for :func:`backward_programs`.
      warps: warps per program (a power of two); None for :func:`backward_warps`.

    Returns:
      dx (rows, n) in ``dx_dtype``; dscale_partials and dbias_partials (programs, n)
      float32, the sums of dy * xhat and of dy over each program's rows (None where
      ``spec`` has no scale / bias); their sum over axis 0 is the gradient.
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
    dx_dtype = _check_out_dtype("dx_dtype", dx_dtype)
    npad, rows_per_block = _sizes(spec, rows, block_rows, interpret)
    blocks = pl.cdiv(rows, rows_per_block)
    if programs is None:
        programs = backward_programs(spec.n, rows, rows_per_block)
    elif not 1 <= programs <= blocks:
        raise ValueError(
            f"programs must be between 1 and the {blocks} row blocks of this call, got "
            f"{programs}; pass None for the default."
        )

    inputs = [a for a in (x, dy, stat.astype(_F32), scale, dh) if a is not None]
    out_shape = [out_struct((rows, spec.n), dx_dtype, x)]
    partials = out_struct((programs, spec.n), _F32, x)
    out_shape += [partials] * (int(spec.has_scale) + int(spec.has_bias))
    kernel = functools.partial(
        _backward_kernel,
        spec=spec,
        rows=rows,
        rows_per_block=rows_per_block,
        npad=npad,
        programs=programs,
        steps=math.ceil(blocks / programs),
        has_dh=dh is not None,
    )
    dx, *sums = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(programs,),
        compiler_params=plgpu.CompilerParams(
            num_warps=_warps(warps, backward_warps(spec.n, rows_per_block))
        ),
        interpret=interpret,
        name="rms_norm_backward",
    )(*inputs)
    it = iter(sums)
    dscale = next(it) if spec.has_scale else None
    dbias = next(it) if spec.has_bias else None
    return dx, dscale, dbias
