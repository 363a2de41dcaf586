"""Which path computes a call: the XLA path (``_xla/``) or the fused kernels, and why.

``implementation="xla"`` is the XLA path; ``"pallas"`` the fused kernels wherever the call
fits them (otherwise XLA, see :func:`kernel_spec`); ``"auto"`` the kernels only where a
measurement on hardware, recorded in :data:`MEASURED` with its results file, found them
faster than XLA (``docs/kernels.md``), and XLA everywhere else.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from .._config import check_implementation
from ._contract import KernelSpec

KERNEL_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A measured win of the kernels over XLA that ``"auto"`` acts on.

    Attributes:
      op: ``"rms_norm"`` or ``"add_rms_norm"``: the function whose kernels won.
      platform: ``"cuda"`` or ``"tpu"`` (``lax.platform_dependent``'s names).
      backend: the kernels that won: ``"triton"``, ``"mosaic_gpu"`` or ``"mosaic_tpu"``.
      device_kind: a substring of ``jax.Device.device_kind`` (e.g. ``"H200"``).
      dtypes: the input dtype names it holds for.
      features: the inclusive range of features per row it holds for.
      min_bytes: the smallest ``x`` (bytes) measured; smaller calls stay on XLA.
      source: the results file and the command that measured it (device, jax, head).
    """

    op: str
    platform: str
    device_kind: str
    dtypes: tuple[str, ...]
    features: tuple[int, int]
    min_bytes: int
    source: str
    backend: str = "triton"


# The measured x of "32 MiB" is whole rows: 31.99 MiB at 5120 features.
_SMALLEST = 31 * 2**20
_H200_TRITON = (
    "benchmarks/results/h200-4ce9679/h200-measured.json: `python -m benchmarks ops "
    "--rounds 3` on an NVIDIA H200, jax 0.11.2, head 4ce9679 (docs/kernels.md)"
)

# The kernels' measured wins (docs/kernels.md has the tables): "auto" takes them on these
# device kinds, dtypes and widths only, and XLA everywhere else.
MEASURED: tuple[Measurement, ...] = (
    Measurement(
        op="rms_norm",
        platform="cuda",
        device_kind="H200",
        dtypes=("float32", "bfloat16"),
        features=(1024, 5120),
        min_bytes=_SMALLEST,
        source=_H200_TRITON,
    ),
    Measurement(
        op="add_rms_norm",
        platform="cuda",
        device_kind="H200",
        dtypes=("float32", "bfloat16"),
        features=(1024, 8192),
        min_bytes=_SMALLEST,
        source=_H200_TRITON,
    ),
)


def _row_param(param, n: int) -> bool:
    """Whether a scale or bias is one value per feature of the last axis (or absent)."""
    return param is None or (param.shape[-1:] == (n,) and math.prod(param.shape) == n)


def why_not_kernels(cfg, x, scale, bias, mask) -> str | None:
    """Why a call does not fit the kernels (see :func:`kernel_spec`), or None if it fits."""
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


def kernel_spec(cfg, x, scale, bias, mask) -> KernelSpec | None:
    """The kernels' description of a call, or None where the call does not fit them.

    The kernels take rows of the last axis (any leading dims), float32, bfloat16 or
    float16 input with float32 statistics, a scale and bias of one value per feature,
    pRMSNorm, ``scale_offset`` and both eps placements. They do not take a ``mask``,
    ``axis_name`` (features split across devices), normalized axes other than the
    last alone, float64, or a scale/bias that varies along the rows: those stay on XLA.
    (Rows too wide for a kernel's block fall back per backend, see ``kernels/__init__``.)
    """
    if why_not_kernels(cfg, x, scale, bias, mask) is not None:
        return None
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


def _target():
    """The device being compiled for: the abstract mesh's (``rmsnorm_jax.aot`` targets,
    ``jax.set_mesh``), else the default device."""
    try:
        device = jax.sharding.get_abstract_mesh().abstract_device
    except (AttributeError, ValueError):  # no mesh, or one without a device kind
        device = None
    if device is None or not getattr(device, "device_kind", None):
        device = jax.devices()[0]
    return device


def target_device() -> tuple[str, str]:
    """(platform, device kind) of the device being compiled for. A CUDA device's
    platform reads ``"gpu"``; it is named ``"cuda"`` here (``lax.platform_dependent``)."""
    device = _target()
    platform = getattr(device, "platform", "")
    return ("cuda" if platform == "gpu" else platform), device.device_kind


