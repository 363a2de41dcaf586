"""``patch_flax()``: ``flax.nnx.RMSNorm`` and ``flax.linen.RMSNorm`` through ``rms_norm``."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._config import normalize_axes
from .._module_utils import feature_param_shapes
from .._rms_norm import rms_norm
from ._patch import (
    PROBE_FEATURES,
    Case,
    Patch,
    Swap,
    apply,
    check_implementation,
    linen_cases,
    linen_method,
    nnx_cases,
    own_call,
    real_floating,
    restore_all,
)

_FLAX_FIELDS = (
    "epsilon",
    "dtype",
    "param_dtype",
    "use_scale",
    "scale_init",
    "reduction_axes",
    "feature_axes",
    "axis_name",
    "axis_index_groups",
)


def _flax_supported(mdl: Any, x: Any, scale: Any, mask: Any) -> bool:
    """Whether ``rms_norm`` computes what flax's RMSNorm would for this call.

    Otherwise the patched method calls flax's own: ``axis_index_groups`` (no psum over
    groups here), ``force_float32_reductions=False`` (statistics in a half dtype),
    complex or integer inputs, a ``mask`` that is not boolean (linen converts it, NNX
    refuses it) or comes with ``axis_name`` (flax averages per-device masked means),
    axes flax rejects or an empty row (flax's error or NaN).
    """
    if mdl.axis_index_groups is not None or not getattr(mdl, "force_float32_reductions", True):
        return False
    if not (real_floating(x) and real_floating(scale)):
        return False
    if mask is not None and (mdl.axis_name is not None or jnp.result_type(mask) != jnp.bool_):
        return False
    ndim = jnp.ndim(x)
    try:
        axes = normalize_axes(mdl.reduction_axes, ndim, "reduction_axes")
        normalize_axes(mdl.feature_axes, ndim, "feature_axes")
    except (TypeError, ValueError):
        return False
    return math.prod(jnp.shape(x)[a] for a in axes) > 0


def _flax_norm(mdl: Any, x, scale, mask, implementation: str) -> jax.Array:
    return rms_norm(
        x,
        scale,
        mdl.epsilon,
        axis=mdl.reduction_axes,
        dtype=mdl.dtype,
        axis_name=mdl.axis_name,
        mask=mask,
        implementation=implementation,
    )


def _nnx_call(original: Callable, implementation: str, hit: Callable[[], None]) -> Callable:
    def __call__(self, x, mask=None):
        """flax.nnx.RMSNorm through ``rmsnorm_jax.rms_norm`` (``rmsnorm_jax.integrations``)."""
        scale = None if self.scale is None else self.scale[...]
        px, pscale = self.promote_dtype((x, scale), dtype=self.dtype)
        if not _flax_supported(self, px, pscale, mask):
            return original(self, x, mask)
        feature_shape, broadcast_shape = feature_param_shapes(jnp.shape(px), self.feature_axes)
        if pscale is not None:
            if math.prod(feature_shape) != math.prod(jnp.shape(pscale)):
                return original(self, x, mask)  # flax's own reshape error
            pscale = jnp.reshape(pscale, broadcast_shape)
        hit()
        return _flax_norm(self, px, pscale, mask, implementation)

    return __call__


def _linen_call(original: Callable, implementation: str, hit: Callable[[], None]) -> Callable:
    def call(self, x, *, mask=None):
        """flax.linen.RMSNorm through ``rmsnorm_jax.rms_norm`` (``rmsnorm_jax.integrations``)."""
        x = jnp.asarray(x)
        if not _flax_supported(self, x, None, mask) or not real_floating(self.param_dtype):
            return original(self, x, mask=mask)
        shape, broadcast_shape = feature_param_shapes(jnp.shape(x), self.feature_axes)
        scale = None
        if self.use_scale:
            scale = self.param("scale", self.scale_init, shape, self.param_dtype)
            scale = jnp.reshape(scale, broadcast_shape)
        hit()
        return _flax_norm(self, x, scale, mask, implementation)

    return linen_method(call)


def _flax_classes() -> list[type]:
    from flax import linen, nnx

    classes = [nnx.RMSNorm, linen.RMSNorm]
    nnx_init = inspect.signature(nnx.RMSNorm.__init__).parameters
    linen_fields = {f for f in getattr(linen.RMSNorm, "__dataclass_fields__", {})}
    for cls, have in ((nnx.RMSNorm, nnx_init), (linen.RMSNorm, linen_fields)):
        missing = [f for f in _FLAX_FIELDS if f not in have]
        if missing:
            raise RuntimeError(
                f"{cls.__module__}.{cls.__qualname__} no longer has {', '.join(missing)}: "
                "this flax is not the shape patch_flax() knows (flax 0.11-0.12). Please "
                "report it with the version."
            )
        own_call(cls, "flax")
    return classes


def patch_flax(implementation: str = "auto") -> Patch:
    r"""Routes ``flax.nnx.RMSNorm`` and ``flax.linen.RMSNorm`` through ``rms_norm``.

    Replaces both classes' ``__call__``, so every model built from them (before or after
    the call) normalizes with :func:`rmsnorm_jax.rms_norm`; the parameter tree is
    flax's own (``scale``, its shape, ``param_dtype``, initializer and metadata), so
    checkpoints load unchanged. Every option keeps its flax meaning: ``epsilon``,
    ``dtype`` and ``param_dtype`` (NNX's ``promote_dtype`` first), ``use_scale``,
    ``scale_init``, ``reduction_axes``, ``feature_axes``, ``axis_name`` (the mean square
    summed across the mapped axis), ``mask`` (the mean square over its True positions),
    ``use_fast_variance`` (no effect on an RMS, in flax too).

    Formula, per row over ``reduction_axes``: ``y = x / sqrt(mean(x**2) + epsilon) *
    scale``, computed in ``promote_types(result_type(x, scale), float32)`` and cast to
    ``dtype``, else to ``result_type(x, scale)`` (flax's rules; flax multiplies
    ``rsqrt(ms + eps) * scale`` first, so float32 results agree to a rounding). A row
    whose ``mask`` is all False is normalized like an all-zero row (finite) where flax
    gives NaN.

    Where a call cannot be computed exactly so (``axis_index_groups``,
    ``force_float32_reductions=False``, complex or integer ``x``, a ``mask`` that is not
    boolean, ``mask`` with ``axis_name``), that call runs flax's own method.

    Args:
      implementation: passed to ``rms_norm``: ``"auto"`` (default), ``"xla"`` or
        ``"pallas"``.

    Before installing, both classes run on a probe input both ways (float32: outputs to
    1e-6 relative; bfloat16: the same dtype; linen: the same parameter tree); a
    difference refuses the patch. Installing and undoing call ``jax.clear_caches()``, so
    no trace made with the other method is reused.

    Returns:
      a :class:`Patch`; ``patch.calls`` counts the norm calls traced through
      ``rms_norm`` since patching (a call that runs flax's own method is not counted).
      ``undo()``, leaving its ``with`` block, or :func:`unpatch_flax` restores flax's
      methods. Patching again replaces the previous patch.

    Raises:
      RuntimeError: an ``RMSNorm`` of this flax lacks an option this patch reads, or
        differs from ``rms_norm`` on the probe (the message names the difference).
      ValueError: an unknown ``implementation``.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from rmsnorm_jax.integrations import patch_flax
    >>> norm = nnx.RMSNorm(4, rngs=nnx.Rngs(0))
    >>> x = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    >>> with patch_flax() as patch:
    ...     y = norm(x)  # rmsnorm_jax.rms_norm, flax's parameters
    >>> [round(v, 4) for v in y[0].tolist()]
    [0.3651, 0.7303, 1.0954, 1.4606]
    >>> patch.calls  # the model reached the patch once
    1
    """
    check_implementation(implementation)
    nnx_cls, linen_cls = _flax_classes()
    swaps = [
        Swap(nnx_cls, _nnx_call, _nnx_probe),
        Swap(linen_cls, _linen_call, _linen_probe),
    ]
    return apply("flax", "patch_flax()", swaps, implementation)


_PROBE_OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "use_scale=False": {"use_scale": False},
    "reduction_axes=(-2, -1)": {"reduction_axes": (-2, -1), "feature_axes": -1},
}


def _nnx_probe(method: Callable) -> list[Case]:
    from flax import nnx

    cases = []
    for name, options in _PROBE_OPTIONS.items():
        norm = nnx.RMSNorm(PROBE_FEATURES, rngs=nnx.Rngs(0), **options)
        cases += nnx_cases(f"nnx.RMSNorm({name})", norm, method)
    return cases


def _linen_probe(method: Callable) -> list[Case]:
    from flax import linen as nn

    cases = []
    for name, options in _PROBE_OPTIONS.items():
        cases += linen_cases(f"linen.RMSNorm({name})", nn.RMSNorm(**options), method)
    return cases


def unpatch_flax() -> None:
    """Restores flax's own ``RMSNorm.__call__`` (NNX and linen; a no-op where unpatched)."""
    restore_all(_flax_classes())
