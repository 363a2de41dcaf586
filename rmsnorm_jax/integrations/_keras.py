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

import dataclasses
import functools
import importlib
import inspect
import re
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from .._rms_norm import rms_norm
from . import _patch
from ._patch import (
    PROBE_FEATURES,
    Case,
    Patch,
    Reach,
    Swap,
    check_implementation,
    chosen,
    is_static_number,
    probe_x,
    real_floating,
    trained_like,
)

# The versions whose source this patch was written from and is tested with (CI pins
# keras 3.15.1 and keras-hub 0.32.0), by minor release.
KNOWN_KERAS = "3.15"
KNOWN_KERAS_HUB = "0.32"

_NOT_INSTALLED = (
    "patch_keras() needs Keras 3 on its JAX backend, and keras is not installed: pip "
    "install keras==3.15.1 (and, for KerasHub's models, pip install --no-deps "
    "keras-hub==0.32.0 plus tokenizers and regex), then set KERAS_BACKEND=jax before the "
    "first import of keras."
)

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


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: one per class
class Norm:
    """What ``patch_keras`` knows of one norm class.

    Attributes:
      module, name: where the class is (``module.name``).
      weight: the weight's name (``scale``), or None for a class without one.
      init: its initializer's value (0.0 or 1.0).
      trainable: whether ``build`` makes it trainable.
      offset: 1.0 for ``x_hat * (1 + scale)``, 0.0 for ``x_hat * scale``.
      output: ``"compute"`` (``self.compute_dtype``) or ``"input"`` (``x``'s dtype).
      init_args: the constructor's parameters the patch reads or the probe passes.
      variants: the probe's constructor arguments beyond the defaults (float32 policy).
    """

    module: str
    name: str
    weight: str | None = "scale"
    init: float = 1.0
    trainable: bool = True
    offset: float = 0.0
    output: str = "compute"
    init_args: tuple[str, ...] = ("epsilon",)
    variants: tuple[tuple[str, dict], ...] = (("epsilon=0.1", {"epsilon": 0.1}),)

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"


_HUB = "keras_hub.src.models."
_HEAD = (("epsilon=0.1", {"epsilon": 0.1}), ("head_dim=64", {"head_dim": PROBE_FEATURES}))


def _plain(family: str, module: str, name: str) -> Norm:
    return Norm(f"{_HUB}{family}.{module}", name)


