"""The device a program is being compiled for, and what the kernels read of it.

While a program is traced, the device it will run on is the abstract mesh's
(``rmsnorm_jax.aot`` targets, ``jax.set_mesh``) where that names a device kind, else the
default device. Every lookup of a platform, device kind, compute capability or SM count
in the kernels goes through :func:`target`.
"""

from __future__ import annotations

import dataclasses

import jax

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
# The SMs of an H100 SXM: the GPU assumed where the one being compiled for is not known.
DEFAULT_SMS = 132


@dataclasses.dataclass(frozen=True)
class Target:
    """The device a program is compiled for.

    Attributes:
      platform: ``lax.platform_dependent``'s name: ``"cuda"``, ``"rocm"``, ``"tpu"`` or
        ``"cpu"`` (a CUDA device's ``platform`` reads ``"gpu"``).
      kind: ``jax.Device.device_kind`` (``"NVIDIA H200"``, ``"TPU v5 lite"``, ``"cpu"``).
      capability: ``(major, minor)`` of a GPU, None where not known.
      cores: the SMs of a GPU (TensorCores of a TPU), None where not known.
    """

    platform: str
    kind: str
    capability: tuple[int, int] | None = None
    cores: int | None = None

    @classmethod
    def gpu(cls, kind: str, sms: int | None = None) -> Target:
        """An NVIDIA GPU of device kind ``kind`` (``"NVIDIA H200"``), its compute
        capability read from the kind."""
        return cls("cuda", kind, capability_of(kind), sms)

    @property
    def sms(self) -> int:
        """The SMs the GPU kernels size their grids for: an H100's where this is no GPU
        that says its count."""
        if self.platform == "cuda" and self.cores and self.cores > 1:
            return self.cores
        return DEFAULT_SMS


def capability_of(kind: str) -> tuple[int, int] | None:
    """The compute capability of a GPU by its device kind, None where not known."""
    return next((cap for name, cap in _CAPABILITIES if name in kind), None)


def _platform(device) -> str:
    platform = getattr(device, "platform", "") or ""
    return "cuda" if platform == "gpu" else platform


def _capability(device) -> tuple[int, int] | None:
    capability = getattr(device, "compute_capability", None)
    if capability:
        major, minor = str(capability).split(".")[:2]
        return int(major), int(minor)
    return capability_of(getattr(device, "device_kind", "") or "")


def describe(device) -> Target:
    """The :class:`Target` of a ``jax.Device`` (or an abstract mesh's device)."""
    cores = getattr(device, "num_cores", None) or getattr(device, "core_count", None)
    return Target(
        platform=_platform(device),
        kind=getattr(device, "device_kind", "") or "",
        capability=_capability(device),
        cores=int(cores) if cores else None,
    )


def target() -> Target:
    """The device being compiled for: the abstract mesh's, else the default device."""
    try:
        device = jax.sharding.get_abstract_mesh().abstract_device
    except (AttributeError, ValueError):  # no mesh, or one without a device kind
        device = None
    if device is None or not getattr(device, "device_kind", None):
        device = jax.devices()[0]
    return describe(device)


def jax_version() -> str:
    """The installed jax's version (the measured wins name the versions they hold for)."""
    return jax.__version__