# Compute capability by device kind, for devices that do not say it (an abstract
# device); the longer names first, so that "A100" is not read as "A10".
_CAPABILITIES = (
    ("GH200", (9, 0)),
    ("GB200", (10, 0)),
    ("H100", (9, 0)),
    ("H200", (9, 0)),
    ("H800", (9, 0)),
    ("B200", (10, 0)),
    ("B100", (10, 0)),
    ("A100", (8, 0)),
    ("L40", (8, 9)),
    ("A10", (8, 6)),
    ("L4", (8, 9)),
)


def compute_capability(device=None) -> tuple[int, int] | None:
    """``(major, minor)`` of the GPU ``device`` (default: the one being compiled for), or
    None where it is not known (no GPU, a deviceless compile without a mesh)."""
    device = _target() if device is None else device
    capability = getattr(device, "compute_capability", None)
    if capability:
        major, minor = str(capability).split(".")[:2]
        return int(major), int(minor)
    kind = getattr(device, "device_kind", "") or ""
    return next((cap for name, cap in _CAPABILITIES if name in kind), None)


def mosaic_gpu_available() -> bool:
    """Whether this jax has the Mosaic GPU ``plgpu.kernel`` API the kernels need."""
    try:
        from . import mosaic_gpu
    except ImportError:
        return False
    return mosaic_gpu.available()


def triton_ships() -> bool:
    """Whether this jax ships the Pallas-Triton backend (deprecated since jax 0.11)."""
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return True


def gpu_backend(device=None) -> str | None:
    """The GPU kernels ``implementation="pallas"`` takes on ``device`` (default: the one
    being compiled for): Mosaic GPU on Hopper and Blackwell (or a GPU not known, as in a
    deviceless compile) where this jax has it; Triton elsewhere while jax ships it; None
    (XLA) otherwise."""
    capability = compute_capability(device)
    if mosaic_gpu_available() and (capability is None or capability[0] in (9, 10)):
        return "mosaic_gpu"
    return "triton" if triton_ships() else None


def triton_quiet() -> bool:
    """Whether this jax ships Pallas-Triton without deprecating it (jax < 0.11): from
    jax 0.11 on, every Triton lowering warns, and ``"auto"`` never takes Triton there."""
    major, minor = (int(part) for part in jax.__version__.split(".")[:2])
    return triton_ships() and (major, minor) < (0, 11)


def backend_usable(backend: str) -> bool:
    """Whether ``"auto"`` may take ``backend``'s kernels with this jax."""
    if backend == "triton":
        return triton_quiet()
    return backend != "mosaic_gpu" or mosaic_gpu_available()


def measured_win(op: str, spec: KernelSpec, x, device=None) -> Measurement | None:
    """The :data:`MEASURED` win for this call, or None. ``x``: the input (an array or
    ``jax.ShapeDtypeStruct``); ``device``: ``(platform, device kind)``, by default the
    device being compiled for."""
    platform, kind = target_device() if device is None else device
    x_dtype = np.dtype(x.dtype)
    x_bytes = math.prod(x.shape) * x_dtype.itemsize
    for m in MEASURED:
        if (
            m.op == op
            and m.platform == platform
            and m.device_kind in kind
            and np.dtype(x_dtype).name in m.dtypes
            and m.features[0] <= spec.n <= m.features[1]
            and x_bytes >= m.min_bytes
            and (m.platform != "cuda" or backend_usable(m.backend))
        ):
            return m
    return None


def use_kernels(
    implementation: str, cfg, x, scale, bias, mask, op: str = "rms_norm"
) -> KernelSpec | None:
    """The :class:`KernelSpec` when the kernels compute this call, else None (XLA).

    ``"pallas"``: wherever the call fits them, on every platform. ``"auto"``: only
    where :data:`MEASURED` holds a win for ``op`` on the device being compiled for, and
    there on that platform alone (XLA on the others).
    """
    implementation = check_implementation(implementation)
    if implementation == "xla":
        return None
    spec = kernel_spec(cfg, x, scale, bias, mask)
    if spec is None or implementation == "pallas":
        return spec
    win = measured_win(op, spec, x)
    if win is None:
        return None
    gpu = win.backend if win.platform == "cuda" else None
    return dataclasses.replace(spec, platforms=(win.platform,), gpu_backend=gpu)
