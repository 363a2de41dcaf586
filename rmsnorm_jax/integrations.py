"""One call puts another library's RMSNorm through :func:`rmsnorm_jax.rms_norm`.

``patch_maxtext()`` replaces ``RMSNorm.__call__`` in MaxText's ``normalizations`` module;
``patch_flax()`` replaces ``flax.nnx.RMSNorm.__call__`` and ``flax.linen.RMSNorm.__call__``.
Only the method that computes the norm changes: the classes, their constructors and
their parameters (names, shapes, dtypes, sharding metadata) stay the library's own, so
checkpoints load unchanged, and every place that holds the class (imported by name,
subclassed, wrapped) gets the new method, whether its model was built before or after the
call. Each returns a :class:`Patch`: ``undo()`` it, or use it as a context manager.

Importing this module imports neither MaxText nor anything beyond flax; ``patch_maxtext``
imports MaxText when called.
"""

from __future__ import annotations

import importlib
import inspect
import math
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._config import normalize_axes
from ._functional import rms_norm
from ._module_utils import feature_param_shapes
from .nnx import IMPLEMENTATIONS

__all__ = ["Patch", "patch_flax", "patch_maxtext", "unpatch_flax", "unpatch_maxtext"]

# The function a patch installs carries the library's own method here, so that patching
# twice wraps the original once, and unpatching finds it whatever was patched on top.
_ORIGINAL = "__rmsnorm_jax_original__"

# Where MaxText keeps its norm: the package since 0.2, the old top-level name before.
MAXTEXT_MODULES = ("maxtext.layers.normalizations", "MaxText.layers.normalizations")
_MAXTEXT_INIT_ARGS = (
    "num_features",
    "epsilon",
    "dtype",
    "weight_dtype",
    "shard_mode",
    "kernel_axes",
    "scale_init",
    "parameter_memory_host_offload",
    "scale_offset",
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


class Patch:
    """What one ``patch_*`` call replaced; ``undo()`` or leaving its ``with`` block puts
    back the methods that were in place when it was made (the library's own, or an
    earlier patch's). ``unpatch_maxtext()`` / ``unpatch_flax()`` restore the library's
    own whatever was patched.

    Attributes:
      targets: the replaced methods, as ``"module.Class.__call__"``.
      implementation: the ``implementation=`` the patched methods pass to ``rms_norm``.
    """

    def __init__(self, replaced: list[tuple[type, Callable]], implementation: str):
        self._replaced = tuple(replaced)
        self.implementation = implementation
        self.targets = tuple(f"{c.__module__}.{c.__qualname__}.__call__" for c, _ in replaced)

    def undo(self) -> None:
        """Puts back what this patch replaced; a second ``undo()`` does nothing."""
        for cls, before in reversed(self._replaced):
            type.__setattr__(cls, "__call__", before)
        self._replaced = ()

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"Patch(targets={list(self.targets)}, implementation={self.implementation!r})"


def _check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}; use "
            "'auto' (the measured default per backend and shape), 'xla' or 'pallas'."
        )


def _own_call(cls: type, library: str) -> Callable:
    """The library's own ``cls.__call__``, seen through any patch of ours."""
    method = cls.__dict__.get("__call__")
    if not callable(method):
        raise RuntimeError(
            f"{cls.__module__}.{cls.__qualname__} defines no __call__ of its own; this "
            f"version of {library} is not the shape rmsnorm_jax.integrations knows. "
            "Please report it with the version."
        )
    return getattr(method, _ORIGINAL, method)


def _install(cls: type, original: Callable, replacement: Callable) -> tuple[type, Callable]:
    """Sets ``cls.__call__`` to ``replacement``; returns ``(cls, what was there)``."""
    before = cls.__dict__["__call__"]
    setattr(replacement, _ORIGINAL, original)
    type.__setattr__(cls, "__call__", replacement)
    return cls, before


def _restore(cls: type) -> None:
    method = cls.__dict__.get("__call__")
    original = getattr(method, _ORIGINAL, None)
    if original is not None:
        type.__setattr__(cls, "__call__", original)


# ---------------------------------------------------------------- MaxText


