"""What the linen and NNX ``RMSNorm`` Modules share: parameter shapes, the call into
:func:`rmsnorm_jax.rms_norm`, and the options they refuse. Neither Module owns these."""

from __future__ import annotations

from typing import Any

import jax
from flax.typing import Axes

from ._config import normalize_axes
from ._llm_layers import add_rms_norm, gated_rms_norm
from ._rms_norm import rms_norm


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


def normalize(
    module: Any, x: jax.Array, scale, bias, mask=None, residual=None, gate=None
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The norm a Module's fields describe, applied to ``x`` (shared by linen and NNX).

    ``residual``: :func:`add_rms_norm` of ``x + residual``, returning ``(y, h)``;
    ``gate``: :func:`gated_rms_norm`; neither: :func:`rms_norm`.
    """
    if residual is not None and gate is not None:
        raise ValueError(
            "give residual= or gate=, not both: the residual form returns (y, h) for the "
            "pre-norm stream, the gated form gates a norm's output; call the Module twice."
        )
    if module.group_size is not None and gate is None:
        raise ValueError(
            f"group_size={module.group_size} applies to the gated form only; pass gate= "
            f"when calling, or set group_size=None."
        )
    common = dict(
        bias=bias,
        axis=module.reduction_axes,
        p=module.p,
        scale_offset=module.scale_offset,
        eps_placement=module.eps_placement,
        dtype=module.dtype,
        implementation=getattr(module, "implementation", "auto"),
    )
    if gate is not None:
        if mask is not None or module.axis_name is not None:
            raise ValueError(
                "the gated form takes no mask and no axis_name; drop them or call the "
                "Module without gate= and gate its output yourself."
            )
        return gated_rms_norm(
            x,
            gate,
            scale,
            module.epsilon,
            activation=module.activation,
            norm_before_gate=module.norm_before_gate,
            group_size=module.group_size,
            **common,
        )
    if residual is not None:
        return add_rms_norm(
            x, residual, scale, module.epsilon, axis_name=module.axis_name, mask=mask, **common
        )
    return rms_norm(x, scale, module.epsilon, axis_name=module.axis_name, mask=mask, **common)
