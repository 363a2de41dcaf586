"""The passes of RMSNorm on the XLA path, each written once: the statistic, the
normalisation, the analytic backward and the tangent map (``docs/derivatives.md``).

Everything here assumes validated arguments (``_config.py``). The arrays are ``x``,
``scale``, ``bias`` and ``mask`` (all but ``x`` may be None). A boolean ``mask`` restricts
the mean square to the positions where it is True (flax's masked statistics); every
position is still normalized.

The per-row residual ``row_stat`` is one float (at least float32) per row: the inverse
RMS ``r = rsqrt(ms + eps)`` for the "inside" placement, the RMS ``s = sqrt(ms)`` for
"outside" (from which ``r = 1 / (s + eps)`` is exact and ``dr/dms = -r**2 / (2 s)`` stays
defined). How a pass is expressed for one compiler is ``per_compiler.py``'s.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from .._config import NormConfig
from .._types import explicit_spec, match_vma, vma
from .per_compiler import cpu_barrier, on_backend, tpu_column_sum, two_stage_column_sum

STAT_NAME = "rms_norm_stat"
OUT_NAME = "rms_norm_out"


def _unit_axes(cfg: NormConfig, x, params) -> tuple[int, ...]:
    """The size-1 axes of ``x`` that are not normalized, that no parameter reaches
    (``params``, each broadcast from the right) and that carry no explicit sharding; none
    unless the rows still span two axes or more without them (``[1, T, H, D]``, not
    ``[1, T, D]``)."""
    reach = max((p.ndim for p in params if p is not None), default=0)
    spec = explicit_spec(jax.typeof(x)) or (None,) * x.ndim
    unit = tuple(
        i
        for i in range(x.ndim - reach)
        if isinstance(x.shape[i], int) and x.shape[i] == 1
        if i not in cfg.axes and spec[i] is None
    )
    return unit if x.ndim - len(cfg.axes) - len(unit) >= 2 else ()


def without_unit_axes(norm, cfg: NormConfig, rows: tuple, params: tuple):
    """``norm(cfg, rows)`` on the arrays ``rows`` (``x`` first, the others of its shape)
    without the size-1 axes of ``x`` that nothing reaches (a batch of one), and its output
    (an array or a tuple of them, each of ``x``'s shape) with those axes restored.

    Those axes are the ones not normalized, reached by no parameter in ``params``
    (``scale``, ``bias``, ``mask``, each broadcast from the right) and carrying no explicit
    sharding: without them no value and no parameter's shape changes. With them XLA:TPU
    can hold the backward's ``dy`` in two shapes, and then recomputes its producer in a
    pass of its own instead of folding ``dx`` into the next matmuls. They are dropped only
    where the rows keep two axes or more (a QK-norm's ``[1, T, H, D]``): a hidden norm's
    ``[1, T, D]`` without its batch axis made whole TPU steps need more temporary memory
    (``docs/xla-programs.md``, item 6).
    """
    unit = _unit_axes(cfg, rows[0], params)
    if not unit:
        return norm(cfg, rows)
    axes = tuple(a - sum(u < a for u in unit) for a in cfg.axes)
    outs = norm(dataclasses.replace(cfg, axes=axes), tuple(lax.squeeze(a, unit) for a in rows))
    return jax.tree.map(lambda a: lax.expand_dims(a, unit), outs)


def _partial_mask(cfg: NormConfig, shape: tuple[int, ...]) -> jax.Array:
    """``True`` where an element is among the first ``k`` of its row (row-major order).

    Size 1 along the batch axes, so that XLA fuses it as an iota compare. With
    ``axis_name`` the single normalized axis is split across devices, so the global
    position adds this device's offset.
    """
    mask_shape = tuple(d if i in cfg.axes else 1 for i, d in enumerate(shape))
    flat = jnp.zeros(mask_shape, jnp.int32)
    stride = 1
    for ax in reversed(cfg.axes):
        flat = flat + lax.broadcasted_iota(jnp.int32, mask_shape, ax) * stride
        stride *= shape[ax]
    if cfg.axis_name is not None:
        flat = flat + lax.axis_index(cfg.axis_name) * cfg.n
    return flat < cfg.k


def _kept_sharding(a: jax.Array, keep: tuple[int, ...]):
    """The output sharding of a sum over the axes not in ``keep`` on an explicit mesh
    (the kept axes keep theirs); None (XLA decides, as for ``jnp.sum``) otherwise."""
    aval = jax.typeof(a)
    spec = explicit_spec(aval)
    if spec is None:
        return None
    return jax.sharding.NamedSharding(
        aval.sharding.mesh, jax.sharding.PartitionSpec(*(spec[i] for i in keep))
    )


def _sum_of_products(a: jax.Array, b: jax.Array, keep: tuple[int, ...], accumulate) -> jax.Array:
    """``sum(a * b)`` in ``accumulate`` over every axis not in ``keep`` (size-1 dims kept).

    A ``dot_general`` with the kept axes as batch axes: XLA:CPU runs it as one fused
    multiply-reduce, faster than its generic reduction (``docs/cpu.md``).
    """
    contract = tuple(i for i in range(a.ndim) if i not in keep)
    total = lax.dot_general(
        a,
        b,
        ((contract, contract), (keep, keep)),
        preferred_element_type=accumulate,
        out_sharding=_kept_sharding(a, keep),
    )
    return total.reshape(tuple(a.shape[i] if i in keep else 1 for i in range(a.ndim)))


def _membership(cfg: NormConfig, shape: tuple[int, ...], mask) -> jax.Array | None:
    """Where an element enters the mean square: the mask, the first ``k``, or all (None)."""
    if mask is not None:
        return mask
    return _partial_mask(cfg, shape) if cfg.partial else None


def _inv_count(cfg: NormConfig, shape: tuple[int, ...], mask) -> jax.Array | float:
    """``1 / (elements per row in the mean square)``: ``1/k``, or per row for a mask.

    A row whose mask is all False counts 1, so its mean square is 0 and it is normalized
    like an all-zero row (finite, eps-limited), never 0/0.
    """
    if mask is None:
        return 1.0 / cfg.k
    count = jnp.sum(jnp.broadcast_to(mask, shape), cfg.axes, dtype=jnp.int32, keepdims=True)
    return 1.0 / jnp.maximum(count, 1).astype(cfg.compute_dtype)


def _row_sum_of_products(cfg: NormConfig, a: jax.Array, b: jax.Array) -> jax.Array:
    """Per-row ``sum(a * b)``, across devices too when the features are split."""
    keep = tuple(i for i in range(a.ndim) if i not in cfg.axes)
    total = _sum_of_products(a, b, keep, cfg.compute_dtype)
    if cfg.axis_name is not None:
        total = lax.psum(total, cfg.axis_name)
    return total


def _mean_square(cfg: NormConfig, x: jax.Array, mask=None) -> jax.Array:
    """Per-row mean of the squares of the first ``k`` elements (all of them for p = 1).

    The squares are a dot on ``x`` in its own dtype with compute-dtype accumulation
    (products of two 16-bit values are exact in float32). pRMSNorm with one local
    normalized axis slices the first ``k`` features, so the statistic reads only those;
    otherwise (several axes, features split across devices, a mask) the tail is masked
    (``docs/xla-programs.md``).
    """
    head = x
    if mask is None and cfg.partial and len(cfg.axes) == 1 and cfg.axis_name is None:
        head = lax.slice_in_dim(x, 0, cfg.k, axis=cfg.axes[0])
    elif mask is not None or cfg.partial:
        head = jnp.where(_partial_mask(cfg, x.shape) if mask is None else mask, x, 0)
    return _row_sum_of_products(cfg, head, head) * _inv_count(cfg, x.shape, mask)


def _scaled(cfg: NormConfig, a: jax.Array, scale) -> jax.Array:
    """``a * (scale + scale_offset)`` in the compute dtype, or ``a`` without a scale.

    ``scale + scale_offset`` is formed once, before the product, on every backend: ``y``
    is ``a * gain`` rounded once, as in the kernels (``a * scale + a`` cancels where
    ``1 + scale`` is near 0).
    """
    if scale is None:
        return a
    factor = scale.astype(cfg.compute_dtype)
    if cfg.scale_offset:
        factor = factor + cfg.scale_offset
    return a * factor


def _inv_rms(cfg: NormConfig, row_stat: jax.Array) -> jax.Array:
    return row_stat if cfg.inside else 1.0 / (row_stat + cfg.eps)


def _alpha(cfg: NormConfig, row_stat: jax.Array, inv_rms: jax.Array) -> jax.Array:
    """``d r / d ms = -r**2 * alpha / 2``: ``alpha = r`` inside, ``1/s`` outside (0 where
    ``s == 0``: an all-zero row, whose cross term's limit is 0)."""
    if cfg.inside:
        return inv_rms
    safe = jnp.where(row_stat > 0, row_stat, 1.0)
    return jnp.where(row_stat > 0, 1.0 / safe, 0.0)


def row_statistic(cfg: NormConfig, x, mask) -> jax.Array:
    """The per-row residual, named ``"rms_norm_stat"`` for remat policies
    (``jax.checkpoint_policies.save_only_these_names``)."""
    # XLA:CPU: the statistic reads x through a barrier of its own (docs/cpu.md).
    ms = _mean_square(cfg, cpu_barrier(x), mask)
    row_stat = lax.rsqrt(ms + cfg.eps) if cfg.inside else jnp.sqrt(ms)
    return checkpoint_name(row_stat, STAT_NAME)


def normalized(cfg: NormConfig, x, scale, bias, row_stat) -> jax.Array:
    """``(scale + offset) * x * r + bias`` in the compute dtype."""
    y = x.astype(cfg.compute_dtype) * _inv_rms(cfg, row_stat)
    y = _scaled(cfg, y, scale)
    if bias is not None:
        y = y + bias.astype(cfg.compute_dtype)
    return y


def output(cfg: NormConfig, y: jax.Array) -> jax.Array:
    """``y`` in the output dtype, named ``"rms_norm_out"`` for remat policies."""
    return checkpoint_name(y.astype(cfg.out_dtype), OUT_NAME)


def output_tangent(cfg: NormConfig, dy: jax.Array) -> jax.Array:
    """A tangent of ``y`` in the output dtype."""
    return dy.astype(cfg.out_dtype)


def parameter_cotangent(a: jax.Array, b: jax.Array, primal) -> jax.Array:
    """``sum(a * b)`` over the axes along which ``primal`` (a type) was broadcast to
    ``a.shape``, returned with the primal's type: shape, dtype, sharding, varying axes.

    The sum over rows has its own form on GPUs and TPUs (``per_compiler.py``), except on
    an explicit mesh, where the dot is told its output sharding.
    """
    shape = primal.shape
    lead = a.ndim - len(shape)
    keep = tuple(lead + i for i, d in enumerate(shape) if d != 1 or a.shape[lead + i] == 1)
    acc = a.dtype
    if explicit_spec(jax.typeof(a)) is not None:
        total = _sum_of_products(a, b, keep, acc)
    else:
        total = on_backend(
            (a, b),
            gpu=lambda ab: two_stage_column_sum(ab[0].astype(acc) * ab[1].astype(acc), keep),
            tpu=lambda ab: tpu_column_sum(ab[0].astype(acc) * ab[1].astype(acc), keep),
            default=lambda ab: _sum_of_products(ab[0], ab[1], keep, acc),
        )
    ct = total.reshape(shape).astype(primal.dtype)
    if explicit_spec(primal) is not None or explicit_spec(jax.typeof(ct)) is not None:
        ct = jax.sharding.reshard(ct, primal.sharding.spec)
    return match_vma(ct, vma(primal))


def backward_parts(cfg: NormConfig, x, scale, mask, row_stat, dy):
    """The analytic gradient, accumulated in ``compute_dtype``.

    With ``gdy = (scale + offset) * dy``, ``xhat = x * r``, ``S`` the elements of the
    row that enter the mean square (the first ``k``, or where the mask is True, then
    ``k = |S|``, at least 1) and ``c = (1/k) * sum_j gdy_j * xhat_j`` (over all n
    features of the row):

        dx = r * gdy - [i in S] * xhat * c * alpha,  alpha = r (inside), 1/s (outside)
        dscale = sum over broadcast axes of dy * xhat;  dbias = sum of dy.

    Returns ``(dx, dscale, dbias)``, ``dx`` in the compute dtype (the fused variants add
    to it before casting), the parameter cotangents in their primals' types.
    """
    cd = cfg.compute_dtype
    inv_rms = _inv_rms(cfg, row_stat)
    # Three passes over x and dy (the cross term's row sums, the elementwise dx, the
    # parameter sums over rows), each reading its own copies through an XLA:CPU barrier
    # (identity elsewhere): docs/cpu.md. No full-size xhat is formed in any pass.
    x_c, dy_c, scale_c = cpu_barrier((x, dy, scale))
    gdy_c = _scaled(cfg, dy_c.astype(cd), scale_c)
    inv_count = _inv_count(cfg, x.shape, mask)
    mean_term = _row_sum_of_products(cfg, gdy_c, x_c.astype(cd)) * (inv_rms * inv_count)
    x_factor = mean_term * _alpha(cfg, row_stat, inv_rms) * inv_rms

    x_d, dy_d, x_factor, scale_d, row_stat_d = cpu_barrier((x, dy, x_factor, scale, row_stat))
    correction = x_d.astype(cd) * x_factor
    membership = _membership(cfg, x.shape, mask)
    if membership is not None:
        correction = jnp.where(membership, correction, 0)
    dx = _inv_rms(cfg, row_stat_d) * _scaled(cfg, dy_d.astype(cd), scale_d) - correction

    x_p, dy_p, row_stat_p = cpu_barrier((x, dy, row_stat))
    dy_pf = dy_p.astype(cd)
    dscale = dbias = None
    if scale is not None:
        dyhat = dy_pf * _inv_rms(cfg, row_stat_p)
        dscale = parameter_cotangent(dyhat, x_p.astype(cd), jax.typeof(scale))
    if cfg.bias_type is not None:
        dbias = parameter_cotangent(dy_pf, jnp.ones_like(dy_pf), cfg.bias_type)
    return dx, dscale, dbias


def tangent_parts(cfg: NormConfig, x, scale, mask, row_stat, dx, dscale, dbias):
    """The tangent map ``T``: the tangent of ``y`` for tangents ``dx``, ``dscale``,
    ``dbias`` (None where zero), linear in them, in the compute dtype.

    With ``r``, ``S``, ``k`` and ``alpha`` as in :func:`backward_parts` and
    ``m = (1/k) sum_{j in S} x_j dx_j``: ``dr = -r**2 * alpha * m`` and

        dy = (scale + offset) * (r * dx + x * dr) + dscale * x * r + dbias.

    Its transpose is :func:`backward_parts` (the adjoint identity is tested).
    """
    cd = cfg.compute_dtype
    inv_rms = _inv_rms(cfg, row_stat)
    dy = jnp.zeros(x.shape, cd)
    if dx is not None:
        dx_c = dx.astype(cd)
        membership = _membership(cfg, x.shape, mask)
        dx_s = dx_c if membership is None else jnp.where(membership, dx_c, 0)
        mean = _row_sum_of_products(cfg, x.astype(cd), dx_s) * _inv_count(cfg, x.shape, mask)
        d_inv_rms = -(inv_rms * inv_rms) * _alpha(cfg, row_stat, inv_rms) * mean
        dy = _scaled(cfg, dx_c * inv_rms + x.astype(cd) * d_inv_rms, scale)
    if dscale is not None:
        dy = dy + dscale.astype(cd) * (x.astype(cd) * inv_rms)
    if dbias is not None:
        dy = dy + dbias.astype(cd)
    return dy