def _maxtext_module(module: types.ModuleType | str | None) -> types.ModuleType:
    """MaxText's ``normalizations`` module: ``module`` itself, imported by name, or found."""
    if isinstance(module, types.ModuleType):
        return module
    names = MAXTEXT_MODULES if module is None else (module,)
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is None or not name.startswith(err.name.split(".")[0]):
                raise ImportError(
                    f"MaxText is installed but {name} failed to import ({err}): install "
                    "MaxText with its dependencies, e.g. pip install 'maxtext[tpu]' or "
                    "'maxtext[cuda12]'."
                ) from err
    if module is not None:
        raise ImportError(f"patch_maxtext(module={module!r}): no module of that name.")
    raise ImportError(
        "patch_maxtext() needs MaxText (maxtext.layers.normalizations), which is not "
        "installed: pip install maxtext (it needs Python >= 3.12 and a recent jax)."
    )


def _check_maxtext_shape(module: types.ModuleType) -> type:
    """MaxText's ``RMSNorm`` class, after checking it has the constructor and call this
    patch reads; a RuntimeError naming what differs otherwise."""
    cls = getattr(module, "RMSNorm", None)
    where = f"{module.__name__}.RMSNorm"
    if not isinstance(cls, type):
        raise RuntimeError(
            f"{module.__name__} has no RMSNorm class: this MaxText is not the shape "
            "patch_maxtext() knows (MaxText 0.2.x). Please report it with the version."
        )
    init = inspect.signature(cls.__init__).parameters
    missing = [name for name in _MAXTEXT_INIT_ARGS if name not in init]
    call = list(inspect.signature(_own_call(cls, "MaxText")).parameters)
    if call[1:3] != ["x", "out_sharding"]:
        missing.append(f"__call__(self, x, out_sharding) (found {call})")
    if missing:
        raise RuntimeError(
            f"{where} no longer has what patch_maxtext() reads: missing "
            f"{', '.join(missing)}. This MaxText is newer or older than the shape it "
            "knows (MaxText 0.2.x); please report it with the version."
        )
    return cls


def _is_explicit(shard_mode: Any) -> bool:
    """``shard_mode == ShardMode.EXPLICIT`` without importing MaxText's enum."""
    return getattr(shard_mode, "value", shard_mode) == "explicit"


def _spec(a: jax.Array) -> tuple:
    """The partition spec of ``a``'s type, one entry per dimension."""
    spec = tuple(getattr(jax.typeof(a).sharding, "spec", None) or ())
    return spec + (None,) * (jnp.ndim(a) - len(spec))


def _truncate(out_sharding: Any, ndim: int) -> Any:
    """MaxText's ``truncate_out_sharding``: a spec longer than the array loses its tail."""
    P = jax.sharding.PartitionSpec
    if isinstance(out_sharding, jax.sharding.NamedSharding) and len(out_sharding.spec) > ndim:
        return jax.sharding.NamedSharding(out_sharding.mesh, P(*out_sharding.spec[:ndim]))
    if isinstance(out_sharding, P) and len(out_sharding) > ndim:
        return P(*out_sharding[:ndim])
    if isinstance(out_sharding, (tuple, list)) and len(out_sharding) > ndim:
        return tuple(out_sharding[:ndim])
    return out_sharding


def _align_scale(scale: jax.Array, x: jax.Array) -> jax.Array:
    """The scale resharded like ``x``'s normalized axis (MaxText's explicit-mode step).

    The scale is stored for the embedding axis; a per-head QK-norm normalizes the
    unsharded ``head_dim`` while ``heads`` holds the mesh axis, and an explicit multiply
    would then put one mesh axis on two dimensions.
    """
    activation_axis = _spec(x)[-1]
    if _spec(scale)[-1] == activation_axis:
        return scale
    spec = jax.typeof(scale).sharding.spec
    tags = {k: getattr(spec, k) for k in ("unreduced", "reduced") if getattr(spec, k, None)}
    return jax.sharding.reshard(scale, jax.sharding.PartitionSpec(activation_axis, **tags))


def _param_value(param: Any) -> jax.Array:
    return param.get_value() if hasattr(param, "get_value") else param[...]


