"""What every ``patch_<library>()`` shares: the :class:`Patch` it returns, the probe that
checks a replacement against the library's own method before it is installed, and the
installing and restoring of that method on the library's classes.

A patch replaces one method per class, ``__call__`` (Keras's: ``call``), and nothing else:
the library's constructors still build the parameters, so their names, shapes, dtypes and
metadata are the library's own and checkpoints load unchanged. Every object that holds the class
(imported by name, subclassed, wrapped) gets the new method, whether its model was built
before or after the patch.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._config import check_implementation as check_implementation

# The function a patch installs carries the library's own method here, so that patching
# twice wraps the original once, and unpatching finds it whatever was patched on top.
_ORIGINAL = "__rmsnorm_jax_original__"

# How far the float32 outputs of a replacement may be from the library's own on the probe:
# max |ours - theirs| / max |theirs|. Both compute the same formula in float32; they differ
# by the order of the multiplications (a few roundings, about 1e-7).
PROBE_RTOL = 1e-6
PROBE_FEATURES = 64


# ---------------------------------------------------------------- small shared helpers


def chosen(function: str, available: dict[str, type], families: Any) -> dict[str, type]:
    """``available`` (``{family: class}``) limited to ``families``, all of it where None.

    A ValueError names a family this installation lacks, and the ones it has.
    """
    if families is None:
        return available
    names = (families,) if isinstance(families, str) else tuple(families)
    unknown = [name for name in names if name not in available]
    if unknown or not names:
        what = (
            f"names {', '.join(map(repr, unknown))}, which this installation does not have"
            if unknown
            else "names none"
        )
        raise ValueError(
            f"{function}: families={names!r} {what}; choose among "
            f"{', '.join(map(repr, available))}, or leave families=None for all."
        )
    return {name: available[name] for name in dict.fromkeys(names)}


def import_library(
    module: str, not_installed: str, broken: Callable[[ModuleNotFoundError], str] | None = None
) -> Any:
    """``importlib.import_module(module)``. Where a module of its own package is missing,
    an ImportError saying ``not_installed``; where another one is (a dependency), an
    ImportError saying ``broken(err)``, or that error itself without ``broken``."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and err.name.split(".")[0] == module.split(".")[0]:
            raise ImportError(not_installed) from err
        if broken is None:
            raise
        raise ImportError(broken(err)) from err


def norm_class(module, patcher: str, known: str) -> type:
    """``module.RMSNorm``, the class a patch replaces the call of; a RuntimeError where the
    module has none (a version of the library this patch does not know)."""
    cls = getattr(module, "RMSNorm", None)
    if not isinstance(cls, type):
        raise RuntimeError(
            f"{module.__name__} has no RMSNorm class: this library is not the shape "
            f"{patcher} knows ({known}). Please report it with the version."
        )
    return cls


def param_value(param: Any) -> jax.Array:
    """The array of an NNX ``Param`` (or the array itself)."""
    if hasattr(param, "get_value"):
        return param.get_value()
    return param[...] if hasattr(param, "__getitem__") else param


def real_floating(a: Any) -> bool:
    """``a`` is None or a real floating array (what ``rms_norm`` takes)."""
    return a is None or jnp.issubdtype(jnp.result_type(a), jnp.floating)


def is_static_number(eps: Any) -> bool:
    """``eps`` is a concrete Python or NumPy number (``rms_norm`` needs a static eps)."""
    return isinstance(eps, (int, float, np.floating, np.integer)) and not isinstance(eps, bool)


def own_call(cls: type, library: str, name: str = "__call__") -> Callable:
    """The library's own method ``name`` of ``cls``, seen through any patch of ours."""
    method = cls.__dict__.get(name)
    if not callable(method):
        raise RuntimeError(
            f"{cls.__module__}.{cls.__qualname__} defines no {name} of its own; this "
            f"version of {library} is not the shape rmsnorm_jax.integrations knows. "
            "Please report it with the version."
        )
    return getattr(method, _ORIGINAL, method)


def restore(cls: type, name: str = "__call__") -> None:
    """Puts back the library's own method ``name`` of ``cls`` (a no-op where it is not
    patched)."""
    method = cls.__dict__.get(name)
    original = getattr(method, _ORIGINAL, None)
    if original is not None:
        type.__setattr__(cls, name, original)


