"""``patch_keras()``: the RMSNorms of Keras 3 and KerasHub (JAX backend) through ``rms_norm``.

A Keras layer computes in ``call``; Keras's ``Layer.__call__`` builds its weights, casts
the inputs to the compute dtype, enters the autocast scope and then calls ``call``. This
patch replaces ``call`` of each norm class (the other patches replace ``__call__``) and
keeps Keras's ``__call__``. The classes it knows (keras 3.15, keras-hub 0.32) normalize
over the last axis with float32 statistics, eps ``self.epsilon`` inside the square root;
``scale`` is the value ``call`` reads, the autocast one (bfloat16 under
``mixed_bfloat16``):

======================================  ============  ======  =================
family: class                           weight        offset  output dtype
======================================  ============  ======  =================
gemma, gemma3: ``RMSNormalization``     zeros         1       ``compute_dtype``
gemma4: ``RMSNormalization``            ones          0       ``compute_dtype``
gemma4: ``Gemma4VNorm``                 none                  ``compute_dtype``
gemma4: ``Gemma4FrozenNorm``            ones, frozen  0       ``compute_dtype``
llama, mistral, mixtral, phi3, qwen,    ones          0       ``compute_dtype``
qwen_moe, gpt_oss, roformer_v2
qwen3, qwen3_moe (also per head)        ones          0       ``x``'s dtype
qwen3_5: ``Qwen3_5LayerNorm``           zeros         1       ``x``'s dtype
qwen3_5: ``Qwen3_5RMSNormGated``        ones          0       ``x``'s dtype
keras: ``layers.RMSNormalization``      ones          0       ``x``'s dtype
======================================  ============  ======  =================
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._rms_norm import rms_norm
from . import _patch
from ._keras_classes import FAMILIES, KNOWN_KERAS, KNOWN_KERAS_HUB, LEFT_ALONE, Norm, classes
from ._patch import (
    PROBE_FEATURES,
    Case,
    Patch,
    Swap,
    check_implementation,
    chosen,
    is_static_number,
    probe_x,
    real_floating,
    trained_like,
)

__all__ = ["FAMILIES", "LEFT_ALONE", "patch_keras", "unpatch_keras"]

# The half-precision outputs of a replacement on the probe: equal to the layer's own but
# for a last-place rounding (the float32 values before the cast differ by a rounding) in
# at most this fraction of the elements. Reading the float32 variable where Keras's call
# sees the autocast bfloat16 one changes about a quarter of them.
PROBE_HALF_MISMATCH = 0.01

# The probe's settings: (dtype policy, autocast). With autocast=False a mixed layer's
# inputs keep their dtype and its variables stay float32.
_SETTINGS = (
    ("float32", True),
    ("mixed_bfloat16", True),
    ("bfloat16", True),
    ("mixed_bfloat16", False),
)


# ---------------------------------------------------------------- the replacements


def _floating(x: Any) -> bool:
    """``x`` is a real floating jax or NumPy array of a known shape, what ``rms_norm``
    takes. Keras infers a functional model's shapes with symbolic dimensions (jax.export's
    ``(None, None, d)``): that call only needs the output's shape and dtype, which Keras's
    own ``call`` gives (the probe checks they are ours)."""
    return (
        isinstance(x, (jax.Array, np.ndarray))
        and real_floating(x)
        and all(isinstance(d, int) for d in x.shape)
    )


def _value(layer: Any, weight: str | None) -> Any:
    """The weight as ``call`` sees it (Keras's autocast, or the stateless scope's, value),
    an array a ``custom_vjp`` function accepts; None for no weight."""
    if weight is None:
        return None
    from keras import ops

    return ops.convert_to_tensor(getattr(layer, weight))


def _hub_call(norm: Norm, original: Callable, implementation: str, hit: Callable[[], None]):
    """A KerasHub class: ``x_hat * (offset + scale)`` over the last axis, float32
    statistics, in ``self.compute_dtype`` or ``x``'s dtype."""

    def call(self, x):
        scale = _value(self, norm.weight)
        eps = self.epsilon
        if not (_floating(x) and jnp.ndim(x) > 0 and real_floating(scale)):
            return original(self, x)
        if not is_static_number(eps):
            return original(self, x)
        hit()
        dtype = x.dtype if norm.output == "input" else self.compute_dtype
        y = rms_norm(
            x, scale, eps, scale_offset=norm.offset, dtype=dtype, implementation=implementation
        )
        return _own_gradient_sum(y) if _per_head_half(y) else y

    return call


