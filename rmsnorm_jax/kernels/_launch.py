"""How a kernel call reaches each device: the path ``_select.select`` chooses per platform
(a backend's kernels, or XLA), each device's own rows under sharding, ``vmap``, and a
derivative.

    forward_rows(call, x, residual, scale, bias) -> (y, stat[, h])
    backward_rows(call, x, dy, stat, dh, scale) -> (dx[, dscale][, dbias])

Each is one ``custom_jvp`` (a kernel has no derivative of its own: differentiated again,
as in grad-of-grad, it differentiates as its XLA twin ``forward_xla`` / ``backward_xla``)
around one ``custom_vmap`` (the mapped axis becomes more rows) around
``_sharding.rowwise`` (each device's rows), around ``lax.platform_dependent``: for each
platform, ``select``'s choice for this device's rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._config import NormConfig
from .._types import varying, vma
from .._xla.passes import backward_parts, normalized, output, row_statistic
from . import _device
from ._contract import KernelSpec
from ._select import Pass, Request, load, select
from ._sharding import ROWS, STAT, SUM, rowwise


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class RowCall:
    """The static part of one kernel call over rows of the last axis.

    Attributes:
      cfg: the norm's configuration (its axes are replaced by the last one here).
      spec: the kernels' description of the call.
      request: what the caller asked (``select`` reads it).
      h_dtype: dtype of ``h`` (forward with a residual), else None.
      dx_dtype: dtype of ``dx`` (backward), else None.
    """

    cfg: NormConfig
    spec: KernelSpec
    request: Request
    h_dtype: np.dtype | None = None
    dx_dtype: np.dtype | None = None


def _last_axis(cfg: NormConfig, ndim: int, **changes) -> NormConfig:
    """``cfg`` for rows of an ``ndim``-dim array normalized over its last axis (the
    kernels' calls may carry more leading dims than the user's, e.g. under ``vmap``)."""
    return dataclasses.replace(cfg, axes=(ndim - 1,), **changes)


def _rows(a: jax.Array | None, n: int):
    return None if a is None else a.reshape(-1, n)


# ---------------------------------------------------------------- one device, XLA


def forward_xla(call: RowCall, x, residual, scale, bias):
    """``(y, stat[, h])`` of the rows by the XLA path (the kernels' twin)."""
    h = x if residual is None else x.astype(call.h_dtype) + residual.astype(call.h_dtype)
    cfg = _last_axis(call.cfg, h.ndim)
    row_stat = row_statistic(cfg, h, None)
    y = output(cfg, normalized(cfg, h, scale, bias, row_stat))
    return (y, row_stat) if residual is None else (y, row_stat, h)


def backward_xla(call: RowCall, x, dy, stat, dh, scale):
    """``(dx[, dscale][, dbias])`` of the rows by the XLA path, the parameter gradients
    summed over these rows only (as the kernels'; the caller sums across devices)."""
    n = call.spec.n
    rows_vma = vma(jax.typeof(x))
    f32 = jax.typeof(varying(jnp.zeros((n,), jnp.float32), rows_vma))
    cfg = _last_axis(call.cfg, x.ndim, bias_type=f32 if call.spec.has_bias else None)
    scale_f32 = None if scale is None else varying(scale.astype(jnp.float32), rows_vma)
    dx, dscale, dbias = backward_parts(cfg, x, scale_f32, None, stat, dy)
    if dh is not None:
        dx = dx + dh.astype(dx.dtype)
    sums = tuple(p.reshape(n) for p in (dscale, dbias) if p is not None)
    return (dx.astype(call.dx_dtype), *sums)


# ---------------------------------------------------------------- one device, a kernel


def forward_kernel(backend, interpret: bool, call: RowCall, x, residual, scale, bias):
    """``(y, stat[, h])`` of the rows by ``backend.forward`` (``_contract.py``)."""
    n = call.spec.n
    y, stat, h = backend.forward(
        call.spec,
        _rows(x, n),
        scale,
        bias,
        _rows(residual, n),
        h_dtype=call.h_dtype,
        interpret=interpret,
    )
    out = (y.reshape(x.shape), stat.reshape((*x.shape[:-1], 1)))
    return _like_rows(x, out if h is None else (*out, h.reshape(x.shape)))


def backward_kernel(backend, interpret: bool, call: RowCall, x, dy, stat, dh, scale):
    """``(dx[, dscale][, dbias])`` of the rows by ``backend.backward``, the parameter
    gradients' partial sums summed here."""
    n = call.spec.n
    dx, dscale, dbias = backend.backward(
        call.spec,
        _rows(x, n),
        _rows(dy, n),
        stat.reshape(-1),
        scale,
        _rows(dh, n),
        dx_dtype=call.dx_dtype,
        interpret=interpret,
    )
    sums = tuple(jnp.sum(p, 0) for p in (dscale, dbias) if p is not None)
    return _like_rows(x, (dx.reshape(x.shape), *sums))


def _like_rows(x, outs: tuple) -> tuple:
    """The outputs of this device's rows, each marked varying along the mesh axes ``x``
    varies along inside ``shard_map``, as the XLA branch's are (a backend whose kernel
    call does not say so would give ``platform_dependent`` branches of other types)."""
    rows_vma = vma(jax.typeof(x))
    return tuple(varying(o, rows_vma) for o in outs)


def _on_device(kernel, xla, call: RowCall, operands, extra):
    """``kernel`` or ``xla`` of the platform being lowered for, on this device's rows, as
    ``select`` chooses (``extra``: the residual or ``dh``, whose dtype the kernels'
    ``fits`` reads)."""
    x = operands[0]
    step = Pass(
        kind="forward" if call.dx_dtype is None else "backward",
        rows=math.prod(x.shape[:-1]),
        x_dtype=np.dtype(x.dtype),
        residual_dtype=None if extra is None else np.dtype(extra.dtype),
        h_dtype=call.h_dtype,
        dx_dtype=call.dx_dtype,
    )
    target, version = _device.target(), _device.jax_version()
    checked = bool(vma(jax.typeof(x)))

    def on(platform: str):
        choice = select(call.request, call.spec, platform, step, target, version, checked=checked)
        if choice.backend is None:
            return functools.partial(xla, call)
        backend, _ = load(choice.backend)
        return functools.partial(kernel, backend, choice.interpret, call)

    return lax.platform_dependent(
        *operands, cuda=on("cuda"), tpu=on("tpu"), rocm=on("rocm"), default=on("cpu")
    )


def forward_on_device(call: RowCall, rows: list, params: list):
    """``(y, stat[, h])`` of this device's rows ``[x, residual]``."""
    return _on_device(forward_kernel, forward_xla, call, (*rows, *params), rows[1])


def backward_on_device(call: RowCall, rows: list, params: list):
    """``(dx[, dscale][, dbias])`` of this device's rows ``[x, dy, stat, dh]``."""
    return _on_device(backward_kernel, backward_xla, call, (*rows, *params), rows[3])


# ---------------------------------------------------------------- vmap and sharding


def _forward_kinds(residual) -> tuple[str, ...]:
    return (ROWS, STAT) if residual is None else (ROWS, STAT, ROWS)


def _backward_kinds(spec: KernelSpec) -> tuple[str, ...]:
    return (ROWS, *(SUM for present in (spec.has_scale, spec.has_bias) if present))


@jax.custom_batching.custom_vmap
def _forward_mapped(call: RowCall, x, residual, scale, bias):
    on_device = functools.partial(forward_on_device, call)
    return rowwise(on_device, [x, residual], [scale, bias], _forward_kinds(residual))


@_forward_mapped.def_vmap
def _forward_vmap(axis_size, in_batched, call, x, residual, scale, bias):
    """The mapped axis is more rows, unless a parameter is mapped too: then each example
    has its own parameters, and XLA computes it."""
    _, x_b, r_b, s_b, b_b = in_batched
    if s_b or b_b:
        in_axes = tuple(0 if b else None for b in in_batched[1:])
        outs = jax.vmap(functools.partial(forward_xla, call), in_axes=in_axes)(
            x, residual, scale, bias
        )
    else:
        if not x_b:
            x = jnp.broadcast_to(x, (axis_size, *x.shape))
        if residual is not None and not r_b:
            residual = jnp.broadcast_to(residual, (axis_size, *residual.shape))
        outs = _forward_mapped(call, x, residual, scale, bias)
    return outs, tuple(True for _ in outs)


@jax.custom_batching.custom_vmap
def _backward_mapped(call: RowCall, x, dy, stat, dh, scale):
    on_device = functools.partial(backward_on_device, call)
    return rowwise(on_device, [x, dy, stat, dh], [scale], _backward_kinds(call.spec))


@_backward_mapped.def_vmap
def _backward_vmap(axis_size, in_batched, call, x, dy, stat, dh, scale):
    """Each example needs its own parameter gradients, which the kernels' partial sums
    mix: under ``vmap`` the backward is XLA's (the forward keeps the kernel)."""
    in_axes = tuple(0 if b else None for b in in_batched[1:])
    outs = jax.vmap(functools.partial(backward_xla, call), in_axes=in_axes)(x, dy, stat, dh, scale)
    return outs, tuple(True for _ in outs)


# ---------------------------------------------------------------- a derivative


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def forward_rows(call: RowCall, x, residual, scale, bias):
    """``(y, stat[, h])`` by the kernels wherever they compute the call (module doc)."""
    return _forward_mapped(call, x, residual, scale, bias)


@forward_rows.defjvp
def _forward_rows_jvp(call, primals, tangents):
    _, out_dot = jax.jvp(functools.partial(forward_xla, call), primals, tangents)
    return forward_rows(call, *primals), out_dot


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def backward_rows(call: RowCall, x, dy, stat, dh, scale):
    """``(dx[, dscale][, dbias])`` by the kernels wherever they compute the call."""
    return _backward_mapped(call, x, dy, stat, dh, scale)


@backward_rows.defjvp
def _backward_rows_jvp(call, primals, tangents):
    _, out_dot = jax.jvp(functools.partial(backward_xla, call), primals, tangents)
    return backward_rows(call, *primals), out_dot