# family: its norm classes. A family is KerasHub's model folder; models that reuse a
# class are reached through its family (llama3 through llama, pali_gemma and t5gemma
# through gemma, t5gemma2 through gemma3, qwen3_5_moe through qwen3_5, smollm3 through
# keras).
FAMILIES: dict[str, tuple[Norm, ...]] = {
    "gemma": (Norm(f"{_HUB}gemma.rms_normalization", "RMSNormalization", init=0.0, offset=1.0),),
    "gemma3": (Norm(f"{_HUB}gemma3.gemma3_layers", "RMSNormalization", init=0.0, offset=1.0),),
    "gemma4": (
        Norm(f"{_HUB}gemma4.gemma4_layers", "RMSNormalization"),
        Norm(f"{_HUB}gemma4.gemma4_layers", "Gemma4VNorm", weight=None),
        Norm(f"{_HUB}gemma4.gemma4_layers", "Gemma4FrozenNorm", trainable=False),
    ),
    "llama": (_plain("llama", "llama_layernorm", "LlamaLayerNorm"),),
    "mistral": (_plain("mistral", "mistral_layer_norm", "MistralLayerNormalization"),),
    "mixtral": (_plain("mixtral", "mixtral_layer_norm", "MixtralLayerNormalization"),),
    "phi3": (_plain("phi3", "phi3_layernorm", "Phi3LayerNorm"),),
    "qwen": (_plain("qwen", "qwen_layernorm", "QwenLayerNorm"),),
    "qwen_moe": (_plain("qwen_moe", "qwen_moe_layernorm", "QwenMoeLayerNorm"),),
    "qwen3": (
        Norm(
            f"{_HUB}qwen3.qwen3_layernorm",
            "Qwen3LayerNorm",
            output="input",
            init_args=("head_dim", "epsilon"),
            variants=_HEAD,
        ),
    ),
    "qwen3_moe": (
        Norm(
            f"{_HUB}qwen3_moe.qwen3_moe_layernorm",
            "Qwen3MoeLayerNorm",
            output="input",
            init_args=("head_dim", "epsilon"),
            variants=_HEAD,
        ),
    ),
    "qwen3_5": (
        Norm(
            f"{_HUB}qwen3_5.qwen3_5_layers",
            "Qwen3_5LayerNorm",
            output="input",
            init_args=("head_dim", "epsilon"),
            variants=_HEAD,
            init=0.0,
            offset=1.0,
        ),
        # "Gated" by its caller (``norm(x) * silu(z)``): the class itself is a plain norm.
        Norm(
            f"{_HUB}qwen3_5.qwen3_5_layers",
            "Qwen3_5RMSNormGated",
            output="input",
            init_args=("head_dim", "epsilon"),
            variants=_HEAD,
        ),
    ),
    "gpt_oss": (_plain("gpt_oss", "gpt_oss_layer_norm", "GptOssLayerNormalization"),),
    "roformer_v2": (_plain("roformer_v2", "roformer_v2_attention", "RoformerNorm"),),
    "keras": (
        Norm(
            "keras.src.layers.normalization.rms_normalization",
            "RMSNormalization",
            output="input",
            init_args=("axis", "epsilon"),
            variants=(
                ("epsilon=0.1", {"epsilon": 0.1}),
                ("epsilon=None", {"epsilon": None}),
                ("axis=[-2, -1]", {"axis": [-2, -1]}),
            ),
        ),
    ),
}

# What stays Keras's own, and why (the classes of keras-hub 0.32 and Keras 3.15 with
# "norm" or "rms" in their name that are not above).
LEFT_ALONE: dict[str, str] = {
    f"{_HUB}gemma3n.rms_normalization.Gemma3nRMSNorm": "statistics in the compute dtype",
    f"{_HUB}t5.t5_layer_norm.T5LayerNorm": "statistics in the compute dtype",
    f"{_HUB}edrec.edrec_layers.EdRecRMSNormalization": "statistics in the compute dtype",
    "keras_hub.src.layers.modeling.rms_normalization.RMSNormalization": (
        "a float32 output under every dtype policy and no dtype argument (Flux's QK-norm)"
    ),
    f"{_HUB}flux.flux_layers.QKNorm": "two keras_hub.layers.RMSNormalization",
    f"{_HUB}mobilenetv5.mobilenetv5_layers.RmsNorm2d": "a channel norm of images",
    f"{_HUB}mobilenetv5.mobilenetv5_layers.ConvNormAct": "a convolution block",
    f"{_HUB}gemma3n.gemma3n_audio_layers.Gemma3nAudioCumulativeGroupNorm": "a group norm",
    f"{_HUB}d_fine.d_fine_layers.DFineConvNormLayer": "a convolution block",
    f"{_HUB}stable_diffusion_3.mmdit.AdaptiveLayerNormalization": "a LayerNorm",
}


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
        return rms_norm(
            x, scale, eps, scale_offset=norm.offset, dtype=dtype, implementation=implementation
        )

    return call


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


def _target(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}.call"


def _own_call(cls: type) -> Callable:
    """Keras's own ``cls.call``, seen through any patch of ours."""
    method = cls.__dict__.get("call")
    if not callable(method):
        raise RuntimeError(
            f"patch_keras() refused {cls.__module__}.{cls.__qualname__}: it defines no call "
            f"of its own, which patch_keras() knows it to (keras {KNOWN_KERAS}, keras-hub "
            f"{KNOWN_KERAS_HUB}); nothing was patched. Please report it with the versions."
        )
    return getattr(method, _patch._ORIGINAL, method)


