"""What the linen and NNX ``RMSNorm`` Modules share: parameter shapes, the call into
:func:`rmsnorm_jax.rms_norm`, and the options they refuse. Neither Module owns these."""

from __future__ import annotations

from typing import Any

import jax
from flax.typing import Axes

from ._functional import normalize_axes, rms_norm


def unsupported_options(axis_index_groups: Any) -> None:
    """Options that flax accepts and this library cannot honour: a clear error, not silence."""
    if axis_index_groups is not None:
        raise ValueError(
            f"axis_index_groups={axis_index_groups!r} is not supported (it is not "
            "supported by shard_map either); use axis_index_groups=None and a mesh "
            "axis that spans exactly the devices to reduce over."
        )


def feature_param_shapes(
    x_shape: tuple[int, ...], feature_axes: Axes
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(param_shape, broadcast_shape)`` of scale/bias for features on ``feature_axes``.

    As in flax, the parameter holds one value per feature (``x.shape`` at the feature
    axes) and is reshaped to broadcast against ``x``.
    """
    axes = normalize_axes(feature_axes, len(x_shape), name="feature_axes")
    param_shape = tuple(x_shape[a] for a in axes)
    broadcast_shape = tuple(d if i in axes else 1 for i, d in enumerate(x_shape))
    return param_shape, broadcast_shape


def normalize(module: Any, x: jax.Array, scale, bias, mask=None) -> jax.Array:
    """``rms_norm`` configured from a module's fields (shared by the linen and NNX twins)."""
    return rms_norm(
        x,
        scale,
        module.epsilon,
        bias=bias,
        axis=module.reduction_axes,
        p=module.p,
        scale_offset=module.scale_offset,
        eps_placement=module.eps_placement,
        dtype=module.dtype,
        axis_name=module.axis_name,
        mask=mask,
    )
