"""The differentiable core of RMSNorm: one forward rule and one analytic backward rule.

Everything here assumes validated arguments (see ``_config.py``). The static part
of a call lives in a hashable :class:`NormConfig`; the arrays are ``x``, ``scale``,
``bias`` and ``mask`` (all but ``x`` may be ``None``). A boolean ``mask`` (broadcastable
to ``x``) restricts the mean square to the positions where it is True (flax's masked
statistics); every position is still normalized.

Residuals kept for the backward pass: ``x``, ``scale``, the ``mask`` in its given
(possibly broadcast) shape, and one float (at least float32) per row: the inverse RMS
``r = rsqrt(ms + eps)`` for the "inside" placement, the RMS ``s = sqrt(ms)`` for
"outside" (from which ``r = 1 / (s + eps)`` is exact, and
``dr/dms = -r**2 / (2 s)`` stays well defined).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from ._backends import (
    cpu_barrier,
    on_backend,
    tpu_column_sum,
    two_stage_column_sum,
    vma,
)
from ._linear import tangents_of


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Static description of one ``rms_norm`` call (hashable, so it can be a jit key).

    Attributes:
      axes: the normalized axes of ``x``, non-negative and sorted.
      n: elements per row on this device (the product of ``x.shape`` over ``axes``).
      k: elements per row that enter the mean square (``ceil(n_global * p)``).
      n_global: elements per row across all devices of ``axis_name``.
      eps: the epsilon.
      inside: ``True`` for ``rsqrt(ms + eps)``, ``False`` for ``1 / (sqrt(ms) + eps)``.
      scale_offset: added to ``scale`` before it multiplies (1.0 gives ``1 + scale``).
      compute_dtype: dtype of the statistics and the normalisation (>= float32).
      out_dtype: dtype of ``y``.
      axis_name: mapped axis (or tuple) across which the features are split.
      bias_type: ``jax.typeof(bias)`` (shape, dtype, sharding, varying mesh axes):
        what the bias cotangent must look like; the bias itself is not kept for the
        backward pass.
    """

    axes: tuple[int, ...]
    n: int
    k: int
    n_global: int
    eps: float
    inside: bool
    scale_offset: float
    compute_dtype: np.dtype
    out_dtype: np.dtype
    axis_name: Hashable | None
    bias_type: Any = None

    @property
    def partial(self) -> bool:
        return self.k < self.n_global


def _explicit_spec(aval) -> tuple | None:
    """The partition spec of ``aval`` when any of its axes is explicitly sharded."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    if spec is None or all(entry is None for entry in spec):
        return None
    return tuple(spec) + (None,) * (len(aval.shape) - len(spec))


def _partial_mask(cfg: NormConfig, shape: tuple[int, ...]) -> jax.Array:
    """``True`` where an element is among the first ``k`` of its row (row-major order).

    The mask has size 1 along the batch axes so that XLA fuses it as an iota compare.
    With ``axis_name`` the single normalized axis is split across devices, so the
    global position adds this device's offset.
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