class KerasPatch(Patch):
    """The :class:`Patch` of ``patch_keras``: what it replaced is each class's ``call``
    (``targets``: ``"module.Class.call"``)."""

    def __init__(self, replaced: list[tuple[type, Callable]], implementation: str, reach: Reach):
        super().__init__("keras", replaced, implementation, reach)
        self.targets = tuple(_target(cls) for cls, _ in replaced)

    def undo(self) -> None:
        """Puts back the ``call`` this patch replaced; a second ``undo()`` does nothing."""
        if not self._replaced:
            return
        for cls, before in reversed(self._replaced):
            type.__setattr__(cls, "call", before)
        self._replaced = ()
        jax.clear_caches()


def _verified_key(swap: Swap, original: Callable, implementation: str) -> tuple:
    cls = swap.cls
    shape = (cls.__dict__.get("build"), cls.__dict__.get("__init__"))
    return (cls, original, shape, _patch._maker_key(swap.make), implementation)


def _apply(swaps: Sequence[tuple[Norm, Swap]], implementation: str) -> KerasPatch:
    """Checks every class and its probe, then installs them all (none on a refusal)."""
    reach = Reach([_target(swap.cls) for _, swap in swaps])
    planned = []
    for norm, swap in swaps:
        original = _own_call(swap.cls)
        replacement = swap.make(original, implementation, reach.counter(_target(swap.cls)))
        replacement.__name__, replacement.__qualname__ = "call", f"{swap.cls.__qualname__}.call"
        replacement.__doc__ = f"{norm.path}.call through rmsnorm_jax.rms_norm (patch_keras)."
        planned.append((swap.cls, original, replacement))
        key = _verified_key(swap, original, implementation)
        if key in _patch._VERIFIED:
            continue
        _check_class(norm, swap.cls)
        theirs = _patch._probe("Keras", "patch_keras()", swap, original, "Keras's own call")
        ours = _patch._probe("Keras", "patch_keras()", swap, replacement, "the replacement")
        for case, mine in zip(theirs, ours, strict=True):
            difference = _difference(case, mine)
            if difference is not None:
                raise RuntimeError(
                    f"patch_keras() refused {norm.path}: on the probe {case.label}, "
                    f"{difference}. Nothing was patched. This version computes something "
                    "the patch does not know; please report it with the versions."
                )
        _patch._VERIFIED.add(key)
    replaced = []
    for cls, original, replacement in planned:
        before = cls.__dict__["call"]
        setattr(replacement, _patch._ORIGINAL, original)
        type.__setattr__(cls, "call", replacement)
        replaced.append((cls, before))
    reach.reset()
    # A model's predict, train and generate functions are jax.jit-ed and keep the call
    # they traced: every trace is dropped, so their next call traces the new one.
    jax.clear_caches()
    return KerasPatch(replaced, implementation, reach)


# ---------------------------------------------------------------- finding the classes


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _import_keras():
    """``import keras``; an ImportError that names the fix where it or its backend's
    library is missing."""
    try:
        return importlib.import_module("keras")
    except ModuleNotFoundError as err:
        if err.name is not None and err.name.split(".")[0] == "keras":
            raise ImportError(_NOT_INSTALLED) from err
        raise ImportError(
            f"keras failed to import ({err}): its backend needs {err.name}. patch_keras() "
            "needs Keras's JAX backend: set KERAS_BACKEND=jax before the first import of "
            "keras."
        ) from err