# The widest rows of one attention head (a QK-norm's): Gemma 3's head of 256.
HEAD_FEATURES = 256


def _per_head_half(y: jax.Array) -> bool:
    """Whether ``y`` is a QK-norm's 16-bit output (rows of at most ``HEAD_FEATURES``)."""
    return jnp.finfo(y.dtype).bits <= 16 and y.shape[-1] <= HEAD_FEATURES


@jax.custom_jvp
def _own_gradient_sum(y: jax.Array) -> jax.Array:
    """``y``; its tangent, so its cotangent ``dy``, passes a barrier on GPUs.

    A KerasHub model is its layers unrolled. Under a QK-norm, ``dy`` is the RoPE
    backward's output, fused by XLA:GPU into the scale gradient's first-stage sum; the
    RoPE tables are every layer's, and XLA:GPU merges the layers' sums into one
    multi-output kernel that keeps each layer's ``dy`` alive until it runs. Writing ``dy``
    once keeps each sum in its own layer. The core's backward does not do this: under
    ``scan`` there is one layer, nothing to merge, and the write costs. Measured both
    ways in ``docs/xla-programs.md``, item 5. A TPU or CPU program is unchanged; no
    rounding changes anywhere.
    """
    return y


@_own_gradient_sum.defjvp
def _own_gradient_sum_jvp(primals, tangents):
    (y,), (dy,) = primals, tangents
    return y, lax.platform_dependent(dy, cuda=lax.optimization_barrier, default=lambda t: t)


def _trailing(axis: Any, ndim: int) -> tuple[int, ...] | None:
    """``axis`` (an int or a list of them) as sorted non-negative axes where they are the
    last ones of an ``ndim``-dimensional ``x`` (the scale then broadcasts over them as
    Keras's does), else None."""
    axes = [axis] if isinstance(axis, int) else list(axis)
    if not axes or not all(isinstance(a, int) and -ndim <= a < ndim for a in axes):
        return None
    found = tuple(sorted({a % ndim for a in axes}))
    return found if found == tuple(range(ndim - len(axes), ndim)) else None


def _keras_call(norm: Norm, original: Callable, implementation: str, hit: Callable[[], None]):
    """``keras.layers.RMSNormalization``: ``x_hat * scale`` over ``self.axis``, statistics
    in ``result_type(x, float32)``, in ``x``'s dtype; ``epsilon=None`` is Keras's
    ``epsilon()``."""
    from keras import config

    def call(self, x):
        scale = _value(self, norm.weight)
        eps = config.epsilon() if self.epsilon is None else self.epsilon
        axes = _trailing(self.axis, jnp.ndim(x)) if _floating(x) else None
        if axes is None or not (real_floating(scale) and is_static_number(eps)):
            return original(self, x)
        hit()
        return rms_norm(x, scale, eps, axis=axes, dtype=x.dtype, implementation=implementation)

    return call


# ---------------------------------------------------------------- the class checks


def _expected_signature(norm: Norm, cls: type) -> str | None:
    """What in ``cls``'s ``call`` or constructor is not what the patch reads, or None."""
    call = cls.__dict__["call"]
    params = list(inspect.signature(getattr(call, _patch._ORIGINAL, call)).parameters)
    if len(params) != 2 or params[0] != "self":
        return f"its call is call({', '.join(params)}), where patch_keras() knows call(self, x)"
    init = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    missing = [a for a in norm.init_args if a not in init]
    if missing:
        return f"its constructor has no {', '.join(missing)}"
    return None


def _weights(layer: Any) -> list[tuple]:
    return [
        (v.name, tuple(v.shape), v.trainable, set(np.unique(np.asarray(v, np.float64)).tolist()))
        for v in layer.weights
    ]