def _sum_of_products(a: jax.Array, b: jax.Array, keep: tuple[int, ...], accumulate) -> jax.Array:
    """``sum(a * b)`` over every axis not in ``keep``, with size-1 dims left in their place.

    The products and the sum are in ``accumulate`` whatever the operands' dtype.

    Written as a ``dot_general`` (the kept axes are its batch axes) rather than
    ``jnp.sum(a * b, axes)``: XLA:CPU turns the dot into one fused multiply-reduce that
    runs several times faster than its generic reduction, most of all for a sum over
    leading (row) axes such as the scale gradient. On GPU and TPU both forms fuse alike
    for the per-row sums; the scale gradient's sum over rows has its own form there
    (``_parameter_cotangent``).
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


def _kept_sharding(a: jax.Array, keep: tuple[int, ...]):
    """The output sharding of a sum over the axes not in ``keep``, for explicit meshes.

    With explicitly sharded axes (``jax.sharding.AxisType.Explicit``) a dot whose
    contracted axes are sharded must be told its output sharding: the kept axes keep
    theirs, the contracted ones are summed across devices. Otherwise (no mesh, auto
    or manual axes) ``None`` lets XLA decide, as ``jnp.sum`` would.
    """
    aval = jax.typeof(a)
    spec = _explicit_spec(aval)
    if spec is None:
        return None
    return jax.sharding.NamedSharding(
        aval.sharding.mesh, jax.sharding.PartitionSpec(*(spec[i] for i in keep))
    )


def _membership(cfg: NormConfig, shape: tuple[int, ...], mask) -> jax.Array | None:
    """Where an element enters the mean square: the user's mask, the first ``k``
    (pRMSNorm), or everywhere (None)."""
    if mask is not None:
        return mask
    return _partial_mask(cfg, shape) if cfg.partial else None


def _inv_count(cfg: NormConfig, shape: tuple[int, ...], mask) -> jax.Array | float:
    """``1 / (elements per row in the mean square)``: ``1/k``, or per row for a mask.

    A row whose mask is all False counts 1, so its mean square is 0 and it is
    normalized like an all-zero row (finite, eps-limited), never 0/0.
    """
    if mask is None:
        return 1.0 / cfg.k
    count = jnp.sum(jnp.broadcast_to(mask, shape), cfg.axes, dtype=jnp.int32, keepdims=True)
    return 1.0 / jnp.maximum(count, 1).astype(cfg.compute_dtype)


def _mean_square(cfg: NormConfig, x: jax.Array, mask=None) -> jax.Array:
    """Per-row mean of the squares of the first ``k`` elements (all of them for p = 1).

    The squares are summed by a dot on ``x`` in its own dtype with compute-dtype
    accumulation: products of two float16/bfloat16 values are exact in float32.

    For pRMSNorm with one local normalized axis the tail is sliced away, so the
    statistic reads only ``k`` elements per row: on XLA:CPU and TPU, where the
    statistic is a pass of its own, that is pRMSNorm's saving (TPU v5e: forward 1.07x
    a copy against 1.79x for p = 1). On H100 it is the best expression found: 88-92 %
    of the bandwidth bound against 62-64 % with a mask (only the full-row statistic
    fuses into one kernel with the normalisation). Otherwise (several axes, or
    features split across devices) the tail is masked.
    """
    head = x
    if mask is None and cfg.partial and len(cfg.axes) == 1 and cfg.axis_name is None:
        head = lax.slice_in_dim(x, 0, cfg.k, axis=cfg.axes[0])
    elif mask is not None or cfg.partial:
        head = jnp.where(_membership(cfg, x.shape, mask), x, 0)
    return _row_sum_of_products(cfg, head, head) * _inv_count(cfg, x.shape, mask)


def _row_sum_of_products(cfg: NormConfig, a: jax.Array, b: jax.Array) -> jax.Array:
    """Per-row ``sum(a * b)``, across devices too when the features are split."""
    keep = tuple(i for i in range(a.ndim) if i not in cfg.axes)
    total = _sum_of_products(a, b, keep, cfg.compute_dtype)
    if cfg.axis_name is not None:
        total = lax.psum(total, cfg.axis_name)
    return total


def _scaled(cfg: NormConfig, a: jax.Array, scale) -> jax.Array:
    """``a * (scale + scale_offset)`` in the compute dtype, or ``a`` without a scale."""
    if scale is None:
        return a
    # ``scale + scale_offset`` is formed once, in the compute dtype, before the product,
    # on every backend: y is then ``a * gain`` rounded once, as in the kernels. XLA:GPU
    # once got ``a * scale + a`` here (fewer small kernels), which cancels where
    # ``1 + scale`` is near 0: up to 49x the rounding bound on an H200 (issue 34).
    factor = scale.astype(cfg.compute_dtype)
    if cfg.scale_offset:
        factor = factor + cfg.scale_offset
    return a * factor


def _inv_rms(cfg: NormConfig, row_stat: jax.Array) -> jax.Array:
    return row_stat if cfg.inside else 1.0 / (row_stat + cfg.eps)


STAT_NAME = "rms_norm_stat"
OUT_NAME = "rms_norm_out"


def row_statistic(cfg: NormConfig, x, mask) -> jax.Array:
    """The per-row residual (see the module doc), named ``"rms_norm_stat"`` for remat
    policies (``jax.checkpoint_policies.save_only_these_names``)."""
    # On XLA:CPU the barrier keeps the statistic's read of x (of its first k features for
    # pRMSNorm) apart from the full-size normalisation. Fused together, XLA:CPU feeds
    # both from a materialised float32 copy of x: measured 3x to 7x slower for
    # bfloat16 rows of 5120 and 8192 features and for pRMSNorm, neutral for float32.
    ms = _mean_square(cfg, cpu_barrier(x), mask)
    # One value read by the forward and the backward's three passes: XLA:GPU stores it
    # from a small f32[rows] kernel of its own. Keeping ``ms`` instead, with a spelling of
    # the root per pass that CSE cannot merge, removes that kernel (Gemma-3 270M step,
    # H100: 1794 to 1758) but XLA's cost model charges each reader an rsqrt per element
    # (non-matmul +0.4 %; isolated forward+backward at 8192 x 1024 bfloat16 42.0 against
    # 40.9 us): not taken until a GPU measures it (docs/real-models.md).
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


def _forward(cfg: NormConfig, x, scale, bias, mask):
    """Returns ``(y, row_stat)``; ``row_stat`` is the per-row residual (see module doc)."""
    row_stat = row_statistic(cfg, x, mask)
    return output(cfg, normalized(cfg, x, scale, bias, row_stat)), row_stat


def _parameter_cotangent(a: jax.Array, b: jax.Array, primal) -> jax.Array:
    """``sum(a * b)`` over the axes along which ``primal`` was broadcast to ``a.shape``,
    returned with the primal's type: shape, dtype, sharding and varying mesh axes."""
    shape = primal.shape
    lead = a.ndim - len(shape)
    keep = tuple(lead + i for i, d in enumerate(shape) if d != 1 or a.shape[lead + i] == 1)
    acc = a.dtype

    def generic(ab):
        return _sum_of_products(*ab, keep, acc)

    def gpu(ab):
        return two_stage_column_sum(ab[0].astype(acc) * ab[1].astype(acc), keep)

    def tpu(ab):
        return tpu_column_sum(ab[0].astype(acc) * ab[1].astype(acc), keep)

    explicit = _explicit_spec(jax.typeof(a)) is not None
    if explicit:
        # Explicit sharding: the dot is told its output sharding (_kept_sharding).
        total = generic((a, b))
    else:
        total = on_backend((a, b), gpu=gpu, tpu=tpu, default=generic)
    ct = total.reshape(shape).astype(primal.dtype)
    if _explicit_spec(primal) is not None or _explicit_spec(jax.typeof(ct)) is not None:
        # Explicit sharding: the cotangent must carry the primal's own sharding.
        ct = jax.sharding.reshard(ct, primal.sharding.spec)
    return match_vma(ct, vma(primal))


