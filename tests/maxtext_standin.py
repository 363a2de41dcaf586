"""A stand-in for MaxText's ``maxtext/layers/normalizations.py`` (MaxText 0.2.5), for tests.

MaxText is not a dependency (it needs Python >= 3.12 and its own stack), so the tests of
``rmsnorm_jax.integrations.patch_maxtext`` run against this copy of its ``RMSNorm``, and
against the real one where ``maxtext`` imports. The constructor, the call, the formula
(its two roundings: ``x_hat`` to ``dtype``, then the scale multiplied in ``dtype``; one
rounding with ``scale_offset``), the parameter and its metadata are MaxText's, line for
line; only what the norm does not need is left out (the linen wrappers, the Qwen3-Next
gated norm). Derived from MaxText (Copyright 2023-2026 Google LLC, Apache License 2.0).

The names the module-level code of MaxText's file uses are here too: ``ShardMode``,
``truncate_out_sharding`` (``maxtext/utils/sharding.py``), ``max_utils.device_space``,
``max_logging.log``, ``is_fp8_dtype`` (``maxtext/common/common_types.py``).
"""

import enum
import types
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

LOGGED: list[str] = []  # what max_logging.log received, for the tests


class ShardMode(enum.Enum):
    AUTO = "auto"  # default
    EXPLICIT = "explicit"


def is_fp8_dtype(dtype: Any) -> bool:
    return dtype in ("float8_e4m3fn", "float8_e5m2", jnp.float8_e4m3fn, jnp.float8_e5m2)


max_utils = types.SimpleNamespace(device_space=lambda: jax.memory.Space.Device)
max_logging = types.SimpleNamespace(log=LOGGED.append)


def truncate_out_sharding(out_sharding, out_ndim: int):
    """Truncates out_sharding if tensor ndim is less than out_sharding pspec length."""
    if out_sharding is None:
        return None
    if isinstance(out_sharding, NamedSharding):
        if len(out_sharding.spec) > out_ndim:
            return NamedSharding(out_sharding.mesh, P(*out_sharding.spec[:out_ndim]))
    elif isinstance(out_sharding, P):
        if len(out_sharding) > out_ndim:
            return P(*out_sharding[:out_ndim])
    elif isinstance(out_sharding, (tuple, list)):
        if len(out_sharding) > out_ndim:
            return tuple(out_sharding[:out_ndim])
    return out_sharding


def _align_scale_with_normalized_axis(scale: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """Reshards a 1-D norm scale to match the sharding of the axis it normalizes."""
    activation_axis = jax.typeof(y).sharding.spec.partitions[-1]
    scale_spec = jax.typeof(scale).sharding.spec
    if scale_spec.partitions[-1] == activation_axis:
        return scale
    return jax.sharding.reshard(
        scale,
        P(activation_axis, unreduced=scale_spec.unreduced, reduced=scale_spec.reduced),
    )


class RMSNorm(nnx.Module):
    """RMS normalization."""

    def __init__(
        self,
        num_features: int,
        epsilon: float = 1e-6,
        dtype: Any = jnp.float32,
        weight_dtype: Any = jnp.float32,
        shard_mode: ShardMode = ShardMode.AUTO,
        kernel_axes: tuple[str | None, ...] = (),
        scale_init=jax.nn.initializers.ones,
        parameter_memory_host_offload: bool = False,
        scale_offset: float = 0.0,
        with_scale: bool = True,
        *,
        rngs: nnx.Rngs,
    ):
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.weight_dtype = dtype if is_fp8_dtype(weight_dtype) else weight_dtype
        self.shard_mode = shard_mode
        self.kernel_axes = kernel_axes
        self.scale_init = scale_init
        self.parameter_memory_host_offload = parameter_memory_host_offload
        self.scale_offset = scale_offset
        self.with_scale = with_scale
        if self.with_scale:
            self.scale = nnx.Param(
                scale_init(rngs.params(), (num_features,), self.weight_dtype),
                out_sharding=kernel_axes,
            )
        else:
            self.scale = None

    def __call__(self, x: jnp.ndarray, out_sharding: NamedSharding | None = None) -> jnp.ndarray:
        """Applies layer normalization on the input."""
        x = jnp.asarray(x, jnp.float32)
        mean2 = jnp.mean(lax.square(x), axis=-1, keepdims=True)
        y = jnp.asarray(x * lax.rsqrt(mean2 + self.epsilon), self.dtype)

        # out_sharding must be None in auto shard mode
        if self.shard_mode != ShardMode.EXPLICIT:
            out_sharding = None

        if out_sharding is not None:
            out_sharding = truncate_out_sharding(out_sharding, y.ndim)

        if not self.with_scale:
            if out_sharding is not None:
                y = jax.lax.with_sharding_constraint(y, out_sharding)
            return y

        scale = self.scale.get_value()
        # Move scale to device if parameter offloading is enabled
        if self.parameter_memory_host_offload:
            max_logging.log("normalizations.py: Moving scale parameter to device")
            scale = jax.device_put(scale, max_utils.device_space())

        scale_fp32 = jnp.asarray(scale, jnp.float32)
        effective_scale = scale_fp32 + self.scale_offset
        if self.shard_mode == ShardMode.EXPLICIT:
            effective_scale = _align_scale_with_normalized_axis(effective_scale, y)

        if self.scale_offset != 0.0:
            normed_fp32 = x * lax.rsqrt(mean2 + self.epsilon)
            y = jnp.einsum("...k,k->...k", normed_fp32, effective_scale, out_sharding=out_sharding)
            return jnp.asarray(y, self.dtype)

        effective_scale = jnp.asarray(effective_scale, self.dtype)
        return jnp.einsum("...k,k->...k", y, effective_scale, out_sharding=out_sharding)


class GlobalRMSNorm(RMSNorm):
    """Applies RMSNorm over the last two dimensions (Heads * HeadDim), as Olmo3 does."""

    def __call__(self, x: jnp.ndarray, out_sharding: NamedSharding | None = None) -> jnp.ndarray:
        input_shape = x.shape
        flattened_shape = (*input_shape[:-2], input_shape[-2] * input_shape[-1])
        x_flat = x.reshape(flattened_shape)
        y_flat = super().__call__(x_flat, out_sharding)
        return y_flat.reshape(input_shape)


def Qwen3NextRMSNorm(
    num_features: int,
    epsilon: float = 1e-6,
    dtype: Any = None,
    weight_dtype: Any = None,
    shard_mode=None,
    kernel_axes=None,
    parameter_memory_host_offload=None,
    *,
    rngs: nnx.Rngs,
):
    """Qwen3-Next's norm: a zero-initialised scale applied as ``(1.0 + scale)``."""
    return nnx.data(
        RMSNorm(
            num_features=num_features,
            epsilon=epsilon,
            dtype=dtype,
            weight_dtype=weight_dtype,
            shard_mode=shard_mode if shard_mode is not None else ShardMode.AUTO,
            kernel_axes=kernel_axes if kernel_axes is not None else (),
            scale_init=jax.nn.initializers.zeros,
            scale_offset=1.0,
            parameter_memory_host_offload=bool(parameter_memory_host_offload),
            rngs=rngs,
        )
    )
