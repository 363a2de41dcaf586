"""``patch_gemma()``: the norms of Google DeepMind's ``gemma`` library through ``rms_norm``.

gemma (flax linen) defines four ``RMSNorm`` classes (gemma 4.0.1), each over the last
axis with eps 1e-6, computed in ``x``'s dtype, its output ``result_type(x, scale)``:

===============================  =====  ==================================================
class                            init   formula
===============================  =====  ==================================================
``gm.nn._layers`` (Gemma 2, 3)   zeros  ``x_hat * (1 + scale)``
``gm.nn.gemma4._layers``         ones   ``x_hat * scale``; ``with_scale=False``: ``x_hat``
``gm.nn.gemma4.vision._norms``   zeros  ``x_hat * scale``
``gm.nn.gemma3n._layers``        field  ``x_hat * (1 + scale)`` or ``* scale``
                                        (``scale_plus_one``), ``with_scale``,
                                        ``guard_against_excess_precision``
===============================  =====  ==================================================
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from .._rms_norm import rms_norm
from ._patch import (
    Case,
    Patch,
    Swap,
    apply,
    check_implementation,
    chosen,
    import_library,
    linen_cases,
    linen_method,
    norm_class,
    real_floating,
    restore_all,
)

_NOT_INSTALLED = (
    "patch_gemma() needs Google DeepMind's gemma library, which is not installed: "
    "pip install gemma (Python >= 3.12; tested with gemma 4.0.1)."
)


def _norm(x, scale, offset: float, implementation: str) -> jax.Array:
    # gemma computes in x's dtype and multiplies by the scale: its output dtype is
    # result_type(x, scale), rms_norm's default. Ours keeps float32 statistics.
    return rms_norm(x, scale, 1e-6, scale_offset=offset, implementation=implementation)


def _scaled(
    init, offset: float, optional: bool, original: Callable, implementation: str, hit: Callable
):
    """Gemma 2/3 (``offset=1``, zeros) and gemma4's text and vision norms (``offset=0``,
    ones / zeros): ``x_hat * (offset + scale)``; with ``optional`` (gemma4's text norm),
    no scale where ``self.with_scale`` is False."""

    def call(self, x):
        x = jnp.asarray(x)
        if not real_floating(x):
            return original(self, x)
        scale = None
        if not optional or self.with_scale:
            scale = self.param("scale", init, (x.shape[-1]))
        hit()
        return _norm(x, scale, offset, implementation)

    return linen_method(call)


def _gemma3n(original: Callable, implementation: str, hit: Callable[[], None]):
    """``gm.nn.gemma3n._layers.RMSNorm``: its fields decide init, offset and scale."""

    def call(self, x):
        x = jnp.asarray(x)
        if not real_floating(x):
            return original(self, x)
        if self.guard_against_excess_precision:  # gemma3n's own reduce_precision
            finfo = jnp.finfo(x.dtype)
            x = jax.lax.reduce_precision(x, finfo.nexp, finfo.nmant)
        scale = None
        if self.with_scale:
            scale = self.param("scale", self.scale_init, (x.shape[-1]))
        hit()
        return _norm(x, scale, 1.0 if self.scale_plus_one else 0.0, implementation)

    return linen_method(call)


# module: (the replacement, the field sets the probe builds: label -> fields)
_CLASSES: dict[str, tuple[Callable, dict[str, dict]]] = {
    "gemma.gm.nn._layers": (
        functools.partial(_scaled, nn.initializers.zeros_init(), 1.0, False),
        {"": {}},
    ),
    "gemma.gm.nn.gemma4._layers": (
        functools.partial(_scaled, nn.initializers.ones, 0.0, True),
        {"": {}, "with_scale=False": {"with_scale": False}},
    ),
    "gemma.gm.nn.gemma4.vision._norms": (
        functools.partial(_scaled, nn.initializers.zeros_init(), 0.0, False),
        {"": {}},
    ),
    "gemma.gm.nn.gemma3n._layers": (
        _gemma3n,
        {
            "": {},
            "scale_plus_one=False": {"scale_plus_one": False},
            "with_scale=False": {"with_scale": False},
            "guard_against_excess_precision=True": {"guard_against_excess_precision": True},
        },
    ),
}


# The family names of ``patch_gemma(families=...)``, per module.
_FAMILY = {
    "gemma.gm.nn._layers": "gemma3",
    "gemma.gm.nn.gemma4._layers": "gemma4",
    "gemma.gm.nn.gemma4.vision._norms": "gemma4.vision",
    "gemma.gm.nn.gemma3n._layers": "gemma3n",
}


def _probe(cls: type, variants: dict[str, dict]) -> Callable[[Callable], list[Case]]:
    def probe(method: Callable) -> list[Case]:
        cases = []
        for label, fields in variants.items():
            cases += linen_cases(f"RMSNorm({label})", cls(**fields), method)
        return cases

    return probe


def _classes() -> dict[str, type]:
    """``{module name: its RMSNorm class}`` for the modules this gemma has."""
    import_library(
        "gemma.gm.nn",
        _NOT_INSTALLED,
        lambda err: (
            f"gemma is installed but gemma.gm.nn failed to import ({err}): install "
            "gemma with its dependencies (sentencepiece==0.2.1 where protobuf is older than 7)."
        ),
    )
    classes = {}
    for name in _CLASSES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is not None and name.startswith(err.name):
                continue  # an older gemma without this model family
            raise
        classes[name] = norm_class(module, "patch_gemma()", "gemma 4.0.1")
    return classes


def patch_gemma(
    implementation: str = "auto", *, families: str | Sequence[str] | None = None
) -> Patch:
    r"""Routes every norm of Google DeepMind's ``gemma`` library through ``rms_norm``.

    Replaces ``RMSNorm.__call__`` of ``gemma.gm.nn._layers`` (Gemma 2 and 3),
    ``gemma.gm.nn.gemma4._layers``, ``gemma.gm.nn.gemma4.vision._norms`` and
    ``gemma.gm.nn.gemma3n._layers`` (those this gemma has), so every norm of every gemma
    model (``gm.nn.Gemma3_*``, ``Gemma4_*``, ...: the layers' norms, QK-norm, gemma4's
    value and router norms, the final norm, the vision encoders' norms) computes with
    ``rms_norm``. The classes stay gemma's (linen ``@nn.compact``), so the parameter
    ``scale`` keeps its name, shape ``(features,)``, dtype and initializer, and
    checkpoints load unchanged. Each class keeps its semantics, over the last axis::

        y = x / sqrt(mean(x**2) + 1e-6) * (1 + scale)   # Gemma 2/3; gemma3n by default
        y = x / sqrt(mean(x**2) + 1e-6) * scale         # gemma4, its vision encoder
        y = x / sqrt(mean(x**2) + 1e-6)                 # with_scale=False

    computed in float32 (float64 stays float64) and rounded once to gemma's output
    dtype, ``result_type(x, scale)`` (``x``'s dtype without a scale). gemma keeps the
    statistic in ``x``'s dtype (bfloat16 under bfloat16 activations); this one keeps it
    in float32, which is nearer to exact arithmetic and, in float32, the same to a
    rounding. The gradient is ``rms_norm``'s analytic backward (residuals: ``x``,
    ``scale``, one float32 per row).

    gemma's ``Transformer.__call__`` is ``nn.jit`` with the model static, so a trace is
    kept per config for the whole process: installing and undoing the patch call
    ``jax.clear_caches()``, and the next call traces the method now in place. gemma4's
    audio encoder uses ``flax.linen.RMSNorm``: :func:`patch_flax` reaches it.

    Before installing, every class runs on a probe input both ways (float32: outputs to
    1e-6 relative; bfloat16: the same dtype; the same parameter tree); a difference
    refuses the patch.

    Args:
      implementation: passed to ``rms_norm``: ``"auto"`` (default), ``"xla"`` or
        ``"pallas"``.
      families: the classes to patch, by family: ``"gemma3"`` (``_layers``: Gemma 2 and
        3), ``"gemma4"``, ``"gemma4.vision"``, ``"gemma3n"``; None (default): every one
        this gemma has. The others keep gemma's norm, e.g. where a step measured more
        memory with ours (docs/integrations.md).

    Returns:
      a :class:`Patch`: ``patch.calls`` counts the norm calls traced through it since
      patching; ``patch.undo()``, leaving its ``with`` block, or :func:`unpatch_gemma`
      restores gemma's methods. Patching again replaces the previous patch.

    Raises:
      ImportError: gemma is not installed, or fails to import (the cause is named).
      RuntimeError: a class lacks what this patch reads, or differs from ``rms_norm`` on
        the probe (the message names the class, the case and the difference).
      ValueError: an unknown ``implementation``, or a family this gemma lacks.

    Example (needs gemma)::

        from gemma import gm
        from rmsnorm_jax.integrations import patch_gemma

        patch = patch_gemma()
        model = gm.nn.Gemma3_270M()
        out = model.apply({"params": params}, tokens)  # params from a checkpoint
        assert patch.calls > 0, patch  # "reached nothing" otherwise
    """
    check_implementation(implementation)
    classes = _classes()
    module = {_FAMILY[name]: name for name in classes}  # family -> its module
    picked = chosen("patch_gemma()", {f: classes[m] for f, m in module.items()}, families)
    swaps = []
    for family, cls in picked.items():
        make, variants = _CLASSES[module[family]]
        swaps.append(Swap(cls, make, _probe(cls, variants)))
    return apply("gemma", "patch_gemma()", swaps, implementation)


def unpatch_gemma() -> None:
    """Restores gemma's own ``RMSNorm.__call__`` everywhere (a no-op where unpatched)."""
    restore_all(list(_classes().values()))