def match_vma(ct: jax.Array, target_vma: frozenset) -> jax.Array:
    """Sums a cotangent over the mesh axes along which its primal was replicated.

    Inside ``shard_map`` a parameter replicated over an axis that ``x`` is split along
    gets one partial gradient per device; the true gradient is their sum, and JAX's
    varying-axes check insists the cotangent be replicated like the primal.
    """
    extra = tuple(sorted(vma(ct) - target_vma))
    return lax.psum(ct, extra) if extra else ct


def _backward(cfg: NormConfig, residuals, dy):
    """The backward rule B: :func:`backward_parts`, ``dx`` in ``x``'s type."""
    x, scale, mask, row_stat = residuals
    dx, dscale, dbias = backward_parts(cfg, x, scale, mask, row_stat, dy)
    dx = match_vma(dx.astype(x.dtype), vma(jax.typeof(x)))
    return dx, dscale, dbias, None  # the mask is not differentiated


def backward_parts(cfg: NormConfig, x, scale, mask, row_stat, dy):
    """The analytic gradient (``../shared/FACTS.md``), accumulated in ``compute_dtype``.

    With ``gdy = (scale + offset) * dy``, ``xhat = x * r``, ``S`` the elements of the
    row that enter the mean square (the first ``k``, or where the mask is True, then
    ``k = |S|``, at least 1) and ``c = (1/k) * sum_j gdy_j * xhat_j`` (over all n
    features of the row):

        dx = r * gdy - [i in S] * xhat * c * alpha,  alpha = r (inside), 1/s (outside)
        dscale = sum over broadcast axes of dy * xhat;  dbias = sum of dy.

    For "outside" with s == 0 (an all-zero row), ``xhat == 0`` and the cross term's
    limit is 0, so alpha is set to 0 there rather than inf.

    Returns ``(dx, dscale, dbias)``, ``dx`` in the compute dtype (the fused variants
    add to it before casting), the parameter cotangents in their primals' types.
    """
    cd = cfg.compute_dtype
    inv_rms = _inv_rms(cfg, row_stat)
    # Three passes over x and dy: the per-row sum for the cross term, the elementwise
    # dx, and the parameter gradients' sum over rows. On XLA:CPU each reads its own
    # copy of the inputs through an optimization barrier, so that XLA fuses each pass
    # with its own dtype casts and broadcasts; without them XLA:CPU materialises
    # full-size float32 copies of x, dy and the inverse RMS shared by the passes
    # (measured: the backward 1.5x to 3.5x slower, worst for bfloat16 and wide rows).
    # The scale and the row statistic go through the barriers too: shared with the
    # forward, XLA:CPU kept their broadcasts (``scale + offset``, the inverse RMS) as
    # full-size float32 arrays from the forward to the backward
    # (tests/test_aot.py::test_cpu_backward_keeps_no_full_size_copy).
    # Other backends get no barrier (``_backends.cpu_barrier``).
    x_c, dy_c, scale_c = cpu_barrier((x, dy, scale))
    gdy_c = _scaled(cfg, dy_c.astype(cd), scale_c)
    # (1/k) sum_j gdy_j xhat_j, computed on x (not xhat) and scaled per row: no
    # full-size xhat exists in any pass. With a mask, k is the row's mask count.
    inv_count = _inv_count(cfg, x.shape, mask)
    mean_term = _row_sum_of_products(cfg, gdy_c, x_c.astype(cd)) * (inv_rms * inv_count)
    if cfg.inside:
        alpha = inv_rms
    else:
        safe = jnp.where(row_stat > 0, row_stat, 1.0)
        alpha = jnp.where(row_stat > 0, 1.0 / safe, 0.0)
    # The per-row factor is a product after the row sum. Multiplying gdy by it inside the
    # sum instead spares XLA:GPU one small f32[rows] kernel per norm in a model (Gemma-3
    # 270M step, H100: 1794 against 1703 kernels), but by XLA's H100 cost model the
    # isolated forward+backward is then 1-50 % dearer on every shape tried (256 x 1024 to
    # 16384 x 2048, both dtypes), up to 1.18x the best peer: without a GPU to time the
    # launches it saves, the cheaper kernels win.
    x_factor = mean_term * alpha * inv_rms
    # The elementwise pass reads its own copies too, with the per-row factor: XLA:CPU
    # then stops converting all of x to float32 in memory for it (bfloat16: ~1.4x).
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
        dscale = _parameter_cotangent(dyhat, x_p.astype(cd), jax.typeof(scale))
    if cfg.bias_type is not None:
        dbias = _parameter_cotangent(dy_pf, jnp.ones_like(dy_pf), cfg.bias_type)
    return dx, dscale, dbias