def target_name(cls: type, name: str = "__call__") -> str:
    return f"{cls.__module__}.{cls.__qualname__}.{name}"


def linen_method(call: Callable) -> Callable:
    """``call`` as a linen ``@nn.compact`` ``__call__``, ready to set on a linen class.

    A linen Module's methods run inside its scope handling, which linen adds to the
    methods a Module subclass defines when the class is created: this class exists to
    have it added.
    """
    from flax import linen as nn

    call.__name__ = "__call__"

    class _Wrapped(nn.Module):
        __call__ = nn.compact(call)

    return _Wrapped.__dict__["__call__"]


# ---------------------------------------------------------------- counting the calls


class Reach:
    """The norm calls traced (or run eagerly) through the patched methods, per target."""

    def __init__(self, targets: Sequence[str]):
        self.counts = dict.fromkeys(targets, 0)

    def counter(self, target: str) -> Callable[[], None]:
        def hit() -> None:
            self.counts[target] += 1

        return hit

    def reset(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)


# ---------------------------------------------------------------- the probe


@dataclasses.dataclass(frozen=True)
class Case:
    """One probe output (an array or a tree of them): ``check`` is ``"values"`` (shapes,
    dtypes, and float32 outputs to ``PROBE_RTOL``), ``"dtype"`` (shapes and dtypes only:
    bfloat16 inputs or parameters, where the roundings differ) or ``"exact"`` (a
    parameter tree: structure, shapes, dtypes and values)."""

    label: str
    value: Any
    check: str


def probe_x(shape: Sequence[int] = (2, 3, PROBE_FEATURES), dtype: Any = jnp.float32) -> jax.Array:
    """A deterministic probe input: ``1.5 * N(0, 1) + 0.2`` (rows with a non-zero mean)."""
    rng = np.random.default_rng(20261125)
    return jnp.asarray(1.5 * rng.standard_normal(tuple(shape)) + 0.2, jnp.float32).astype(dtype)


def trained_like(tree: Any) -> Any:
    """``tree`` with ``0.1 * N(0, 1)`` added to every floating leaf: a checkpoint's
    values rather than the initializer's ones or zeros (which hide a missing offset)."""
    rng = np.random.default_rng(7)

    def perturb(leaf):
        if not (hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)):
            return leaf
        noise = 0.1 * rng.standard_normal(np.shape(leaf))
        return (jnp.asarray(leaf, jnp.float32) + noise).astype(leaf.dtype)

    return jax.tree.map(perturb, tree)


def all_float32(tree: Any) -> bool:
    """Every floating leaf of ``tree`` is float32 (a "values" probe needs float32 params:
    a library may round ``1 + scale`` to a bfloat16 scale's dtype, where ours adds in
    float32)."""
    return all(
        jnp.dtype(leaf.dtype) == jnp.float32
        for leaf in jax.tree.leaves(tree)
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)
    )


def run_case(label: str, fn: Callable, args: Sequence[Any], check: str) -> Case:
    """``fn(*args)`` as a probe case: run eagerly for ``"values"`` and ``"exact"`` (op by
    op: the ops' compiled forms are shared by every case, where a jit would compile each
    case), only traced (``jax.eval_shape``) for ``"dtype"``."""
    if check == "dtype":
        return Case(label, jax.eval_shape(fn, *args), check)
    return Case(label, fn(*args), check)


def nnx_cases(label: str, norm: Any, method: Callable, x_shape=None) -> list[Case]:
    """An NNX norm with trained-like parameters, run by ``method`` on a float32 probe
    (values compared where its parameters are float32) and a bfloat16 one (dtype)."""
    from flax import nnx

    nnx.update(norm, trained_like(nnx.state(norm, nnx.Param)))
    values = "values" if all_float32(nnx.state(norm, nnx.Param)) else "dtype"
    shape = (2, 3, PROBE_FEATURES) if x_shape is None else x_shape
    return [
        run_case(
            f"{label}, {jnp.dtype(dtype).name} x",
            lambda x: method(norm, x),
            (probe_x(shape, dtype),),
            check,
        )
        for dtype, check in ((jnp.float32, values), (jnp.bfloat16, "dtype"))
    ]


