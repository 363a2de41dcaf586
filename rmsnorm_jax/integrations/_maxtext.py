"""``patch_maxtext()``: MaxText's ``RMSNorm`` through ``rms_norm``."""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._rms_norm import rms_norm
from ._patch import (
    PROBE_FEATURES,
    Case,
    Patch,
    Swap,
    apply,
    check_implementation,
    nnx_cases,
    own_call,
    param_value,
    restore_all,
)

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
    init = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    missing = [name for name in _MAXTEXT_INIT_ARGS if name not in init]
    call = list(inspect.signature(own_call(cls, "MaxText")).parameters)
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


def _maxtext_call(
    module: types.ModuleType, implementation: str, hit: Callable[[], None]
) -> Callable:
    """``RMSNorm.__call__`` for MaxText's class, computed by ``rms_norm``."""
    log = getattr(getattr(module, "max_logging", None), "log", None)

    def __call__(self, x, out_sharding=None):
        """MaxText's RMSNorm through ``rmsnorm_jax.rms_norm`` (``rmsnorm_jax.integrations``)."""
        hit()
        explicit = _is_explicit(self.shard_mode)
        out_sharding = _truncate(out_sharding, jnp.ndim(x)) if explicit else None
        scale = None
        if getattr(self, "with_scale", True):
            scale = param_value(self.scale)
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

    Before installing, the class runs on a probe input both ways (float32: outputs to
    1e-6 relative; bfloat16: the same dtype); a difference refuses the patch. Installing
    and undoing call ``jax.clear_caches()``, so no trace made with the other method is
    reused.

    Returns:
      a :class:`Patch`; ``patch.calls`` counts the norm calls traced through it since
      patching. ``patch.undo()``, leaving ``with patch_maxtext():``, or
      :func:`unpatch_maxtext` restores MaxText's method. Patching again (with another
      ``implementation``) replaces the previous patch; it never wraps it.

    Raises:
      ImportError: MaxText is not installed, or fails to import (the missing
        dependency is named).
      RuntimeError: its ``RMSNorm`` lacks a constructor argument or the
        ``__call__(x, out_sharding)`` this patch reads, or differs from ``rms_norm``
        on the probe (the message names the case and the difference).
      ValueError: an unknown ``implementation``.

    Example (needs MaxText)::

        import rmsnorm_jax.integrations

        rmsnorm_jax.integrations.patch_maxtext()  # before or after building the model
        # ... MaxText's train.train_step as usual: every RMSNorm is rms_norm ...
        rmsnorm_jax.integrations.unpatch_maxtext()

        with rmsnorm_jax.integrations.patch_maxtext(implementation="xla"):
            ...  # patched inside the block only
    """
    check_implementation(implementation)
    normalizations = _maxtext_module(module)
    cls = _check_maxtext_shape(normalizations)
    swap = Swap(
        cls,
        lambda original, impl, hit: _maxtext_call(normalizations, impl, hit),
        lambda method: _maxtext_probe(cls, method),
    )
    return apply("MaxText", "patch_maxtext()", [swap], implementation)


def _maxtext_probe(cls: type, method: Callable) -> list[Case]:
    """MaxText's norm as its models build it (ones-initialised ``x_hat * scale``;
    Qwen3-Next's zero-centred ``scale_offset=1``; QK-norm's ``with_scale=False`` where
    this MaxText has it), float32 and bfloat16."""
    from flax import nnx

    cases = []
    variants = {"default": {}, "scale_offset=1": {"scale_offset": 1.0}}
    init = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    if "with_scale" in init:
        variants["with_scale=False"] = {"with_scale": False}
    for name, kwargs in variants.items():
        for dtype in (jnp.float32, jnp.bfloat16):
            norm = cls(PROBE_FEATURES, dtype=dtype, rngs=nnx.Rngs(0), **kwargs)
            label = f"RMSNorm({name}, dtype={jnp.dtype(dtype).name})"
            cases += nnx_cases(label, norm, method)
    return cases


def unpatch_maxtext(*, module: types.ModuleType | str | None = None) -> None:
    """Restores MaxText's own ``RMSNorm.__call__`` (a no-op where it is not patched)."""
    restore_all([_check_maxtext_shape(_maxtext_module(module))])