def _libraries(allow_unknown_versions: bool) -> tuple[Any, Any]:
    """(keras, keras_hub or None where it is not installed), checked: the JAX backend,
    and versions this patch knows."""
    keras = _import_keras()
    backend = keras.config.backend()
    if backend != "jax":
        raise RuntimeError(
            f"patch_keras() routes Keras's norms through rms_norm, a JAX function, and this "
            f"Keras runs on its {backend!r} backend: set KERAS_BACKEND=jax before the first "
            'import of keras (or "backend": "jax" in ~/.keras/keras.json).'
        )
    try:
        hub = importlib.import_module("keras_hub")
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] != "keras_hub":
            raise ImportError(
                f"keras_hub is installed but failed to import ({err}): install "
                "keras-hub==0.32.0 with --no-deps, then tokenizers and regex."
            ) from err
        hub = None  # Keras core's RMSNormalization only
    found = [("keras", keras.__version__, KNOWN_KERAS)]
    found += [("keras-hub", hub.__version__, KNOWN_KERAS_HUB)] if hub is not None else []
    unknown = [f"{n} {v}" for n, v, known in found if _minor(v) != known]
    if unknown and not allow_unknown_versions:
        raise RuntimeError(
            f"patch_keras() knows keras {KNOWN_KERAS} and keras-hub {KNOWN_KERAS_HUB}, not "
            f"{' and '.join(unknown)}: pip install keras==3.15.1 and (--no-deps) "
            "keras-hub==0.32.0, or patch_keras(allow_unknown_versions=True) to patch the "
            "classes that pass its checks and probe on this version."
        )
    return keras, hub


def _classes(allow_unknown_versions: bool = False) -> dict[str, list[tuple[Norm, type]]]:
    """``{family: [(norm, class)]}`` of the families this installation has."""
    _, hub = _libraries(allow_unknown_versions)
    found: dict[str, list[tuple[Norm, type]]] = {}
    for family, norms in FAMILIES.items():
        if family != "keras" and hub is None:
            continue
        classes = []
        for norm in norms:
            try:
                module = importlib.import_module(norm.module)
            except ModuleNotFoundError as err:
                if err.name is not None and norm.module.startswith(err.name):
                    continue  # another version without this model
                raise
            cls = getattr(module, norm.name, None)
            if isinstance(cls, type):
                classes.append((norm, cls))
        if classes:
            found[family] = classes
    if hub is not None:
        _warn_unknown(found)
    return found


_NORM_NAME = re.compile(r"(?i)rms|norm(?!al(?!ization))")


def _warn_unknown(found: dict[str, list[tuple[Norm, type]]]) -> None:
    """A warning naming KerasHub's norm-like layers that this patch neither reaches nor
    lists in ``LEFT_ALONE`` (a newer KerasHub's): they stay Keras's own."""
    import keras

    known = {n.path for norms in FAMILIES.values() for n in norms} | set(LEFT_ALONE)
    unknown = sorted(
        f"{name}.{attr}"
        for name, module in list(sys.modules.items())
        if name.startswith("keras_hub.src.") and module is not None
        for attr, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, keras.layers.Layer)
        and value.__module__ == name
        and _NORM_NAME.search(attr)
        and f"{name}.{attr}" not in known
    )
    if unknown:
        warnings.warn(
            f"patch_keras() does not know {', '.join(unknown)}: those layers stay Keras's "
            "own. Please report it with the versions.",
            stacklevel=4,
        )


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
    available = _classes(allow_unknown_versions)
    picked = chosen("patch_keras()", cast(dict[str, type], available), families)
    swaps = []
    for family in picked:
        make = _keras_call if family == "keras" else _hub_call
        for norm, cls in available[family]:
            swaps.append((norm, Swap(cls, functools.partial(make, norm), _probe(norm, cls))))
    return _apply(swaps, implementation)


def unpatch_keras() -> None:
    """Restores Keras's own ``call`` of every class (a no-op where unpatched)."""
    patched = [
        cls
        for classes in _classes(allow_unknown_versions=True).values()
        for _, cls in classes
        if hasattr(cls.__dict__.get("call"), _patch._ORIGINAL)
    ]
    for cls in patched:
        type.__setattr__(cls, "call", getattr(cls.__dict__["call"], _patch._ORIGINAL))
    if patched:
        jax.clear_caches()