def linen_cases(label: str, norm: Any, method: Callable) -> list[Case]:
    """A linen norm's parameters as ``method`` creates them (exact), then its outputs
    with trained-like parameters, as :func:`nnx_cases`."""
    key = jax.random.key(0)
    init = run_case(
        f"{label} parameters", lambda x: norm.init(key, x, method=method), (probe_x(),), "exact"
    )
    variables = trained_like(init.value)
    values = "values" if all_float32(variables) else "dtype"
    return [init] + [
        run_case(
            f"{label}, {jnp.dtype(dtype).name} x",
            lambda v, x: norm.apply(v, x, method=method),
            (variables, probe_x(dtype=dtype)),
            check,
        )
        for dtype, check in ((jnp.float32, values), (jnp.bfloat16, "dtype"))
    ]


def _relative_difference(theirs: Any, ours: Any) -> float:
    theirs = np.asarray(theirs, np.float64)
    ours = np.asarray(ours, np.float64)
    return float(np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1e-30))


def _signature(tree: Any) -> Any:
    return jax.tree.map(lambda v: (tuple(v.shape), jnp.dtype(v.dtype).name), tree)


def _differences(case: Case, ours: Case) -> str | None:
    """What differs between the library's probe output and ours, or None."""
    a, b = case.value, ours.value
    same_tree = str(jax.tree.structure(a)) == str(jax.tree.structure(b))
    if not same_tree or _signature(a) != _signature(b):
        return f"ours gives {_signature(b)} where the library gives {_signature(a)}"
    if case.check == "exact":
        for va, vb in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            if not np.array_equal(np.asarray(va), np.asarray(vb)):
                return "the initial parameter values differ"
    elif case.check == "values" and jnp.dtype(a.dtype) == jnp.float32:
        rel = _relative_difference(a, b)
        if not rel <= PROBE_RTOL:  # NaN too
            return (
                f"float32 outputs differ by {rel:.3g} relative (max |ours - theirs| / max "
                f"|theirs|), more than {PROBE_RTOL:g}"
            )
    return None


@dataclasses.dataclass
class Swap:
    """One class's method to replace: ``make(original, implementation, hit)`` builds the
    replacement; ``probe(method)`` runs the class with ``method`` (the library's own, then
    ours) on probe inputs and returns the :class:`Case` s; ``check()``, where given, raises
    where the class is not the shape the patch knows, before any probe (at every patch)."""

    cls: type
    make: Callable[[Callable, str, Callable[[], None]], Callable]
    probe: Callable[[Callable], list[Case]]
    check: Callable[[], None] | None = None


def _probe(library: str, function: str, swap: Swap, method: Callable, whose: str) -> list[Case]:
    try:
        return swap.probe(method)
    except Exception as err:
        raise RuntimeError(
            f"{function} refused {swap.cls.__module__}.{swap.cls.__qualname__}: on a probe "
            f"input {whose} raised {type(err).__name__}: {err}. This {library} is not the "
            f"shape {function} knows; nothing was patched. Please report it with the "
            "version."
        ) from err


# The (class, its own method, replacement maker, implementation) that passed the probe in
# this process: patching again (a with block per test) does not probe again.
_VERIFIED: set[tuple] = set()


def _maker_key(make) -> tuple:
    """What names a replacement maker across calls: a function's module and qualified name,
    and a ``functools.partial``'s function with its arguments (a new partial each call)."""
    if isinstance(make, functools.partial):
        return (_maker_key(make.func), make.args, tuple(sorted(make.keywords.items())))
    return (make.__module__, make.__qualname__)


