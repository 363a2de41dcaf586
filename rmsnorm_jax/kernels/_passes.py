"""The kernels' passes: each device's forward and backward on its rows (a backend's kernel
or, where a row does not fit it, the XLA path), their ``vmap`` and sharding wrappers, and
the differentiation rules of ``rms_norm_kernel`` and ``add_rms_norm_kernel`` (see the
package docstring)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from .._backends import vma
from .._fused_vjp import add_tangent
from .._linear import tangents_of
from .._vjp import (
    OUT_NAME,
    STAT_NAME,
    NormConfig,
    _explicit_spec,
    backward_parts,
    match_vma,
    normalized,
    output,
    output_tangent,
    row_statistic,
    tangent_parts,
)
from ._sharding import ROWS, STAT, SUM, rowwise
from ._spec import KernelSpec

# ---------------------------------------------------------------- per-device passes


def _rows(a: jax.Array | None, n: int):
    return None if a is None else a.reshape(-1, n)


def _forward_local(cfg: NormConfig, spec: KernelSpec, h_dtype, rows, params, xla_only=False):
    """``(y, stat[, h])`` of this device's rows: a backend's kernel, or the XLA path."""
    x, residual = rows
    scale, bias = params
    n = spec.n

    def kernel(backend, interpret):
        def run(x, residual, scale, bias):
            y, stat, h = backend.forward(
                spec,
                _rows(x, n),
                scale,
                bias,
                _rows(residual, n),
                h_dtype=h_dtype,
                interpret=interpret,
            )
            out = (y.reshape(x.shape), stat.reshape((*x.shape[:-1], 1)))
            return out if h is None else (*out, h.reshape(x.shape))

        return run

    def xla(x, residual, scale, bias):
        h = x if residual is None else x.astype(h_dtype) + residual.astype(h_dtype)
        last = _last_axis(cfg, h.ndim)
        row_stat = row_statistic(last, h, None)
        y = output(last, normalized(last, h, scale, bias, row_stat))
        return (y, row_stat) if residual is None else (y, row_stat, h)

    call = dict(
        kind="forward",
        residual_dtype=None if residual is None else residual.dtype,
        h_dtype=None if residual is None else np.dtype(h_dtype),
    )
    return _per_platform(spec, x, kernel, xla, (x, residual, scale, bias), xla_only, call)


def _backward_local(cfg: NormConfig, spec: KernelSpec, dx_dtype, rows, params, xla_only=False):
    """``(dx, dscale, dbias)`` of this device's rows; the parameter gradients are float32
    sums over these rows (None where the parameter is absent)."""
    x, dy, stat, dh = rows
    (scale,) = params
    n = spec.n

    def kernel(backend, interpret):
        def run(x, dy, stat, dh, scale):
            dx, dscale, dbias = backend.backward(
                spec,
                _rows(x, n),
                _rows(dy, n),
                stat.reshape(-1),
                scale,
                _rows(dh, n),
                dx_dtype=dx_dtype,
                interpret=interpret,
            )
            sums = tuple(jnp.sum(p, 0) for p in (dscale, dbias) if p is not None)
            return (dx.reshape(x.shape), *sums)

        return run

    def xla(x, dy, stat, dh, scale):
        # Sums over this device's rows only, as the kernels' (the caller sums across
        # devices): parameters typed as varying like x, so nothing is psum-ed here.
        rows_vma = vma(jax.typeof(x))
        f32 = jax.typeof(_varying(jnp.zeros((n,), jnp.float32), rows_vma))
        local_cfg = dataclasses.replace(
            _last_axis(cfg, x.ndim), bias_type=f32 if spec.has_bias else None
        )
        vector_scale = None if scale is None else _varying(scale.astype(jnp.float32), rows_vma)
        dx, dscale, dbias = backward_parts(local_cfg, x, vector_scale, None, stat, dy)
        if dh is not None:
            dx = dx + dh.astype(dx.dtype)
        sums = tuple(p.reshape(n) for p in (dscale, dbias) if p is not None)
        return (dx.astype(dx_dtype), *sums)

    call = dict(
        kind="backward",
        residual_dtype=None if dh is None else dh.dtype,
        dx_dtype=np.dtype(dx_dtype),
    )
    return _per_platform(spec, x, kernel, xla, (x, dy, stat, dh, scale), xla_only, call)


def _varying(a: jax.Array, axes: frozenset) -> jax.Array:
    """``a`` marked as varying along the mesh ``axes`` it does not vary along yet."""
    extra = tuple(sorted(axes - vma(jax.typeof(a))))
    return lax.pcast(a, extra, to="varying") if extra else a


def _last_axis(cfg: NormConfig, ndim: int) -> NormConfig:
    """``cfg`` for an array of ``ndim`` dims normalized over its last axis (the kernels'
    calls may carry more leading dims than the user's, e.g. under ``vmap``)."""
    return dataclasses.replace(cfg, axes=(ndim - 1,))


def _per_platform(spec, x, kernel, xla, operands, xla_only=False, call=None):
    """The kernels of the platform being lowered for, where a row fits their blocks
    (``call``: the kernel and the dtypes of this call, for ``backend.fits``)."""
    if xla_only:
        return xla(*operands)
    from . import gpu, tpu  # imported on first use: Pallas loads only for the kernels

    rows = math.prod(x.shape[:-1])

    def choose(backend, interpret=False):
        fits = backend.fits(spec, rows, x.dtype, **(call or {}))
        return kernel(backend, interpret) if fits else xla

    # Pallas' interpreter cannot run inside a shard_map that checks varying axes (its
    # padding breaks the check, jax 0.10): there the CPU computes the call with XLA.
    interpretable = not vma(jax.typeof(x))
    on = spec.platforms
    return lax.platform_dependent(
        *operands,
        cuda=choose(gpu) if "cuda" in on else xla,
        tpu=choose(tpu) if "tpu" in on else xla,
        rocm=xla,
        default=choose(gpu, interpret=True) if interpretable and "cpu" in on else xla,
    )


# ---------------------------------------------------------------- vmap and sharding


def _forward_op(cfg, spec, h_dtype, x, residual, scale, bias):
    kinds = (ROWS, STAT) if residual is None else (ROWS, STAT, ROWS)
    local = functools.partial(_forward_local, cfg, spec, h_dtype)

    @jax.custom_batching.custom_vmap
    def op(x, residual, scale, bias):
        return rowwise(local, [x, residual], [scale, bias], kinds)

    @op.def_vmap
    def _batched(axis_size, in_batched, x, residual, scale, bias):
        # Under vmap the mapped axis is one more leading dim of rows, unless a parameter
        # is mapped too: then each example has its own parameters and XLA computes it.
        x_b, r_b, s_b, b_b = in_batched
        if s_b or b_b:
            outs = jax.vmap(
                lambda *a: tuple(local([a[0], a[1]], [a[2], a[3]], xla_only=True)),
                in_axes=tuple(0 if b else None for b in in_batched),
            )(x, residual, scale, bias)
        else:
            if not x_b:
                x = jnp.broadcast_to(x, (axis_size, *x.shape))
            if residual is not None and not r_b:
                residual = jnp.broadcast_to(residual, (axis_size, *residual.shape))
            outs = op(x, residual, scale, bias)
        return outs, tuple(True for _ in outs)

    def xla(x, residual, scale, bias):
        return tuple(local([x, residual], [scale, bias], xla_only=True))

    return _with_xla_derivative(op, xla)(x, residual, scale, bias)


def _backward_op(cfg, spec, dx_dtype, x, dy, stat, dh, scale):
    kinds = (ROWS, *(SUM for p in (spec.has_scale, spec.has_bias) if p))
    local = functools.partial(_backward_local, cfg, spec, dx_dtype)

    @jax.custom_batching.custom_vmap
    def op(x, dy, stat, dh, scale):
        return rowwise(local, [x, dy, stat, dh], [scale], kinds)

    @op.def_vmap
    def _batched(axis_size, in_batched, x, dy, stat, dh, scale):
        # Each example needs its own parameter gradients: the kernels' partial sums mix
        # examples, so under vmap the backward is XLA's (the forward keeps the kernel).
        outs = jax.vmap(
            lambda *a: tuple(local([a[0], a[1], a[2], a[3]], [a[4]], xla_only=True)),
            in_axes=tuple(0 if b else None for b in in_batched),
        )(x, dy, stat, dh, scale)
        return outs, tuple(True for _ in outs)

    def xla(x, dy, stat, dh, scale):
        return tuple(local([x, dy, stat, dh], [scale], xla_only=True))

    return _with_xla_derivative(op, xla)(x, dy, stat, dh, scale)


def _with_xla_derivative(kernel_fn, xla_fn):
    """``kernel_fn``, differentiated as ``xla_fn`` (the same function in XLA): a kernel
    call has no derivative of its own, and is differentiated only when a derivative is
    differentiated again (grad-of-grad, ``jax.hessian``, jvp of grad)."""

    @jax.custom_jvp
    def wrapped(*args):
        return kernel_fn(*args)

    @wrapped.defjvp
    def _jvp(primals, tangents):
        _, out_dot = jax.jvp(xla_fn, primals, tangents)
        return wrapped(*primals), out_dot

    return wrapped


def _cotangent(ct, primal_type):
    """``ct`` in its primal's type: shape, dtype, varying axes and explicit sharding (a
    parameter split over an explicit mesh axis gets its gradient split alike; the
    kernels' sums come back replicated)."""
    if ct is None:
        return None
    ct = ct.reshape(primal_type.shape).astype(primal_type.dtype)
    ct = match_vma(ct, vma(primal_type))
    spec = _explicit_spec(primal_type)
    if spec is not None and _explicit_spec(jax.typeof(ct)) != spec:
        ct = jax.sharding.reshard(ct, jax.sharding.PartitionSpec(*spec))
    return ct


def _parameter_cotangents(spec, sums, scale_type, bias_type):
    it = iter(sums)
    dscale = _cotangent(next(it), scale_type) if spec.has_scale else None
    dbias = _cotangent(next(it), bias_type) if spec.has_bias else None
    return dscale, dbias


def _param_vector(a, n):
    return None if a is None else a.reshape(n)


# ---------------------------------------------------------------- rms_norm


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def rms_norm_kernel(cfg: NormConfig, spec: KernelSpec, x, scale, bias):
    """``rms_norm`` of validated arrays by the fused kernels (see the module doc)."""
    return _fwd(cfg, spec, x, scale, bias)[0]


def _fwd(cfg, spec, x, scale, bias):
    y, stat = _forward_op(
        cfg, spec, None, x, None, _param_vector(scale, spec.n), _param_vector(bias, spec.n)
    )
    stat = checkpoint_name(stat, STAT_NAME)
    return checkpoint_name(y, OUT_NAME), (x, scale, stat)


def _bwd(cfg, spec, residuals, dy):
    x, scale, stat = residuals
    dx, *sums = _backward_op(cfg, spec, x.dtype, x, dy, stat, None, _param_vector(scale, spec.n))
    dscale, dbias = _parameter_cotangents(
        spec, sums, None if scale is None else jax.typeof(scale), cfg.bias_type
    )
    return match_vma(dx, vma(jax.typeof(x))), dscale, dbias


@functools.partial(rms_norm_kernel.defjvp, symbolic_zeros=True)
def _jvp(cfg, spec, primals, tangents):
    """Forward mode by the XLA tangent map around the kernel's output; reverse mode by
    its transpose, the kernel backward (``_linear``)."""
    y, res = _fwd(cfg, spec, *primals)

    def tangent(res, dparams):
        x, scale, stat = res
        return [output_tangent(cfg, tangent_parts(cfg, x, scale, None, stat, *dparams))]

    def backward(res, cts):
        return _bwd(cfg, spec, res, cts[0])

    (dy,) = tangents_of([y], res, tangents, tangent, backward)
    return y, dy


# ---------------------------------------------------------------- add_rms_norm


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def add_rms_norm_kernel(cfg: NormConfig, spec: KernelSpec, acfg, x, residual, scale, bias):
    """``add_rms_norm`` of validated arrays by the fused kernels: ``(y, h)``."""
    return _add_fwd(cfg, spec, acfg, x, residual, scale, bias)[0]


def _add_fwd(cfg, spec, acfg, x, residual, scale, bias):
    y, stat, h = _forward_op(
        cfg,
        spec,
        np.dtype(acfg.residual_dtype),
        x,
        residual,
        _param_vector(scale, spec.n),
        _param_vector(bias, spec.n),
    )
    stat = checkpoint_name(stat, STAT_NAME)
    return (checkpoint_name(y, OUT_NAME), h), (h, scale, stat)


def _add_bwd(cfg, spec, acfg, residuals, cotangents):
    h, scale, stat = residuals
    dy, dh_out = cotangents
    # One dh serves both inputs: written in the wider of their dtypes.
    dh_dtype = np.dtype(jnp.promote_types(acfg.x_type.dtype, acfg.residual_type.dtype))
    dh, *sums = _backward_op(cfg, spec, dh_dtype, h, dy, stat, dh_out, _param_vector(scale, spec.n))
    dscale, dbias = _parameter_cotangents(
        spec, sums, None if scale is None else jax.typeof(scale), cfg.bias_type
    )
    dx = match_vma(dh.astype(acfg.x_type.dtype), vma(acfg.x_type))
    dresidual = match_vma(dh.astype(acfg.residual_type.dtype), vma(acfg.residual_type))
    return dx, dresidual, dscale, dbias


@functools.partial(add_rms_norm_kernel.defjvp, symbolic_zeros=True)
def _add_jvp(cfg, spec, acfg, primals, tangents):
    outs, res = _add_fwd(cfg, spec, acfg, *primals)

    def tangent(res, dparams):
        h, scale, stat = res
        return add_tangent(cfg, acfg, (h, scale, None, stat), dparams)

    def backward(res, cts):
        return _add_bwd(cfg, spec, acfg, res, cts)

    dy, dh = tangents_of(outs, res, tangents, tangent, backward)
    return outs, (dy, dh)
