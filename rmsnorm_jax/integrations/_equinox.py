"""``patch_equinox()``: ``equinox.nn.RMSNorm`` through ``rms_norm``."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp

from .._rms_norm import rms_norm
from ._patch import (
    Case,
    Patch,
    Swap,
    all_float32,
    apply,
    check_implementation,
    import_library,
    is_static_number,
    probe_x,
    real_floating,
    restore_all,
    run_case,
    trained_like,
)

_NOT_INSTALLED = (
    "patch_equinox() needs equinox, which is not installed: pip install equinox "
    "(tested with 0.13.8)."
)


def _equinox_call(original: Callable, implementation: str, hit: Callable[[], None]):
    sentinel = inspect.signature(original).parameters["state"].default

    @jax.named_scope("eqx.nn.RMSNorm")
    def __call__(self, x, state=sentinel, *, key=None):
        """equinox.nn.RMSNorm through ``rmsnorm_jax.rms_norm`` (``rmsnorm_jax.integrations``)."""
        if not (
            hasattr(x, "shape")
            and hasattr(x, "dtype")
            and jnp.ndim(x) > 0
            and x.shape == self.shape  # equinox's own error otherwise
            and real_floating(x)
            and is_static_number(self.eps)
        ):
            return original(self, x, state, key=key)
        hit()
        y = rms_norm(
            x,
            self.weight if self.use_weight else None,
            self.eps,
            bias=self.bias if self.use_bias else None,
            axis=tuple(range(x.ndim)),  # equinox normalizes over the whole of x
            dtype=x.dtype,
            implementation=implementation,
        )
        return y if state is sentinel else (y, state)

    return __call__


_PROBE_SHAPE = (6, 16)
_VARIANTS = {
    "default": {},
    "use_bias=False": {"use_bias": False},
    "use_weight=False, use_bias=False": {"use_weight": False, "use_bias": False},
    "eps=0.1, dtype=bfloat16": {"eps": 0.1, "dtype": jnp.bfloat16},
}


def _probe(cls: type) -> Callable[[Callable], list[Case]]:
    def probe(method: Callable) -> list[Case]:
        cases = []
        for label, kwargs in _VARIANTS.items():
            norm = trained_like(cls(_PROBE_SHAPE, **kwargs))
            values = "values" if all_float32(norm) else "dtype"
            for dtype, check in ((jnp.float32, values), (jnp.bfloat16, "dtype")):
                label = f"RMSNorm({label}), {jnp.dtype(dtype).name} x"
                x = probe_x(_PROBE_SHAPE, dtype)
                cases.append(run_case(label, lambda x, norm=norm: method(norm, x), (x,), check))
        # With a state: equinox returns (y, state), the state passed through untouched.
        norm = trained_like(cls(_PROBE_SHAPE))
        y, state = method(norm, probe_x(_PROBE_SHAPE), "state")
        passed = isinstance(state, str) and state == "state"
        cases.append(Case("RMSNorm(default) with a state", y, "values"))
        cases.append(Case("the state passed through", jnp.asarray(float(passed)), "values"))
        return cases

    return probe


def _class() -> type:
    module = import_library("equinox.nn", _NOT_INSTALLED)
    cls = getattr(module, "RMSNorm", None)
    if not isinstance(cls, type):
        raise RuntimeError(
            "equinox.nn has no RMSNorm: this equinox is not the shape patch_equinox() knows "
            "(equinox 0.13). Please report it with the version."
        )
    return cls


def patch_equinox(implementation: str = "auto") -> Patch:
    r"""Routes ``equinox.nn.RMSNorm`` through :func:`rmsnorm_jax.rms_norm`.

    Replaces ``equinox.nn.RMSNorm.__call__``, so every model built from it (before or
    after the call) computes its norms with ``rms_norm``, with equinox's semantics:
    normalized over **all** axes of ``x`` (``x.shape == norm.shape``; callers
    ``jax.vmap`` over tokens), the optional ``weight`` and ``bias`` (on by default)
    of ``x``'s shape, eps ``norm.eps`` (default 1e-5)::

        y = x / sqrt(mean(x**2) + eps) * weight + bias

    computed in float32 (float64 stays float64) and rounded once to ``x``'s dtype, as
    equinox does. ``state`` passes through as in equinox (``norm(x, state)`` returns
    ``(y, state)``); a call equinox would refuse (another shape) runs equinox's own
    method and its error. The module's fields (``weight``, ``bias``, ``eps``, ...) are
    equinox's, so serialised models load unchanged. The gradient is ``rms_norm``'s
    analytic backward (residuals: ``x``, ``weight``, one float32 per call).

    Before installing, the class runs on a probe input both ways (float32: outputs to
    1e-6 relative; bfloat16: the same dtype); a difference refuses the patch.
    Installing and undoing call ``jax.clear_caches()``, so an ``eqx.filter_jit``
    function traced before runs the new method at its next call.

    Args:
      implementation: passed to ``rms_norm``: ``"auto"`` (default), ``"xla"`` or
        ``"pallas"``.

    Returns:
      a :class:`Patch`: ``patch.calls`` counts the norm calls traced through it since
      patching (a ``jax.vmap`` over tokens is one call); ``patch.undo()``, leaving its
      ``with`` block, or :func:`unpatch_equinox` restores equinox's method.

    Raises:
      ImportError: equinox is not installed.
      RuntimeError: its ``RMSNorm`` differs from ``rms_norm`` on the probe.
      ValueError: an unknown ``implementation``.

    Example (needs equinox)::

        import equinox as eqx
        import jax
        from rmsnorm_jax.integrations import patch_equinox

        norm = eqx.nn.RMSNorm(64)
        with patch_equinox() as patch:
            y = jax.vmap(norm)(x)  # x: (tokens, 64)
        assert patch.calls == 1
    """
    check_implementation(implementation)
    cls = _class()
    return apply(
        "equinox", "patch_equinox()", [Swap(cls, _equinox_call, _probe(cls))], implementation
    )


def unpatch_equinox() -> None:
    """Restores equinox's own ``RMSNorm.__call__`` (a no-op where it is not patched)."""
    restore_all([_class()])