def _check_class(norm: Norm, cls: type) -> None:
    """A RuntimeError where ``cls``'s call, constructor or weights (names, shapes,
    trainability, initial values) are not what ``patch_keras`` knows."""
    problem = _expected_signature(norm, cls)
    if problem is None:
        layer = cls(dtype="float32")
        layer.build((2, 3, PROBE_FEATURES))
        found = _weights(layer)
        expected = []
        if norm.weight is not None:
            expected = [(norm.weight, (PROBE_FEATURES,), norm.trainable, {norm.init})]
        if found != expected:
            problem = (
                f"its build makes the weights {found} (name, shape, trainable, initial "
                f"values), where patch_keras() knows {expected}"
            )
    if problem is not None:
        raise RuntimeError(
            f"patch_keras() refused {norm.path}: {problem}. This version is not the shape "
            f"patch_keras() knows (keras {KNOWN_KERAS}, keras-hub {KNOWN_KERAS_HUB}); "
            "nothing was patched. Please report it with the versions."
        )


# ---------------------------------------------------------------- the probe


def _probe(norm: Norm, cls: type) -> Callable[[Callable], list[Case]]:
    """Runs ``cls`` through Keras's ``__call__`` with ``method`` as its ``call``, under
    every setting of ``_SETTINGS`` (and the variants under float32), its weights
    ``trained_like``; a float32 probe input, which Keras casts to the compute dtype."""

    def probe(method: Callable) -> list[Case]:
        cases = []
        for policy, autocast in _SETTINGS:
            variants = norm.variants if policy == "float32" else ()
            for label, kwargs in (("", {}), *variants):
                layer = cls(dtype=policy, autocast=autocast, **kwargs)
                x = probe_x((2, 3, PROBE_FEATURES))
                layer.build(x.shape)
                values = trained_like([np.asarray(v) for v in layer.weights])
                for variable, value in zip(layer.weights, values, strict=True):
                    variable.assign(value)
                # The instance's call shadows the class's: Keras's __call__ runs it.
                object.__setattr__(layer, "call", types.MethodType(method, layer))
                where = policy + ("" if autocast else ", autocast=False")
                cases.append(Case(f"{norm.name}({label}) under {where}", layer(x), "values"))
        return cases

    return probe


def _difference(case: Case, ours: Case) -> str | None:
    """How ``ours`` differs from the layer's own probe output, or None: the same shape
    and dtype; float32 to ``PROBE_RTOL``; half precision equal but for a last-place
    rounding in at most ``PROBE_HALF_MISMATCH`` of the elements."""
    found = _patch._differences(case, ours)
    if found is not None or jnp.dtype(case.value.dtype).itemsize > 2:
        return found
    a, b = np.asarray(case.value, np.float64), np.asarray(ours.value, np.float64)
    eps = float(jnp.finfo(case.value.dtype).eps)
    far = np.abs(a - b) > eps * np.maximum(np.abs(a), np.abs(b))
    differ = float(np.mean(a != b))
    if np.any(far) or differ > PROBE_HALF_MISMATCH:
        return (
            f"{jnp.dtype(case.value.dtype).name} outputs differ in {differ:.1%} of the "
            f"elements ({int(np.sum(far))} by more than a last-place rounding), more than "
            f"{PROBE_HALF_MISMATCH:.0%}"
        )
    return None


# ---------------------------------------------------------------- installing ``call``


def _named(make: Callable, norm: Norm) -> Callable:
    """``make``'s replacement, named as the ``call`` it replaces (tracebacks, ``repr``)."""

    def named(original: Callable, implementation: str, hit: Callable[[], None]) -> Callable:
        call = make(norm, original, implementation, hit)
        call.__name__, call.__qualname__ = "call", f"{norm.name}.call"
        call.__doc__ = f"{norm.path}.call through rmsnorm_jax.rms_norm (patch_keras)."
        return call

    named.__qualname__ = f"{make.__qualname__}[{norm.path}]"  # the probe's cache key
    return named


