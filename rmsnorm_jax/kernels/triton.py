"""Pallas-Triton kernels for NVIDIA GPUs: RMSNorm in one pass forward and one pass backward.

The contract is ``_contract.py``'s (``Backend``); the maths is its
per-row helpers, called on float32 blocks inside the kernel bodies, so these kernels and
the XLA path (``_xla/passes.py``) compute the same formula:

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
- backward: a persistent grid of a fixed number of programs (``triton_sizing.py``, a
  few per SM); program ``p`` walks the row blocks ``p, p + P, p + 2P, ...``, reads
  x, dy (and dh) and the statistic once, writes dx, and accumulates the scale and bias
  gradients of its rows in registers. It writes one float32 row of partial sums per
  program, shape ``(programs, n)``, which the caller sums over axis 0: deterministic
  (a fixed order, no atomics), and small beside x.

Triton needs power-of-two block shapes, so a row of n features is loaded as a block of
``next_power_of_2(n)`` columns with a masked load (padding reads 0) and a masked store;
rows past the end of the array (the last partial block) are masked the same way and
never enter the partial sums.

``interpret=True`` runs the same kernel bodies on CPU in Pallas interpret mode (tests).

Example (interpret mode, on CPU; the mean square of the first row is 7.5)::

>>> import jax.numpy as jnp, numpy as np
>>> from rmsnorm_jax.kernels import KernelSpec
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
from ._contract import (
    KERNEL_DTYPES,
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
from .triton_sizing import (
    MAX_FEATURES,
    backward_programs,
    backward_warps,
    block_sizes,
    num_warps,
    warps_or_default,
)

__all__ = ["LABEL", "NAME", "PLATFORM", "backward", "deprecated", "fits", "forward", "unusable"]

_F32 = jnp.float32
NAME = "triton"
LABEL = "Triton"
PLATFORM = "cuda"
_KERNELS = "the Triton kernels"


def unusable(target) -> str | None:
    """None: jax's Pallas-Triton lowers for every NVIDIA GPU it runs on (the registry,
    ``_select.py``, imports this module only where jax ships Pallas-Triton)."""
    return None


def deprecated(version: str) -> str | None:
    """Why ``"auto"`` must not take these kernels with jax ``version``: jax 0.11
    deprecated Pallas-Triton, and from there every lowering for a GPU warns."""
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) < (0, 11):
        return None
    return f"jax {version} deprecates Pallas-Triton (a warning at every GPU lowering)"


def fits(spec: KernelSpec, rows: int, x_dtype, **call_dtypes) -> bool:
    """Whether these kernels take the call: float32, bfloat16 or float16 input and
    output, at least one row, and at most ``triton_sizing.MAX_FEATURES`` (8192) features
    (wider rows spill registers in the backward, so they stay on XLA). The call's other
    dtypes (``kind``, ``residual_dtype``, ``h_dtype``, ``dx_dtype``: ``_contract.Backend``)
    do not change it.

    >>> import numpy as np
    >>> spec = KernelSpec(n=16384, k=16384, eps=1e-6, inside=True, scale_offset=0.0,
    ...                   has_scale=True, has_bias=False, out_dtype=np.dtype("float32"))
    >>> fits(spec, 8, np.float32)
    False
    """
    return (
        np.dtype(x_dtype) in KERNEL_DTYPES
        and np.dtype(spec.out_dtype) in KERNEL_DTYPES
        and 1 <= spec.k <= spec.n <= MAX_FEATURES
        and 1 <= rows < 2**31
    )


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
    """One pass: ``(y, stat, h)`` of rows ``x`` (the contract of ``_contract.py``).

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
    rows, h_dtype, out_dtype = check_forward(spec, x, scale, bias, residual, h_dtype, _KERNELS)
    npad, rows_per_block = block_sizes(spec.n, rows, block_rows, interpret)

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
            num_warps=warps_or_default(warps, num_warps(spec.n, rows_per_block))
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
    """One pass: ``(dx, dscale_partials, dbias_partials)`` (the contract of ``_contract.py``).

    ``dx = r * gdy - [col < k] * x * r * alpha * (1/k) * sum_j gdy_j x_j r`` with
    ``gdy = (scale + offset) * dy`` (``_contract.input_grad``), plus ``dh`` when given.

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
    rows, dx_dtype = check_backward(spec, x, dy, stat, scale, dh, dx_dtype, _KERNELS)
    npad, rows_per_block = block_sizes(spec.n, rows, block_rows, interpret)
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
            num_warps=warps_or_default(warps, backward_warps(spec.n, rows_per_block))
        ),
        interpret=interpret,
        name="rms_norm_backward",
    )(*inputs)
    it = iter(sums)
    dscale = next(it) if spec.has_scale else None
    dbias = next(it) if spec.has_bias else None
    return dx, dscale, dbias
