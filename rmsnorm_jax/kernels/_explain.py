"""``explain``: which path a call takes, and why, as the call itself decides it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._device import Target
from ._select import PLATFORM_NAMES, PLATFORMS, Choice, Explained, Route, explaining, load


def _label(choice: Choice) -> str:
    if choice.backend is None:
        return f"XLA ({choice.reason})"
    backend, _ = load(choice.backend)
    name = backend.LABEL if backend is not None else choice.backend
    if choice.interpret:
        name += " in interpret mode"
    return f"{name} ({choice.reason})" if choice.reason else name


def _platform(found: Route, platform: str) -> str:
    forward, backward = (c for p, _, c in found.choices if p == platform)
    if forward == backward:
        return f"{PLATFORM_NAMES[platform]}: {_label(forward)}"
    return f"{PLATFORM_NAMES[platform]}: forward {_label(forward)}, backward {_label(backward)}"


def describe(found: Route) -> str:
    """A route in words: ``"xla: why"``, or the implementation and each platform's path."""
    per_platform = "; ".join(_platform(found, p) for p in PLATFORMS if found.choices)
    if found.spec is None:
        detail = f": {per_platform}" if found.request.implementation != "auto" else ""
        return f"xla: {found.reason}{detail}" if per_platform else f"xla: {found.reason}"
    return f"{found.request.implementation}: {per_platform}"


def _is_array(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def route_of(
    function: Callable,
    *args: Any,
    target: Target | None = None,
    jax_version: str | None = None,
    **kwargs: Any,
) -> Route:
    """The :class:`~rmsnorm_jax.kernels.Route` of ``function(*args, **kwargs)``, as the call
    decides it (see :func:`explain`), for the device ``target`` and jax ``jax_version``
    (None: the device being compiled for, the installed jax)."""
    positions = [i for i, a in enumerate(args) if _is_array(a)]
    keys = [k for k, v in kwargs.items() if _is_array(v)]

    def call(arrays, named):
        full = list(args)
        for i, a in zip(positions, arrays, strict=True):
            full[i] = a
        return function(*full, **{**kwargs, **dict(zip(keys, named, strict=True))})

    with explaining(target, jax_version):
        try:
            jax.eval_shape(call, [args[i] for i in positions], [kwargs[k] for k in keys])
        except Explained as stopped:
            return stopped.route
    raise TypeError(
        f"explain({getattr(function, '__name__', function)!r}, ...) made no call of rms_norm, "
        f"add_rms_norm or gated_rms_norm; pass one of them (or a function that calls one) "
        f"and its arguments, e.g. explain(rms_norm, x, scale)."
    )


def explain(
    function: Callable,
    *args: Any,
    target: Target | None = None,
    jax_version: str | None = None,
    **kwargs: Any,
) -> str:
    """Which path ``function(*args, **kwargs)`` takes, and why, without computing it.

    ``function`` is :func:`rmsnorm_jax.rms_norm`, :func:`~rmsnorm_jax.add_rms_norm` or
    :func:`~rmsnorm_jax.gated_rms_norm` (or anything that calls one of them, such as a
    Module's ``apply``: its first call is explained). Arrays may be
    ``jax.ShapeDtypeStruct``. The call runs its own argument checks and its own route
    (``_select.route``, the code that decides for real, with the call's defaults:
    ``implementation="auto"``) and stops there. The answer is ``"xla: <why>"``, or the
    implementation and, per platform (GPU, TPU, CPU), the backend of the forward and the
    backward pass or XLA with the reason. It is for the device being compiled for (the
    default device, or the abstract mesh's: ``jax.sharding.use_abstract_mesh``) and the
    installed jax, or for ``target`` (a :class:`~rmsnorm_jax.kernels.Target`) and
    ``jax_version``.

    >>> import jax, jax.numpy as jnp
    >>> from rmsnorm_jax import add_rms_norm, rms_norm
    >>> from rmsnorm_jax.kernels import explain
    >>> x = jax.ShapeDtypeStruct((8, 16384), jnp.bfloat16)
    >>> explain(rms_norm, x, mask=jnp.ones((8, 16384), bool))
    'xla: the kernels do not take a mask'
    >>> explain(rms_norm, x, implementation="xla")
    "xla: implementation='xla'"
    >>> for part in explain(add_rms_norm, x, x, implementation="pallas").split("; "):
    ...     print(part)  # doctest: +ELLIPSIS
    pallas: GPU: ...
    TPU: forward Mosaic TPU, backward XLA (the row does not fit the Mosaic TPU kernels)
    CPU: XLA (the row does not fit the Triton kernels)
    """
    return describe(route_of(function, *args, target=target, jax_version=jax_version, **kwargs))
