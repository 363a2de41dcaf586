"""The arguments of a norm: their checks, the dtype policy, and the static ``NormConfig``.

Shared by the public functions (``_rms_norm.py``, ``_llm_layers.py``), the XLA path
(``_xla/``), the kernels and the Modules; it imports nothing of theirs.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Hashable, Sequence
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

EPS_PLACEMENTS = ("inside", "outside")
# The paths a call may ask for: "auto", "xla", "pallas" (each platform's preferred kernels),
# or one backend's kernels by its name in kernels/_select.py's registry (a test holds the
# names equal).
IMPLEMENTATIONS = ("auto", "xla", "pallas", "mosaic_gpu", "triton", "mosaic_tpu")


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Static description of one norm call (hashable, so it can be a jit key).

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


def partial_count(n: int, p: float) -> int:
    """``k = ceil(n * p)``: how many leading features pRMSNorm takes the RMS from.

    ``p`` is read as the decimal the user wrote (its shortest round-trip repr), so that
    ``partial_count(100, 0.07) == 7`` although ``100 * 0.07 == 7.000000000000001``.

    >>> partial_count(100, 0.07), partial_count(512, 0.0625), partial_count(3, 0.5)
    (7, 32, 2)
    """
    return min(n, max(1, math.ceil(Fraction(repr(float(p))) * n)))


def normalize_axes(axis: Any, ndim: int, name: str = "axis") -> tuple[int, ...]:
    """Sorted non-negative axes; clear errors for empty, non-int, out of range, repeated."""
    axes = tuple(axis) if isinstance(axis, Sequence) else (axis,)
    if not axes:
        raise ValueError(f"{name}=() names no axis; give at least one, e.g. {name}=-1.")
    out = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, numbers.Integral):
            raise TypeError(f"{name} must be an int or a tuple of ints, got {axis!r}.")
        a = int(a)
        if not -ndim <= a < ndim:
            raise ValueError(
                f"{name}: axis {a} is out of range for x with ndim={ndim}; "
                f"use axes in [{-ndim}, {ndim - 1}]."
            )
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{name}={axis!r} repeats an axis (ndim={ndim}); list each axis once.")
    return tuple(sorted(out))


def static_float(name: str, value: Any, accepted: str) -> float:
    """``value`` as a Python float; a traced, boolean or non-numeric value is a TypeError."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} is a traced value; it must be a static Python float ({accepted}). "
            f"Pass it as a constant (or mark it static in jax.jit with static_argnames)."
        )
    if not isinstance(value, (bool, str, bytes)):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"{name} must be a Python float ({accepted}), got {value!r}.")


def _check_eps(eps: Any) -> float:
    value = static_float("eps", eps, ">= 0, e.g. 1e-6")
    if not 0.0 <= value < math.inf:
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}; e.g. eps=1e-6.")
    return value


def _check_p(p: Any) -> float:
    value = static_float("p", p, "in (0, 1]")
    if not 0.0 < value <= 1.0:
        raise ValueError(
            f"p must be in (0, 1] (the fraction of features the RMS is estimated from), "
            f"got {p!r}; p=1.0 is plain RMSNorm, the paper uses p=0.0625."
        )
    return value


def as_float_array(name: str, value: Any) -> jax.Array:
    arr = value if isinstance(value, jax.Array) else jnp.asarray(value)
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        raise TypeError(
            f"{name} must be a real floating-point array, got dtype {arr.dtype}; "
            f"cast it first, e.g. {name}.astype(jnp.float32)."
        )
    return arr


