"""Which path computes a call: the registry of kernel backends and the one function that
selects among them.

:func:`select` decides, for one platform and one pass (forward or backward) of a call,
which backend's kernels compute it, or XLA, and says why. :func:`route`, called by
``rms_norm``, ``add_rms_norm`` and ``gated_rms_norm``, asks it for every platform and
both passes of the call and takes the kernel path where any answer is a kernel; the
launch (``_launch.py``) asks it again for each platform being lowered, with the rows
each device computes, and ``explain`` prints the route. Nothing else decides.

- ``implementation="xla"``: XLA.
- ``"pallas"``: the platform's first :data:`BACKENDS` entry that this jax and the device
  can run (Mosaic GPU on Hopper and Blackwell, else Pallas-Triton on an NVIDIA GPU;
  Mosaic TPU on a TPU; the Triton kernels in interpret mode on a CPU), where the call
  fits it; XLA elsewhere.
- a backend's name (``"mosaic_gpu"``, ``"triton"``, ``"mosaic_tpu"``): that backend on its
  platform where this jax and the device run it and the call fits it (on a CPU, Triton
  interpreted); XLA elsewhere. For comparing backends (benchmarks, tests).
- ``"auto"``: the backend of a measured win (``_measured.py``) that covers the call on
  the device being compiled for and this jax, where that backend runs without a
  deprecation warning and the call fits it; XLA everywhere else.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._config import NormConfig, check_implementation
from .._types import vma
from .._xla.add_rms_norm import AddConfig
from . import _device, _measured
from ._contract import KERNEL_DTYPES, Backend, KernelSpec

# The platforms a program may be lowered for with a kernel of ours, in explain's order.
PLATFORMS = ("cuda", "tpu", "cpu")
PLATFORM_NAMES = {"cuda": "GPU", "tpu": "TPU", "cpu": "CPU", "rocm": "ROCm"}
# The functions that have kernels.
KERNEL_OPS = ("rms_norm", "add_rms_norm")


# ---------------------------------------------------------------- the backends


def _mosaic_gpu() -> Backend:
    from . import mosaic_gpu

    return mosaic_gpu


def _triton() -> Backend:
    from . import triton

    return triton


def _mosaic_tpu() -> Backend:
    from . import mosaic_tpu

    return mosaic_tpu


@dataclasses.dataclass(frozen=True)
class Entry:
    """A backend in the registry: the platform its kernels compile for, the jax module
    they lower through, and the loader of our module (imported on first use)."""

    platform: str
    needs: str
    loader: Callable[[], Backend]


# A platform's backends in the order "pallas" prefers them. Our module is imported only
# where jax ships the one it needs: a jax without Pallas-Triton never imports triton.py.
BACKENDS: dict[str, Entry] = {
    "mosaic_gpu": Entry("cuda", "jax.experimental.pallas.mosaic_gpu", _mosaic_gpu),
    "triton": Entry("cuda", "jax.experimental.pallas.triton", _triton),
    "mosaic_tpu": Entry("tpu", "jax.experimental.pallas.tpu", _mosaic_tpu),
}
# A CPU has no kernels of ours: these run there in interpret mode (tests). Mosaic GPU's
# interpreter cannot: its ordered callbacks do not lower inside the launch's
# custom_partitioning under jit (jax 0.12.0.1), so it is tested on its own.
INTERPRETED_ON_CPU = ("triton",)


def load(name: str) -> tuple[Backend | None, str]:
    """The backend called ``name``, or None and why this jax cannot import it."""
    entry = BACKENDS[name]
    try:
        importlib.import_module(entry.needs)
    except ImportError:
        return None, f"jax {jax.__version__} has no {entry.needs}"
    try:
        return entry.loader(), ""
    except ImportError as err:  # an older jax's dialect without what our kernels use
        return None, f"the {name} kernels do not import on jax {jax.__version__}: {err}"


def _seen_from(target: _device.Target, platform: str) -> _device.Target:
    """The device of ``platform`` as the trace knows it: ``target``, or one not known
    where the program is traced for a device of another platform."""
    return target if target.platform == platform else _device.Target(platform, "")


# ---------------------------------------------------------------- what the kernels take


def _row_param(param, n: int) -> bool:
    """Whether a scale or bias is one value per feature of the last axis (or absent)."""
    return param is None or (param.shape[-1:] == (n,) and math.prod(param.shape) == n)


def why_not_kernels(cfg: NormConfig, x, scale, bias, mask) -> str | None:
    """Why a call does not fit any kernel (see :func:`kernel_spec`), or None if it may."""
    if mask is not None:
        return "a mask"
    if cfg.axis_name is not None:
        return "axis_name (features split across devices)"
    if cfg.axes != (x.ndim - 1,):
        return f"normalized axes {cfg.axes}, not the last axis alone"
    if np.dtype(x.dtype) not in KERNEL_DTYPES:
        return f"x of dtype {np.dtype(x.dtype).name} (the kernels take float32/bfloat16/float16)"
    if cfg.compute_dtype != np.dtype(jnp.float32):
        return f"statistics in {np.dtype(cfg.compute_dtype).name}, not float32"
    if not (_row_param(scale, cfg.n) and _row_param(bias, cfg.n)):
        return "a scale or bias that is not one value per feature"
    return None


def kernel_spec(cfg: NormConfig, scale, bias) -> KernelSpec:
    """The kernels' description of a call that :func:`why_not_kernels` lets through: rows
    of the last axis (any leading dims), float32 statistics, a scale and bias of one value
    per feature, pRMSNorm, ``scale_offset`` and both eps placements."""
    return KernelSpec(
        n=cfg.n,
        k=cfg.k,
        eps=cfg.eps,
        inside=cfg.inside,
        scale_offset=cfg.scale_offset,
        has_scale=scale is not None,
        has_bias=bias is not None,
        out_dtype=np.dtype(cfg.out_dtype),
    )


@dataclasses.dataclass(frozen=True)
class Request:
    """What the caller asked: ``op`` by ``implementation``, for input of ``dtype``."""

    op: str
    implementation: str
    dtype: str


@dataclasses.dataclass(frozen=True)
class Pass:
    """One kernel pass of a call, as one device runs it (the dtypes its ``fits`` reads).

    Attributes:
      kind: ``"forward"`` or ``"backward"``.
      rows: rows of the last axis.
      x_dtype: the rows normalized (``h`` in the residual form's backward).
      residual_dtype: the forward's residual, or the backward's ``dh``; None without.
      h_dtype: the residual form's ``h`` (forward); dx_dtype: ``dx`` (backward).
    """

    kind: str
    rows: int
    x_dtype: np.dtype
    residual_dtype: np.dtype | None = None
    h_dtype: np.dtype | None = None
    dx_dtype: np.dtype | None = None


def add_dx_dtype(acfg: AddConfig) -> np.dtype:
    """``add_rms_norm``'s backward writes one ``dh`` for both inputs: in the wider of
    their dtypes."""
    return np.dtype(jnp.promote_types(acfg.x_type.dtype, acfg.residual_type.dtype))


def passes(rows: int, x_dtype, acfg: AddConfig | None = None) -> tuple[Pass, Pass]:
    """The forward and backward passes of ``rms_norm`` (``acfg`` None) or of
    ``add_rms_norm`` on ``rows`` rows; the kernel path runs exactly these."""
    x_dtype = np.dtype(x_dtype)
    if acfg is None:
        return Pass("forward", rows, x_dtype), Pass("backward", rows, x_dtype, dx_dtype=x_dtype)
    h = np.dtype(acfg.residual_dtype)
    residual = np.dtype(acfg.residual_type.dtype)
    forward = Pass("forward", rows, x_dtype, residual_dtype=residual, h_dtype=h)
    return forward, Pass("backward", rows, h, residual_dtype=h, dx_dtype=add_dx_dtype(acfg))


# ---------------------------------------------------------------- the one selection


@dataclasses.dataclass(frozen=True)
class Choice:
    """What computes one pass on one platform: ``backend`` (a :data:`BACKENDS` name,
    run in interpret mode where ``interpret``), or XLA where it is None; ``reason``: why."""

    backend: str | None
    reason: str
    interpret: bool = False


def _preferred(platform: str, target: _device.Target) -> tuple[str | None, str]:
    """The backend ``"pallas"`` takes on ``platform``: the first this jax and the device
    can run, or None and why."""
    if platform == "cpu":
        names = list(INTERPRETED_ON_CPU)
    else:
        names = [name for name, entry in BACKENDS.items() if entry.platform == platform]
    if not names:
        return None, f"there are no kernels of ours for {PLATFORM_NAMES.get(platform, platform)}"
    reasons = []
    for name in names:
        backend, why = load(name)
        unusable = why if backend is None else backend.unusable(_seen_from(target, platform))
        if unusable is None:
            return name, ""
        reasons.append(unusable)
    return None, "; ".join(reasons)


def _named(name: str, platform: str) -> tuple[str | None, str]:
    """The backend asked for by name, on ``platform``: on its own, or interpreted on a CPU
    where it can be; None and why elsewhere."""
    home = BACKENDS[name].platform
    if platform == home or (platform == "cpu" and name in INTERPRETED_ON_CPU):
        return name, ""
    return None, f"implementation={name!r} runs on {PLATFORM_NAMES[home]} alone"


def _win_backend(request: Request, spec: KernelSpec, platform: str, step: Pass, target, version):
    """The backend of the measured win that covers the call, or None and why."""
    if platform != target.platform:
        return None, (
            f"'auto' takes kernels only where a measured win covers the device being "
            f"compiled for, a {target.kind or target.platform} ({target.platform})"
        )
    x_bytes = step.rows * spec.n * np.dtype(request.dtype).itemsize
    win, why = _measured.match(
        request.op, platform, target.kind, request.dtype, spec.n, x_bytes, version
    )
    if win is None:
        return None, f"'auto': {why}; implementation='pallas' takes the kernels anyway"
    return win.backend, f"measured: {win.source}"


def select(
    request: Request,
    spec: KernelSpec,
    platform: str,
    step: Pass,
    target: _device.Target,
    version: str,
    *,
    checked: bool = False,
) -> Choice:
    """What computes ``step`` of the call on ``platform``, for the device ``target`` being
    compiled for and jax ``version`` (module doc). ``checked``: inside a ``shard_map``
    that checks varying axes, where Pallas' interpreter cannot run."""
    if not isinstance(step.rows, int):  # jax.export's symbolic dimensions
        return Choice(None, f"{step.rows} rows, not a number: the kernels size their grid by it")
    if request.implementation == "auto":
        name, reason = _win_backend(request, spec, platform, step, target, version)
    elif request.implementation == "pallas":
        name, reason = _preferred(platform, target)
    else:
        name, reason = _named(request.implementation, platform)
    if name is None:
        return Choice(None, reason)
    backend, why = load(name)
    if backend is None:
        return Choice(None, why)
    unusable = backend.unusable(_seen_from(target, platform))
    if unusable is not None:
        return Choice(None, unusable)
    interpret = platform != backend.PLATFORM
    deprecated = None if interpret else backend.deprecated(version)
    if request.implementation == "auto" and deprecated is not None:
        return Choice(None, f"'auto' takes no backend that warns: {deprecated} ({reason})")
    if interpret and checked:
        return Choice(None, "Pallas' interpreter cannot run inside a shard_map that checks vma")
    dtypes = dict(residual_dtype=step.residual_dtype, h_dtype=step.h_dtype, dx_dtype=step.dx_dtype)
    if not backend.fits(spec, step.rows, step.x_dtype, kind=step.kind, **dtypes):
        return Choice(None, f"the row does not fit the {backend.LABEL} kernels")
    return Choice(name, reason, interpret)


# ---------------------------------------------------------------- a call's route


@dataclasses.dataclass(frozen=True)
class Route:
    """The path of one call: the kernels (``spec`` set) or XLA (``spec`` None, ``reason``
    says why); ``choices``: ``(platform, kind, Choice)`` for each platform and pass."""

    request: Request
    spec: KernelSpec | None
    reason: str = ""
    choices: tuple[tuple[str, str, Choice], ...] = ()


@dataclasses.dataclass(frozen=True)
class _Asking:
    """An ``explain`` in progress, for the device ``target`` and jax ``version`` (None:
    the device being compiled for, this jax)."""

    target: _device.Target | None = None
    version: str | None = None


_ASKING: contextvars.ContextVar[_Asking | None] = contextvars.ContextVar("asking", default=None)


class Explained(Exception):
    """Raised by :func:`route` inside :func:`explaining`: it carries the route."""

    def __init__(self, found: Route):
        super().__init__(found.reason)
        self.route = found


@contextlib.contextmanager
def explaining(target: _device.Target | None = None, version: str | None = None):
    """Within it, :func:`route` decides for the device ``target`` and jax ``version``
    (None: the device being compiled for, this jax) and raises :class:`Explained` with
    the route it found, instead of returning it to the call."""
    token = _ASKING.set(_Asking(target, version))
    try:
        yield
    finally:
        _ASKING.reset(token)


def _decided(found: Route) -> Route:
    if _ASKING.get() is not None:
        raise Explained(found)
    return found


def route(op: str, implementation: str, cfg: NormConfig, x, scale, bias, mask, acfg=None) -> Route:
    """The path of a call of ``op`` (module doc): ``x`` is the input as given (its dtype
    and rows), ``cfg``, ``scale``, ``bias`` and ``mask`` the checked arguments of the
    norm, ``acfg`` ``add_rms_norm``'s (:class:`~rmsnorm_jax._xla.AddConfig`)."""
    implementation = check_implementation(implementation)
    request = Request(op, implementation, np.dtype(x.dtype).name)
    if implementation == "xla":
        return _decided(Route(request, None, "implementation='xla'"))
    if op not in KERNEL_OPS:
        return _decided(Route(request, None, f"there is no fused kernel for {op} yet"))
    why = why_not_kernels(cfg, x, scale, bias, mask)
    if why is not None:
        return _decided(Route(request, None, f"the kernels do not take {why}"))
    spec = kernel_spec(cfg, scale, bias)
    asking = _ASKING.get() or _Asking()
    target = asking.target or _device.target()
    version = asking.version or _device.jax_version()
    checked = bool(vma(jax.typeof(x)))
    rows = math.prod(x.shape[:-1])
    choices = tuple(
        (p, step.kind, select(request, spec, p, step, target, version, checked=checked))
        for p in PLATFORMS
        for step in passes(rows, x.dtype, acfg)
    )
    if any(choice.backend for _, _, choice in choices):
        return _decided(Route(request, spec, "", choices))
    home = [c.reason for p, _, c in choices if p == target.platform][:1]
    reason = home[0] if implementation == "auto" and home else "no platform takes the kernels"
    return _decided(Route(request, None, reason, choices))