def _maxtext_call(module: types.ModuleType, implementation: str) -> Callable:
    """``RMSNorm.__call__`` for MaxText's class, computed by ``rms_norm``."""
    log = getattr(getattr(module, "max_logging", None), "log", None)

    def __call__(self, x, out_sharding=None):
        """MaxText's RMSNorm through ``rmsnorm_jax.rms_norm`` (``rmsnorm_jax.integrations``)."""
        explicit = _is_explicit(self.shard_mode)
        out_sharding = _truncate(out_sharding, jnp.ndim(x)) if explicit else None
        scale = None
        if getattr(self, "with_scale", True):
            scale = _param_value(self.scale)
            if self.parameter_memory_host_offload:
                if log is not None:
                    log("normalizations.py: Moving scale parameter to device")
                scale = jax.device_put(scale, jax.memory.Space.Device)
            if explicit:
                scale = _align_scale(scale, x)
        y = rms_norm(
            x,
            scale,
            self.epsilon,
            scale_offset=self.scale_offset,
            dtype=jnp.float32 if self.dtype is None else self.dtype,
            implementation=implementation,
        )
        if out_sharding is None:
            return y
        if scale is None:  # MaxText constrains the unscaled x_hat, and reshards the einsum
            return jax.lax.with_sharding_constraint(y, out_sharding)
        return jax.sharding.reshard(y, out_sharding)

    return __call__


def patch_maxtext(
    implementation: str = "auto", *, module: types.ModuleType | str | None = None
) -> Patch:
    r"""Routes every MaxText ``RMSNorm`` through :func:`rmsnorm_jax.rms_norm`.

    Replaces ``RMSNorm.__call__`` in MaxText's ``normalizations`` module, so every norm
    of every MaxText model computes with this library: the decoder layers' norms
    (``llama2.py`` and the others import the class by name and hold the same class
    object), the final norm, QK-norm, ``GlobalRMSNorm`` (its ``__call__`` calls this one
    on the flattened heads), ``Qwen3NextRMSNorm`` and the linen wrappers
    (``normalizations.rms_norm``). Call it before or after the model is built; the
    constructor is MaxText's, so the ``scale`` parameter keeps its name, shape
    ``(num_features,)``, ``weight_dtype``, initializer and ``out_sharding`` metadata
    (``kernel_axes``), and checkpoints load unchanged.

    The formula, over the last axis of ``x``::

        y = (x / sqrt(mean(x**2) + epsilon)) * (scale + scale_offset)

    computed in float32 (float64 stays float64) and rounded once to ``dtype``
    (MaxText's ``dtype``; float32 where it is None). MaxText's own norm rounds
    ``x_hat`` to ``dtype`` and multiplies the scale in ``dtype``, a second rounding,
    when ``scale_offset == 0`` (its Gemma converters fold Gemma's ``+1`` into the
    stored scale, so Gemma runs here too); in float32 the two agree to a rounding, in
    bfloat16 this one is the nearer to float32 arithmetic. ``with_scale=False`` gives
    ``x_hat`` in ``dtype``. The gradient is ``rms_norm``'s analytic backward (residuals:
    ``x``, ``scale``, one float32 per row), returned in the dtypes of ``x`` and ``scale``.

    As MaxText's ``__call__`` does: ``out_sharding`` is used only with
    ``shard_mode=ShardMode.EXPLICIT`` (truncated to ``x.ndim`` entries, the output
    resharded to it); in explicit mode the scale is resharded like ``x``'s last axis
    when they differ (QK-norm over an unsharded ``head_dim``); with
    ``parameter_memory_host_offload`` the scale is moved to device memory first.

    Args:
      implementation: passed to ``rms_norm``: ``"auto"`` (default), ``"xla"`` or
        ``"pallas"``.
      module: MaxText's ``normalizations`` module or its import name; default
        ``maxtext.layers.normalizations`` (``MaxText.layers.normalizations`` for
        releases before 0.2). Give it for a fork that keeps the same ``RMSNorm``.

    Returns:
      a :class:`Patch`; ``patch.undo()``, leaving ``with patch_maxtext():``, or
      :func:`unpatch_maxtext` restores MaxText's method. Patching again (with another
      ``implementation``) replaces the previous patch; it never wraps it.

    Raises:
      ImportError: MaxText is not installed, or fails to import (the missing
        dependency is named).
      RuntimeError: its ``RMSNorm`` lacks a constructor argument or the
        ``__call__(x, out_sharding)`` this patch reads.
      ValueError: an unknown ``implementation``.

    Example (needs MaxText)::

        import rmsnorm_jax.integrations

        rmsnorm_jax.integrations.patch_maxtext()  # before or after building the model
        # ... MaxText's train.train_step as usual: every RMSNorm is rms_norm ...
        rmsnorm_jax.integrations.unpatch_maxtext()

        with rmsnorm_jax.integrations.patch_maxtext(implementation="xla"):
            ...  # patched inside the block only
    """
    _check_implementation(implementation)
    normalizations = _maxtext_module(module)
    cls = _check_maxtext_shape(normalizations)
    original = _own_call(cls, "MaxText")
    replacement = _maxtext_call(normalizations, implementation)
    return Patch([_install(cls, original, replacement)], implementation)