def patch_keras(
    implementation: str = "auto",
    *,
    families: str | Sequence[str] | None = None,
    allow_unknown_versions: bool = False,
) -> Patch:
    r"""Routes the RMSNorm layers of Keras 3 and KerasHub (JAX backend) through ``rms_norm``.

    Replaces ``call`` of each norm class of KerasHub's models and of
    ``keras.layers.RMSNormalization`` (the module's table), so every norm of every model
    built from them, before or after this call, computes with ``rms_norm``. Keras's
    ``Layer.__call__`` stays: it builds the weights (checkpoints, presets and
    ``enable_lora`` find them unchanged), casts the inputs and enters the autocast scope.
    Each class keeps its semantics, per instance, over the last axis (Keras core's: its
    ``axis`` where those are the last ones; ``epsilon=None`` is ``keras.config.epsilon()``)::

        y = x / sqrt(mean(x**2) + epsilon) * (1 + scale)   # gemma, gemma3, Qwen3_5LayerNorm
        y = x / sqrt(mean(x**2) + epsilon) * scale         # the others
        y = x / sqrt(mean(x**2) + epsilon)                 # Gemma4VNorm

    computed in float32 (float64 stays float64), ``scale`` the value Keras's ``call``
    reads (the autocast bfloat16 one under ``mixed_bfloat16``), rounded once to the class's
    output dtype (``compute_dtype``, or ``x``'s for qwen3, qwen3_moe, qwen3_5 and Keras
    core's). The gradient is ``rms_norm``'s analytic backward (residuals: ``x``,
    ``scale``, one float32 per row), where Keras's autodiff keeps float32 copies of ``x``.

    Left alone (``LEFT_ALONE``, with why): Gemma 3n's, T5's and EdRec's norms (statistics
    in the compute dtype), ``keras_hub.layers.RMSNormalization``, ``keras.ops``'s function;
    a call ``rms_norm`` cannot take; a class it does not know (a warning names it).

    Before installing, each class's ``call``, constructor and weights are checked, then it
    runs on a probe through ``__call__`` both ways under the ``float32``,
    ``mixed_bfloat16`` and ``bfloat16`` policies, and a difference refuses the patch
    (docs/integrations.md). Installing and undoing call ``jax.clear_caches()``: compiled
    ``predict``, ``fit`` and ``generate`` functions trace again at their next call.

    Args:
      implementation: passed to ``rms_norm``: ``"auto"`` (default), ``"xla"`` or
        ``"pallas"``.
      families: the families to patch, by KerasHub's model folder (``"gemma"``,
        ``"llama"`` for Llama and Llama 3, ...: the module's table; ``"keras"``:
        ``keras.layers.RMSNormalization``); None (default): all this installation has.
      allow_unknown_versions: False (default) refuses a keras or keras-hub other than
        the minor versions this patch knows (3.15, 0.32); True patches the classes that
        pass the checks and the probe on this version.

    Returns:
      a :class:`Patch`: ``patch.calls`` counts the norm calls traced through it since
      patching (``calls_by_target`` per class, named ``"module.Class.call"``);
      ``patch.undo()``, leaving its ``with`` block, or :func:`unpatch_keras` restores
      Keras's methods. Patching again replaces the previous patch.

    Raises:
      ImportError: keras is not installed, or fails to import (its backend's library
        missing: set ``KERAS_BACKEND=jax``).
      RuntimeError: Keras runs another backend than JAX; an unknown version; a class
        that is not the shape this patch knows, or differs on the probe (the message
        names the class, the case and the difference).
      ValueError: an unknown ``implementation``, or a family this installation lacks.

    Example (needs keras and keras-hub, ``KERAS_BACKEND=jax``)::

        import keras_hub
        from rmsnorm_jax.integrations import patch_keras

        patch = patch_keras()  # before or after the model is built, fit or run
        lm = keras_hub.models.Gemma3CausalLM.from_preset("gemma3_1b")
        lm.backbone.enable_lora(rank=4)
        lm.fit(data, epochs=1)
        assert patch.calls > 0, patch  # "reached nothing" otherwise
    """
    check_implementation(implementation)
    available = classes(allow_unknown_versions)
    picked = chosen("patch_keras()", cast(dict[str, type], available), families)
    swaps = []
    for family in picked:
        make = _keras_call if family == "keras" else _hub_call
        for norm, cls in available[family]:
            check = functools.partial(_check_class, norm, cls)
            swaps.append(Swap(cls, _named(make, norm), _probe(norm, cls), check))
    return _patch.apply("Keras", "patch_keras()", swaps, implementation, "call", _difference)


def unpatch_keras() -> None:
    """Restores Keras's own ``call`` of every class (a no-op where unpatched)."""
    found = classes(allow_unknown_versions=True).values()
    _patch.restore_all([cls for pairs in found for _, cls in pairs], "call")