def _broadcasts_to(shape: tuple[int, ...], x_shape: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``x_shape`` without enlarging it."""
    try:
        return jnp.broadcast_shapes(shape, x_shape) == tuple(x_shape)
    except ValueError:
        return False


def check_param(name: str, value: Any, x_shape: tuple[int, ...]):
    if value is None:
        return None
    if isinstance(value, (int, float)) and name == "scale":
        raise TypeError(
            f"scale must be an array (one value per normalized feature), got the Python "
            f"number {value!r}. If it is the epsilon, pass it as eps: "
            f"rms_norm(x, None, {value!r}) or rms_norm(x, eps={value!r}); for a constant "
            f"gain, pass jnp.full((n,), {value!r})."
        )
    arr = as_float_array(name, value)
    if not _broadcasts_to(arr.shape, x_shape):
        raise ValueError(
            f"{name} with shape {arr.shape} does not broadcast to x's shape {x_shape}; "
            f"give it the shape of the normalized features (e.g. {x_shape[-1:]}) or one "
            f"that broadcasts to x without enlarging it."
        )
    return arr


def _axis_name_size(axis_name: Hashable) -> int:
    try:
        return int(lax.axis_size(axis_name))
    except NameError as err:
        raise ValueError(
            f"axis_name={axis_name!r} is not a bound mapped axis; call rms_norm inside "
            f"jax.shard_map (or pmap) over a mesh with that axis, or pass axis_name=None."
        ) from err


def norm_config(
    x,
    scale,
    eps,
    bias,
    axis,
    p,
    scale_offset,
    eps_placement,
    dtype,
    axis_name=None,
    mask=None,
    *,
    promote_with=(),
):
    """Checks the norm's arguments for the rows of ``x`` (anything with a ``shape`` and a
    ``dtype``: an array or a ``jax.ShapeDtypeStruct``), in :func:`rmsnorm_jax.rms_norm`'s
    order.

    Returns ``(cfg, scale, bias, mask)``: the static :class:`NormConfig` and the
    validated arrays. ``promote_with``: further dtypes that enter the default output
    dtype (a gate's).
    """
    shape, x_dtype = tuple(x.shape), x.dtype
    axes = normalize_axes(axis, len(shape))
    scale = check_param("scale", scale, shape)
    bias = check_param("bias", bias, shape)
    eps = _check_eps(eps)
    p = _check_p(p)
    if eps_placement not in EPS_PLACEMENTS:
        raise ValueError(f"eps_placement must be one of {EPS_PLACEMENTS}, got {eps_placement!r}.")
    scale_offset = _check_scale_offset(scale_offset)
    n = math.prod(shape[a] for a in axes)
    if n == 0:
        raise ValueError(
            f"the normalized axes {axes} of x with shape {shape} hold no elements; "
            f"the RMS of an empty row is undefined."
        )
    n_global = n
    if axis_name is not None:
        n_global = n * _axis_name_size(axis_name)
        if p < 1.0 and len(axes) != 1:
            raise ValueError(
                f"p={p} with axis_name={axis_name!r} needs exactly one normalized axis "
                f"(split across devices in order), got axis={axis!r}."
            )
    mask = _check_mask(mask, shape, p, axis_name)
    dtypes = [x_dtype, *(a.dtype for a in (scale, bias) if a is not None), *promote_with]
    inferred = jnp.result_type(*dtypes)
    out_dtype = inferred if dtype is None else check_dtype(dtype)
    cfg = NormConfig(
        axes=axes,
        n=n,
        k=partial_count(n_global, p),
        n_global=n_global,
        eps=eps,
        inside=eps_placement == "inside",
        scale_offset=scale_offset,
        compute_dtype=np.dtype(jnp.promote_types(inferred, jnp.float32)),
        out_dtype=np.dtype(out_dtype),
        axis_name=axis_name,
        bias_type=None if bias is None else jax.typeof(bias),
    )
    return cfg, scale, bias, mask


def _check_mask(mask: Any, x_shape: tuple[int, ...], p: float, axis_name: Any):
    """``mask`` as a boolean array that broadcasts to ``x``, or None."""
    if mask is None:
        return None
    arr = mask if isinstance(mask, jax.Array) else jnp.asarray(mask)
    if arr.dtype != jnp.bool_:
        raise TypeError(
            f"mask must be a boolean array (True where an element enters the mean "
            f"square), got dtype {arr.dtype}; e.g. mask=(tokens != pad_id) or "
            f"mask.astype(bool)."
        )
    if not _broadcasts_to(arr.shape, x_shape):
        raise ValueError(
            f"mask with shape {arr.shape} does not broadcast to x's shape {x_shape}; give "
            f"it x's shape or one that broadcasts to it, e.g. {(*x_shape[:-1], 1)}."
        )
    if p < 1.0:
        raise ValueError(
            f"mask with p={p} is ambiguous (the first k features, or the first k unmasked "
            f"ones?); use p=1.0 with a mask, or drop the mask."
        )
    if axis_name is not None:
        raise ValueError(
            f"mask with axis_name={axis_name!r} is not supported (flax averages the "
            f"per-device masked means, which is not the masked mean of the whole row); "
            f"normalize under sharded jit instead of shard_map, or drop the mask."
        )
    return arr.astype(jnp.bool_)


def _check_scale_offset(scale_offset: Any) -> float:
    value = static_float("scale_offset", scale_offset, "e.g. 0.0 or 1.0")
    if not math.isfinite(value):
        raise ValueError(f"scale_offset must be finite, got {scale_offset!r}.")
    return value


def check_dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(jnp.dtype(dtype))
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype such as jnp.bfloat16, got {dtype!r}.")
    return dt


def check_implementation(implementation: Any) -> str:
    """``implementation`` if it names a path (:data:`IMPLEMENTATIONS`), else a ValueError."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}: "
            f"'xla' for the XLA path, 'pallas' for the fused kernels, a backend's name for "
            f"its kernels alone, 'auto' to let the library choose from measurements."
        )
    return implementation
