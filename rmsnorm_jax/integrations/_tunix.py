"""``patch_tunix()``: the norms of google-tunix's models through ``rms_norm``.

tunix (flax NNX) defines one ``RMSNorm`` class per model family, each with its own
parameter name, eps and dtype rule (tunix 0.1.7, ``tunix/models/<family>/model.py``):

========  ===========  =====  ==========  =====================  ==============================
family    parameter    init   eps         computed in            output dtype
========  ===========  =====  ==========  =====================  ==============================
gemma     ``scale``    zeros  1e-6        x's dtype              ``result_type(x, scale)``
gemma3    ``scale``    zeros  1e-6        x's dtype              ``result_type(x, scale)``
gemma4    ``scale``    ones   1e-6        float32                ``self.dtype``
llama3    ``w``        ones   norm_eps    float32 statistics     x's dtype
qwen2     ``w``        ones   norm_eps    float32                ``self.dtype``
qwen3     ``w``        ones   norm_eps    float32                ``self.dtype``
========  ===========  =====  ==========  =====================  ==============================

gemma and gemma3 multiply by ``1 + scale`` (zero-centred); the others by the parameter.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import warnings
from collections.abc import Callable, Sequence

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
    chosen,
    import_library,
    is_static_number,
    nnx_cases,
    norm_class,
    param_value,
    real_floating,
    restore_all,
)

_NOT_INSTALLED = (
    "patch_tunix() needs google-tunix, which is not installed: pip install google-tunix "
    "(tested with 0.1.7)."
)


def _zero_centred(original: Callable, implementation: str, hit: Callable[[], None]):
    """gemma, gemma3: ``x * rsqrt(mean(x**2) + 1e-6) * (1 + scale)``."""

    @jax.named_scope("rms_norm")
    def __call__(self, x):
        scale = param_value(self.scale)
        if not (real_floating(x) and real_floating(scale)):
            return original(self, x)
        hit()
        # tunix computes in x's dtype and multiplies by (1 + scale): its output dtype is
        # result_type(x, scale), rms_norm's default. Ours keeps float32 statistics.
        return rms_norm(x, scale, 1e-6, scale_offset=1.0, implementation=implementation)

    return __call__


def _gemma4(original: Callable, implementation: str, hit: Callable[[], None]):
    """gemma4: float32 ``x_hat * scale``, cast to ``self.dtype``."""

    def __call__(self, x):
        scale = param_value(self.scale)
        if not (real_floating(x) and real_floating(scale)):
            return original(self, x)
        hit()
        return rms_norm(x, scale, 1e-6, dtype=self.dtype, implementation=implementation)

    return __call__


def _plain(dtype_of: str, original: Callable, implementation: str, hit: Callable[[], None]):
    """llama3 (``dtype_of="x"``), qwen2 and qwen3 (``"self"``): float32
    ``w * x / sqrt(mean(x**2) + norm_eps)`` in ``x.dtype`` or ``self.dtype``."""

    @jax.named_scope("rms_norm")
    def __call__(self, x):
        w = param_value(self.w)
        if not (real_floating(x) and real_floating(w) and is_static_number(self.norm_eps)):
            return original(self, x)
        hit()
        dtype = x.dtype if dtype_of == "x" else self.dtype
        return rms_norm(x, w, self.norm_eps, dtype=dtype, implementation=implementation)

    return __call__


F = PROBE_FEATURES
BF16, F32 = jnp.bfloat16, jnp.float32
# family: (the replacement, the constructors the probe builds: label -> kwargs). The
# models build each norm with one of these (the config's param_dtype and dtype).
_FAMILIES: dict[str, tuple[Callable, dict[str, Callable]]] = {
    "gemma": (_zero_centred, {"default": lambda c, r: c(F, rngs=r)}),
    "gemma3": (
        _zero_centred,
        {
            "param_dtype=bfloat16": lambda c, r: c(F, rngs=r),
            "param_dtype=float32": lambda c, r: c(F, rngs=r, param_dtype=F32),
        },
    ),
    "gemma4": (
        _gemma4,
        {
            "dtype=float32": lambda c, r: c(F, rngs=r, dtype=F32, param_dtype=F32),
            "dtype=bfloat16": lambda c, r: c(F, rngs=r, dtype=BF16, param_dtype=F32),
        },
    ),
    "llama3": (
        functools.partial(_plain, "x"),
        {"norm_eps=1e-5": lambda c, r: c(F, norm_eps=1e-5, rngs=r)},
    ),
    "qwen2": (
        functools.partial(_plain, "self"),
        {
            "dtype=float32": lambda c, r: c(F, norm_eps=1e-5, dtype=F32, param_dtype=F32),
            "dtype=bfloat16": lambda c, r: c(F, norm_eps=1e-5, dtype=BF16, param_dtype=F32),
        },
    ),
    "qwen3": (
        functools.partial(_plain, "self"),
        {
            "dtype=float32": lambda c, r: c(F, norm_eps=1e-5, rngs=r, dtype=F32, param_dtype=F32),
            "dtype=bfloat16": lambda c, r: c(
                F, norm_eps=1e-5, rngs=r, dtype=BF16, param_dtype=BF16
            ),
        },
    ),
}


def _probe(cls: type, builders: dict[str, Callable]) -> Callable[[Callable], list[Case]]:
    def probe(method: Callable) -> list[Case]:
        from flax import nnx

        cases = []
        for label, build in builders.items():
            cases += nnx_cases(f"RMSNorm({label})", build(cls, nnx.Rngs(0)), method)
        return cases

    return probe


def _model_module(family: str):
    """``tunix.models.<family>.model``, or None where this tunix has no such family."""
    name = f"tunix.models.{family}.model"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name in (name, f"tunix.models.{family}"):
            return None
        raise ImportError(
            f"tunix is installed but {name} failed to import ({err}): install "
            "google-tunix with its dependencies."
        ) from err


def _classes() -> dict[str, type]:
    """The norm class of every family this tunix has: ``{family: class}``."""
    models = import_library("tunix.models", _NOT_INSTALLED)
    classes = {}
    for family in _FAMILIES:
        module = _model_module(family)
        if module is None:
            continue
        classes[family] = norm_class(module, "patch_tunix()", "google-tunix 0.1.7")
    if not classes:
        raise RuntimeError(
            "patch_tunix() found none of tunix's model families "
            f"({', '.join(_FAMILIES)}) in this tunix; it knows google-tunix 0.1.7."
        )
    unknown = []
    for info in pkgutil.iter_modules(models.__path__):
        if info.ispkg and info.name not in _FAMILIES:
            module = _model_module(info.name)
            if module is not None and isinstance(getattr(module, "RMSNorm", None), type):
                unknown.append(f"{module.__name__}.RMSNorm")
    if unknown:
        warnings.warn(
            f"patch_tunix() does not know {', '.join(unknown)} (newer than google-tunix "
            "0.1.7): those norms stay tunix's own. Please report it with the version.",
            stacklevel=3,
        )
    return classes


def patch_tunix(
    implementation: str = "auto", *, families: str | Sequence[str] | None = None
) -> Patch:
    r"""Routes the norm of every tunix model family through :func:`rmsnorm_jax.rms_norm`.

    Replaces ``RMSNorm.__call__`` in ``tunix.models.<family>.model`` for gemma, gemma3,
    gemma4, llama3, qwen2 and qwen3 (those this tunix has), so every norm of every tunix
    model (the layers' norms, QK-norm, the final norm, gemma3's multimodal embedding
    norm) computes with ``rms_norm``; call it before or after the model is built. The
    constructors are tunix's, so the parameter keeps its name (``scale`` or ``w``), shape
    ``(dim,)``, ``param_dtype``, initializer and sharding metadata, and checkpoints and
    ``nnx.update`` load unchanged. Each family keeps its own semantics::

        gemma, gemma3:  y = x / sqrt(mean(x**2) + 1e-6) * (1 + scale)     # zero-centred
        gemma4:         y = x / sqrt(mean(x**2) + 1e-6) * scale
        llama3, qwen*:  y = x / sqrt(mean(x**2) + norm_eps) * w

    over the last axis, computed in float32 (float64 stays float64) and rounded once to
    the family's output dtype: ``result_type(x, scale)`` for gemma and gemma3, ``x``'s
    dtype for llama3, the module's ``dtype`` for gemma4, qwen2 and qwen3. tunix's gemma
    and gemma3 norms keep the statistic in ``x``'s dtype (bfloat16 under bfloat16
    activations); this one keeps it in float32, which is nearer to exact arithmetic and,
    in float32, the same to a rounding. The gradient is ``rms_norm``'s analytic backward
    (residuals: ``x``, the parameter, one float32 per row).

    Not reached: gemma4's value norm (a line inside ``Attention.__call__``, not a class).

    Before installing, every class runs on a probe input both ways (float32: outputs to
    1e-6 relative; bfloat16: the same output dtype); a difference refuses the patch.
    Installing and undoing call ``jax.clear_caches()``, so a step traced before runs the
    new method at its next call.

    Args:
      implementation: passed to ``rms_norm``: ``"auto"`` (default), ``"xla"`` or
        ``"pallas"``.
      families: the families to patch (``"gemma"``, ``"gemma3"``, ``"gemma4"``,
        ``"llama3"``, ``"qwen2"``, ``"qwen3"``); None (default): every one this tunix has.
        The others keep tunix's norm, e.g. where a step measured more memory with ours
        (docs/integrations.md).

    Returns:
      a :class:`Patch`: ``patch.calls`` counts the norm calls traced through it since
      patching, per class in ``patch.calls_by_target``; ``patch.undo()``, leaving its
      ``with`` block, or :func:`unpatch_tunix` restores tunix's methods. Patching again
      replaces the previous patch; it never wraps it.

    Raises:
      ImportError: tunix is not installed, or a model module fails to import.
      RuntimeError: a class lacks what this patch reads, or differs from ``rms_norm`` on
        the probe (the message names the class, the case and the difference).
      ValueError: an unknown ``implementation``, or a family this tunix lacks.

    Example (needs google-tunix)::

        from rmsnorm_jax.integrations import patch_tunix
        from tunix.models.qwen3 import model as qwen3

        patch = patch_tunix()
        model = qwen3.Qwen3(config, rngs=nnx.Rngs(0))  # or built before the patch
        logits, _ = model(tokens, positions, None, attention_mask)
        assert patch.calls > 0, patch  # "reached nothing" otherwise
    """
    check_implementation(implementation)
    swaps = [
        Swap(cls, _FAMILIES[family][0], _probe(cls, _FAMILIES[family][1]))
        for family, cls in chosen("patch_tunix()", _classes(), families).items()
    ]
    return apply("tunix", "patch_tunix()", swaps, implementation)


def unpatch_tunix() -> None:
    """Restores tunix's own ``RMSNorm.__call__`` in every family (a no-op where unpatched)."""
    restore_all(list(_classes().values()))