def unpatch_maxtext(*, module: types.ModuleType | str | None = None) -> None:
    """Restores MaxText's own ``RMSNorm.__call__`` (a no-op where it is not patched)."""
    _restore(_check_maxtext_shape(_maxtext_module(module)))


# ---------------------------------------------------------------- flax


def _real_floating(a: Any) -> bool:
    return a is None or jnp.issubdtype(jnp.result_type(a), jnp.floating)


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
    if not (_real_floating(x) and _real_floating(scale)):
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


def _nnx_call(original: Callable, implementation: str) -> Callable:
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
        return _flax_norm(self, px, pscale, mask, implementation)

    return __call__


def _linen_call(original: Callable, implementation: str) -> Callable:
    from flax import linen as nn

    def call(self, x, *, mask=None):
        """flax.linen.RMSNorm through ``rmsnorm_jax.rms_norm`` (``rmsnorm_jax.integrations``)."""
        x = jnp.asarray(x)
        if not _flax_supported(self, x, None, mask) or not _real_floating(self.param_dtype):
            return original(self, x, mask=mask)
        shape, broadcast_shape = feature_param_shapes(jnp.shape(x), self.feature_axes)
        scale = None
        if self.use_scale:
            scale = self.param("scale", self.scale_init, shape, self.param_dtype)
            scale = jnp.reshape(scale, broadcast_shape)
        return _flax_norm(self, x, scale, mask, implementation)

    # A linen Module's methods run inside its scope handling, which linen adds to the
    # methods a Module subclass defines: this class exists to have it added.
    call.__name__ = "__call__"

    class _Wrapped(nn.Module):
        __call__ = nn.compact(call)

    return _Wrapped.__dict__["__call__"]


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
        _own_call(cls, "flax")
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

    Returns:
      a :class:`Patch`; ``undo()``, leaving its ``with`` block, or :func:`unpatch_flax`
      restores flax's methods. Patching again replaces the previous patch.

    Raises:
      RuntimeError: an ``RMSNorm`` of this flax lacks an option this patch reads.
      ValueError: an unknown ``implementation``.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from rmsnorm_jax.integrations import patch_flax
    >>> norm = nnx.RMSNorm(4, rngs=nnx.Rngs(0))
    >>> x = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    >>> with patch_flax():
    ...     y = norm(x)  # rmsnorm_jax.rms_norm, flax's parameters
    >>> [round(v, 4) for v in y[0].tolist()]
    [0.3651, 0.7303, 1.0954, 1.4606]
    """
    _check_implementation(implementation)
    replaced = []
    for cls, make in zip(_flax_classes(), (_nnx_call, _linen_call), strict=True):
        original = _own_call(cls, "flax")
        replacement = make(original, implementation)
        replaced.append(_install(cls, original, replacement))
    return Patch(replaced, implementation)


def unpatch_flax() -> None:
    """Restores flax's own ``RMSNorm.__call__`` (NNX and linen; a no-op where unpatched)."""
    for cls in _flax_classes():
        _restore(cls)
