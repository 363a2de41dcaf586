"""What ``patch_keras`` knows of Keras 3 and KerasHub: the versions it was written from,
each norm class by family with its semantics (:class:`Norm`), what stays Keras's own and
why, and where this installation has them (:func:`classes`)."""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
import warnings
from typing import Any

from ._patch import PROBE_FEATURES, import_library

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


def _per_head(family: str, module: str, name: str, **kw: Any) -> Norm:
    """A Qwen 3-style class: built with ``head_dim`` (its QK-norm's), output in ``x``'s
    dtype, probed with the ``_HEAD`` variants too."""
    return Norm(
        f"{_HUB}{family}.{module}",
        name,
        output="input",
        init_args=("head_dim", "epsilon"),
        variants=_HEAD,
        **kw,
    )


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
    "qwen3": (_per_head("qwen3", "qwen3_layernorm", "Qwen3LayerNorm"),),
    "qwen3_moe": (_per_head("qwen3_moe", "qwen3_moe_layernorm", "Qwen3MoeLayerNorm"),),
    "qwen3_5": (
        _per_head("qwen3_5", "qwen3_5_layers", "Qwen3_5LayerNorm", init=0.0, offset=1.0),
        # "Gated" by its caller (``norm(x) * silu(z)``): the class itself is a plain norm.
        _per_head("qwen3_5", "qwen3_5_layers", "Qwen3_5RMSNormGated"),
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


# ---------------------------------------------------------------- finding them


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _import_keras():
    """``import keras``; an ImportError that names the fix where it or its backend's
    library is missing."""
    return import_library(
        "keras",
        _NOT_INSTALLED,
        lambda err: (
            f"keras failed to import ({err}): its backend needs {err.name}. "
            "patch_keras() needs Keras's JAX backend: set KERAS_BACKEND=jax before the first "
            "import of keras."
        ),
    )


def libraries(allow_unknown_versions: bool) -> tuple[Any, Any]:
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


def classes(allow_unknown_versions: bool = False) -> dict[str, list[tuple[Norm, type]]]:
    """``{family: [(norm, class)]}`` of the families this installation has."""
    _, hub = libraries(allow_unknown_versions)
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