def tangent_parts(cfg: NormConfig, x, scale, mask, row_stat, dx, dscale, dbias):
    """The tangent map ``T``: the tangent of ``y`` for tangents ``dx``, ``dscale``,
    ``dbias`` (None where zero), linear in them, in the compute dtype.

    With ``r`` the inverse RMS, ``S`` and ``k`` as in :func:`backward_parts` and
    ``m = (1/k) sum_{j in S} x_j dx_j``: ``dr = -r**2 * alpha * m`` (``alpha = r``
    inside, ``1/s`` outside, 0 for an all-zero row) and

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
        if cfg.inside:
            alpha = inv_rms
        else:
            safe = jnp.where(row_stat > 0, row_stat, 1.0)
            alpha = jnp.where(row_stat > 0, 1.0 / safe, 0.0)
        d_inv_rms = -(inv_rms * inv_rms) * alpha * mean
        dy = _scaled(cfg, dx_c * inv_rms + x.astype(cd) * d_inv_rms, scale)
    if dscale is not None:
        dy = dy + dscale.astype(cd) * (x.astype(cd) * inv_rms)
    if dbias is not None:
        dy = dy + dbias.astype(cd)
    return dy


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def rms_norm_core(cfg: NormConfig, x, scale, bias, mask):
    """RMSNorm of validated arrays: forward mode by :func:`tangent_parts`, reverse mode
    by the analytic backward rule (``_linear``)."""
    return _forward(cfg, x, scale, bias, mask)[0]


@functools.partial(rms_norm_core.defjvp, symbolic_zeros=True)
def _jvp_rule(cfg: NormConfig, primals, tangents):
    x, scale, bias, mask = primals
    y, row_stat = _forward(cfg, x, scale, bias, mask)

    def tangent(res, dparams):
        return [output_tangent(cfg, tangent_parts(cfg, *res, *dparams))]

    def backward(res, cts):
        return _backward(cfg, res, cts[0])[:3]

    (dy,) = tangents_of([y], (x, scale, mask, row_stat), tangents[:3], tangent, backward)
    return y, dy


def output_tangent(cfg: NormConfig, dy: jax.Array) -> jax.Array:
    """A tangent of ``y`` in the output dtype."""
    return dy.astype(cfg.out_dtype)
