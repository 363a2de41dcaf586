"""Flax linen ``RMSNorm``: a drop-in for ``flax.linen.RMSNorm`` that adds pRMSNorm.

The Module owns the parameters and calls :func:`rmsnorm_jax.rms_norm`; the maths lives
there alone.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.typing import Axes, Dtype, Initializer

from ._module_utils import feature_param_shapes, normalize, unsupported_options


class RMSNorm(nn.Module):
    r"""RMS layer normalisation (and pRMSNorm) as a Flax linen Module.

    Drop-in for ``flax.linen.RMSNorm``: the same fields with the same names, defaults
    and meaning, the same parameter tree (``scale``, shape = the feature axes), the
    same results; plus ``p``, ``use_bias``, ``scale_offset``, ``eps_placement`` and
    ``logical_axes``. The gradient is the analytic backward rule of
    :func:`rmsnorm_jax.rms_norm`, which keeps only ``x``, ``scale`` and one float32
    per row for the backward pass.

    For each row (the elements over ``reduction_axes``)::

        y = (scale + scale_offset) * x / RMS(x) + bias,
        RMS(x) = sqrt(mean(x[:k]**2) + epsilon),  k = ceil(n * p)

    Dtypes: statistics in at least float32; parameters stored in ``param_dtype``;
    output in ``dtype``, else the promotion of ``x`` and the parameters (flax's rule).

    Attributes:
      epsilon: small float added to the mean square (or to the RMS, see
        ``eps_placement``).
      dtype: the dtype of the result (default: inferred from input and params).
      param_dtype: the dtype of the parameters (default float32).
      use_scale: if True, multiply by the learned ``scale``.
      scale_init: initializer for ``scale`` (default ones; use zeros with
        ``scale_offset=1.0`` for Gemma's ``1 + scale``).
      reduction_axes: the axes the RMS is computed over.
      feature_axes: the axes that get their own scale and bias.
      axis_name: mapped axis name for ``shard_map``/``pmap`` when the normalized
        features are split across devices; statistics are summed across it.
      axis_index_groups: accepted for compatibility; anything but None raises.
      use_fast_variance: accepted for compatibility; RMSNorm subtracts no mean, so
        both values give the same result.
      force_float32_reductions: statistics are always at least float32 here; True
        (the default) is accepted, False raises rather than silently differ.
      p: fraction in (0, 1] of each row's features the RMS is estimated from.
      use_bias: if True, add a learned ``bias`` (flax.linen.RMSNorm has none).
      bias_init: initializer for ``bias`` (default zeros).
      scale_offset: added to ``scale`` before use; 1.0 gives ``(1 + scale)``.
      eps_placement: ``"inside"`` (``rsqrt(ms + eps)``, flax) or ``"outside"``
        (``1 / (sqrt(ms) + eps)``, the paper's code).
      logical_axes: logical axis names of the parameters (one per feature axis), e.g.
        ``("embed",)``; the parameters are then boxed with
        ``nn.with_logical_partitioning`` so ``nn.logical_to_mesh_sharding`` shards
        them. None (default) leaves them unboxed, exactly like flax.
      activation, norm_before_gate, group_size: the gated form, used when
        ``__call__`` gets ``gate=`` (see :func:`rmsnorm_jax.gated_rms_norm`):
        ``"silu"`` or ``"sigmoid"``; normalize then gate (default) or gate then
        normalize; the statistic per group of ``group_size`` features (Mamba2).
      implementation: which path computes the norm: ``"xla"``, ``"pallas"`` (the
        fused kernels, where the call fits them) or ``"auto"`` (default: per backend
        and shape from measurements on hardware; XLA where none). See
        :func:`rmsnorm_jax.rms_norm`.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from rmsnorm_jax import RMSNorm
    >>> x = jax.random.normal(jax.random.key(0), (5, 6))
    >>> layer = RMSNorm(p=0.5)
    >>> variables = layer.init(jax.random.key(1), x)
    >>> jax.tree.map(jnp.shape, variables)
    {'params': {'scale': (6,)}}
    >>> layer.apply(variables, x).shape
    (5, 6)
    """

    epsilon: float = 1e-6
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    use_scale: bool = True
    scale_init: Initializer = nn.initializers.ones
    reduction_axes: Axes = -1
    feature_axes: Axes = -1
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True
    p: float = 1.0
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    scale_offset: float = 0.0
    eps_placement: str = "inside"
    logical_axes: tuple[str | None, ...] | None = None
    activation: str = "silu"
    norm_before_gate: bool = True
    group_size: int | None = None
    implementation: str = "auto"

    def _feature_param(self, name: str, init: Initializer, shape, broadcast_shape):
        if self.logical_axes is not None:
            if len(self.logical_axes) != len(shape):
                raise ValueError(
                    f"logical_axes={self.logical_axes!r} names {len(self.logical_axes)} "
                    f"axes but the {name} parameter has shape {shape}; give one name per "
                    f"feature axis."
                )
            init = nn.with_logical_partitioning(init, self.logical_axes)
        return self.param(name, init, shape, self.param_dtype).reshape(broadcast_shape)

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        *,
        mask: jax.Array | None = None,
        residual: jax.Array | None = None,
        gate: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Normalizes ``x``; returns an array of the same shape.

        ``residual``: normalizes ``h = x + residual`` and returns ``(y, h)``, the
        pre-norm residual stream in one fused op (:func:`rmsnorm_jax.add_rms_norm`).
        ``gate``: returns the gated norm (:func:`rmsnorm_jax.gated_rms_norm`). The
        parameters are the same in every form, so checkpoints load in all of them.

        ``mask``: optional boolean array broadcastable to ``x``; the mean square of
        each row is taken over its True positions only, and every position is
        normalized by it (flax's semantics; an all-False row is normalized like an
        all-zero row instead of giving NaN).
        """
        unsupported_options(self.axis_index_groups)
        if not self.force_float32_reductions:
            raise ValueError(
                "force_float32_reductions=False is not supported: rmsnorm_jax always "
                "reduces in at least float32. Drop the argument (the default is True)."
            )
        x = jnp.asarray(x)
        shape, broadcast_shape = feature_param_shapes(x.shape, self.feature_axes)
        scale = bias = None
        if self.use_scale:
            scale = self._feature_param("scale", self.scale_init, shape, broadcast_shape)
        if self.use_bias:
            bias = self._feature_param("bias", self.bias_init, shape, broadcast_shape)
        return normalize(self, x, scale, bias, mask, residual, gate)