def apply(
    library: str,
    function: str,
    swaps: Sequence[Swap],
    implementation: str,
    name: str = "__call__",
    compare: Callable[[Case, Case], str | None] = _differences,
) -> Patch:
    """Checks every swap on its probe, then installs them all as each class's method
    ``name``; a :class:`Patch`. ``compare(theirs, ours)`` says how a probe case differs.

    Nothing is installed unless every class passes: a RuntimeError names the class, the
    probe case and the difference.
    """
    check_implementation(implementation)
    reach = Reach([target_name(s.cls, name) for s in swaps])
    planned = []
    for swap in swaps:
        original = own_call(swap.cls, library, name)
        hit = reach.counter(target_name(swap.cls, name))
        replacement = swap.make(original, implementation, hit)
        planned.append((swap.cls, original, replacement))
        if swap.check is not None:  # cheap, and the class may have changed since
            swap.check()
        key = (swap.cls, original, _maker_key(swap.make), implementation)
        if key in _VERIFIED:
            continue
        theirs = _probe(library, function, swap, original, f"{library}'s own {name}")
        ours = _probe(library, function, swap, replacement, "the rms_norm replacement")
        for case, mine in zip(theirs, ours, strict=True):
            difference = compare(case, mine)
            if difference is not None:
                raise RuntimeError(
                    f"{function} refused {swap.cls.__module__}.{swap.cls.__qualname__}: "
                    f"on the probe {case.label}, {difference}. Nothing was patched. This "
                    f"{library} computes something the patch does not know; please "
                    "report it with the version."
                )
        _VERIFIED.add(key)
    replaced = []
    for cls, original, replacement in planned:
        before = cls.__dict__[name]
        setattr(replacement, _ORIGINAL, original)
        type.__setattr__(cls, name, replacement)
        replaced.append((cls, before))
    reach.reset()
    # A trace made with the old method (a jitted step, gemma's nn.jit over the model, a
    # Keras model's predict, train and generate functions) would keep it: every trace is
    # dropped, so the next call traces the new one.
    jax.clear_caches()
    return Patch(library, replaced, implementation, reach, name)


class Patch:
    """What one ``patch_*`` call replaced, and how often the model reached it.

    ``undo()`` (or leaving its ``with`` block) puts back the methods that were in place
    when it was made (the library's own, or an earlier patch's) and drops jax's traces,
    so the next call runs them; a second ``undo()`` does nothing. ``unpatch_<library>()``
    restores the library's own whatever was patched.

    Attributes:
      library: the library patched (``"tunix"``, ``"gemma"``, ``"equinox"``, ``"flax"``,
        ``"MaxText"``, ``"keras"``).
      targets: the replaced methods, as ``"module.Class.__call__"`` (Keras's:
        ``"module.Class.call"``).
      implementation: the ``implementation=`` the patched methods pass to ``rms_norm``.
      calls: how many norm calls went through ``rms_norm`` in the patched methods since
        patching: each trace of a jitted function counts its norms once, each eager call
        once. 0 after a forward pass of the model means the patch reached nothing.
      calls_by_target: the same per target.

    ``repr(patch)`` says which; "reached nothing" where ``calls`` is 0.
    """

    def __init__(
        self,
        library: str,
        replaced: list[tuple[type, Callable]],
        implementation: str,
        reach,
        name: str = "__call__",
    ):
        self.library = library
        self._replaced = tuple(replaced)
        self._reach = reach
        self._name = name
        self.implementation = implementation
        self.targets = tuple(target_name(c, name) for c, _ in replaced)

    @property
    def calls(self) -> int:
        return sum(self._reach.counts.values())

    @property
    def calls_by_target(self) -> dict[str, int]:
        return dict(self._reach.counts)

    def undo(self) -> None:
        """Puts back what this patch replaced; a second ``undo()`` does nothing."""
        if not self._replaced:
            return
        for cls, before in reversed(self._replaced):
            type.__setattr__(cls, self._name, before)
        self._replaced = ()
        jax.clear_caches()

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "" if self._replaced else "undone, "
        if self.calls == 0:
            reach = "reached nothing: 0 norm calls through rms_norm since patching"
        else:
            per = ", ".join(
                f"{target.removesuffix('.' + self._name)}: {n}"
                for target, n in self._reach.counts.items()
                if n
            )
            reach = f"{self.calls} norm calls through rms_norm since patching ({per})"
        return (
            f"Patch({self.library}, {state}{reach}; {len(self.targets)} classes patched, "
            f"implementation={self.implementation!r})"
        )


def restore_all(classes: Sequence[type], name: str = "__call__") -> None:
    """``unpatch_<library>()``: the library's own methods, and jax's traces dropped."""
    patched = [cls for cls in classes if hasattr(cls.__dict__.get(name), _ORIGINAL)]
    for cls in patched:
        restore(cls, name)
    if patched:
        jax.clear_caches()
