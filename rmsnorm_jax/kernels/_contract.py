"""The contract between the kernel path and each backend, and the per-row maths they share.

A backend is a module (``mosaic_gpu.py``: Mosaic GPU; ``triton.py``: Pallas-Triton;
``mosaic_tpu.py``: Mosaic TPU) that is a :class:`Backend`; ``_select.py`` lists them and
mypy checks each against the protocol there. The per-row helpers below are called by
every backend's kernel bodies, so that the kernels and the XLA path compute the same
formula (``docs/derivatives.md``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Static description of one kernel call (hashable).

    Attributes:
      n: features per row (the last axis).
      k: features that enter the mean square (the first k; k == n for p = 1).
      eps: the epsilon.
      inside: True for rsqrt(ms + eps), False for 1 / (sqrt(ms) + eps).
      scale_offset: added to scale before it multiplies (1.0: Gemma's 1 + scale).
      has_scale, has_bias: whether scale / bias are given.
      out_dtype: dtype of y.
    """

    n: int
    k: int
    eps: float
    inside: bool
    scale_offset: float
    has_scale: bool
    has_bias: bool
    out_dtype: np.dtype


# The dtypes every backend takes for its rows, parameters and outputs.
KERNEL_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


class Backend(Protocol):
    """One backend's kernels, as the kernel path (``_select.py``, ``_launch.py``) uses them.

    Attributes:
      NAME: the registry's name (``"mosaic_gpu"``, ``"triton"``, ``"mosaic_tpu"``).
      LABEL: the name said to users (``"Mosaic GPU"``).
      PLATFORM: the platform its kernels compile for (``lax.platform_dependent``'s
        ``"cuda"`` or ``"tpu"``); on a CPU they may run interpreted.
    """

    NAME: str
    LABEL: str
    PLATFORM: str

    def unusable(self, target: Any) -> str | None:
        """Why this jax or the device ``target`` (a ``_device.Target``) cannot run the
        kernels, or None where it can."""
        ...

    def deprecated(self, version: str) -> str | None:
        """Why ``implementation="auto"`` must not take them with jax ``version`` (every
        lowering warns there), or None."""
        ...

    def fits(
        self,
        spec: KernelSpec,
        rows: int,
        x_dtype: Any,
        *,
        kind: str | None = None,
        residual_dtype: Any = None,
        h_dtype: Any = None,
        dx_dtype: Any = None,
    ) -> bool:
        """Whether the ``kind`` kernel (``"forward"`` or ``"backward"``) takes ``rows`` rows
        of ``spec.n`` features of ``x_dtype`` with these dtypes (``residual_dtype``: the
        forward's residual, or the backward's ``dh``); without ``kind``, whether both
        kernels take every form of the call. False: the call stays on XLA."""
        ...

    def forward(
        self,
        spec: KernelSpec,
        x: jax.Array,
        scale: jax.Array | None,
        bias: jax.Array | None,
        residual: jax.Array | None = None,
        *,
        h_dtype: Any = None,
        interpret: Any = False,
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """One pass: ``(y, stat, h)``.

        x, residual: (rows, n); scale, bias: (n,) or None (in their own dtypes). With
        ``residual``: h = x.astype(h_dtype) + residual.astype(h_dtype) is the row that is
        normalized and is returned; otherwise h is None and x is normalized. y: (rows, n)
        in spec.out_dtype; stat: (rows,) float32, the per-row residual of the XLA path
        (``_xla/passes.py``): rsqrt(ms + eps) for "inside", sqrt(ms) for "outside", ms the
        mean of the squares of the first spec.k features. Reads x (and residual) once,
        writes y (and h) once. ``interpret``: run on a CPU in Pallas interpret mode.
        """
        ...

    def backward(
        self,
        spec: KernelSpec,
        x: jax.Array,
        dy: jax.Array,
        stat: jax.Array,
        scale: jax.Array | None,
        dh: jax.Array | None = None,
        *,
        dx_dtype: Any,
        interpret: Any = False,
    ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """One pass: ``(dx, dscale_partials, dbias_partials)``.

        x: the normalized rows (h for the residual form), dy: (rows, n); stat: (rows,)
        float32 as above; scale: (n,) or None; dh: (rows, n) or None, a cotangent added
        to dx (the residual form's cotangent of h). dx: (rows, n) in dx_dtype.
        dscale_partials / dbias_partials: (blocks, n) float32 partial sums over blocks of
        rows of dy * xhat / dy (None when spec.has_scale / spec.has_bias is False); the
        caller sums them over axis 0. Reads x, dy (and dh) once, writes dx once.
        """
        ...


# ---------------------------------------------------------------- the calls' arguments


def check_dtype(name: str, dtype, kernels: str) -> np.dtype:
    """``dtype`` as a NumPy dtype if ``kernels`` (e.g. "the Triton kernels") take it."""
    if dtype is None or np.dtype(dtype) not in KERNEL_DTYPES:
        raise TypeError(
            f"{name} must be float32, bfloat16 or float16 for {kernels}, got {dtype} (use "
            f"implementation='xla' for other dtypes)."
        )
    return np.dtype(dtype)


def check_rows(name: str, a, spec: KernelSpec, kernels: str, rows: int | None = None) -> None:
    """``a`` is ``(rows, spec.n)`` of a dtype the kernels take."""
    if a.ndim != 2 or a.shape[1] != spec.n or (rows is not None and a.shape[0] != rows):
        want = f"({'rows' if rows is None else rows}, {spec.n})"
        raise ValueError(
            f"{name} must have shape {want} (rows of spec.n = {spec.n} features), got "
            f"{a.shape}; reshape it to (-1, {spec.n}) first."
        )
    check_dtype(name, a.dtype, kernels)


def check_param(name: str, a, present: bool, spec: KernelSpec, kernels: str) -> None:
    """``a`` (a scale or bias) is given exactly where ``spec`` says, ``(spec.n,)``."""
    flag = f"spec.has_{name}"
    if present and a is None:
        raise ValueError(f"{name} is None but {flag} is True; pass the {name} or fix the spec.")
    if not present and a is not None:
        raise ValueError(f"{name} was given but {flag} is False; pass None or fix the spec.")
    if a is not None:
        if a.shape != (spec.n,):
            raise ValueError(
                f"{name} must have shape ({spec.n},), got {a.shape}; reshape it to ({spec.n},)."
            )
        check_dtype(name, a.dtype, kernels)


def check_forward(spec: KernelSpec, x, scale, bias, residual, h_dtype, kernels: str):
    """The forward's arguments checked: ``(rows, h_dtype or None, y's dtype)``."""
    check_rows("x", x, spec, kernels)
    rows = x.shape[0]
    if residual is not None:
        check_rows("residual", residual, spec, kernels, rows)
        h_dtype = check_dtype("h_dtype", h_dtype, kernels)
    check_param("scale", scale, spec.has_scale, spec, kernels)
    check_param("bias", bias, spec.has_bias, spec, kernels)
    return (
        rows,
        (h_dtype if residual is not None else None),
        check_dtype("spec.out_dtype", spec.out_dtype, kernels),
    )


def check_backward(spec: KernelSpec, x, dy, stat, scale, dh, dx_dtype, kernels: str):
    """The backward's arguments checked: ``(rows, dx's dtype)``."""
    check_rows("x", x, spec, kernels)
    rows = x.shape[0]
    check_rows("dy", dy, spec, kernels, rows)
    if dh is not None:
        check_rows("dh", dh, spec, kernels, rows)
    if stat.shape != (rows,):
        raise ValueError(
            f"stat must have shape ({rows},) (one float32 per row), got {stat.shape}; "
            f"pass the forward's stat reshaped to ({rows},)."
        )
    check_param("scale", scale, spec.has_scale, spec, kernels)
    return rows, check_dtype("dx_dtype", dx_dtype, kernels)


def planned_fits(plan, spec: KernelSpec, rows: int, x_dtype, kind=None, **dtypes) -> bool:
    """A backend's ``fits`` from its ``plan(spec, rows, x_dtype, kind, **dtypes)`` (None
    where the call does not fit). With ``kind`` (``"forward"`` or ``"backward"``) and the
    call's dtypes (``residual_dtype``, ``h_dtype``, ``dx_dtype``): whether that kernel
    takes that call. Without: whether both kernels take every form of it, the residual
    forms with float32 or bfloat16 residual, h and dx."""
    if kind is not None:
        return plan(spec, rows, x_dtype, kind, **dtypes) is not None
    f32, bf16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
    forms: list[dict] = [{}] + [
        dict(residual_dtype=r, h_dtype=h, dx_dtype=d)
        for r, h, d in itertools.product((f32, bf16), repeat=3)
    ]
    return all(
        plan(spec, rows, x_dtype, k, **form) is not None
        for k in ("forward", "backward")
        for form in forms
    )


# Per-row maths on float32 blocks of shape (rows, n); ``col`` is the feature index of
# each column (an iota, (1, n) or (rows, n)), so padded columns (col >= n) and the tail
# of pRMSNorm (col >= k) can be masked.


def mean_square(spec: KernelSpec, xf: jax.Array, col: jax.Array) -> jax.Array:
    """(rows, 1): mean of the squares of the first k features (padding excluded)."""
    sq = jnp.where(col < spec.k, xf * xf, 0.0)
    return jnp.sum(sq, axis=-1, keepdims=True) * (1.0 / spec.k)


def stat_from_ms(spec: KernelSpec, ms: jax.Array) -> jax.Array:
    """The per-row residual: rsqrt(ms + eps) (inside) or sqrt(ms) (outside)."""
    return lax.rsqrt(ms + spec.eps) if spec.inside else jnp.sqrt(ms)


def inv_rms(spec: KernelSpec, stat: jax.Array) -> jax.Array:
    """r = 1 / RMS from the residual."""
    return stat if spec.inside else 1.0 / (stat + spec.eps)


def gain(spec: KernelSpec, scale_f: jax.Array | None) -> jax.Array | float:
    """(scale + scale_offset) in float32, or 1.0 without a scale."""
    if scale_f is None:
        return 1.0
    return scale_f + spec.scale_offset if spec.scale_offset else scale_f


def normalized(spec, xf, stat, scale_f, bias_f):
    """(scale + offset) * x * r + bias, float32."""
    y = xf * inv_rms(spec, stat) * gain(spec, scale_f)
    return y if bias_f is None else y + bias_f


def input_grad(spec, xf, dyf, stat, scale_f, col):
    """dx (float32) of one block of rows (``docs/derivatives.md``):

    dx = r * gdy - [col < k] * x * r * alpha * (1/k) * sum_j gdy_j * x_j * r,
    gdy = (scale + offset) * dy, alpha = r (inside) or 1/s (outside; 0 where s == 0).
    Padded columns must hold x == 0 and dy == 0.
    """
    r = inv_rms(spec, stat)
    gdy = dyf * gain(spec, scale_f)
    mean_term = jnp.sum(gdy * xf, axis=-1, keepdims=True) * (r * (1.0 / spec.k))
    if spec.inside:
        alpha = r
    else:
        safe = jnp.where(stat > 0, stat, 1.0)
        alpha = jnp.where(stat > 0, 1.0 / safe, 0.0)
    correction = xf * (mean_term * alpha * r)
    if spec.k < spec.n:
        correction = jnp.where(col < spec.k, correction, 0.0)
    return r * gdy - correction


def out_struct(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A kernel output's ``out_shape``, varying over the mesh axes that ``like`` varies
    over: inside a ``shard_map`` with ``check_vma=True`` Pallas needs it said."""
    return jax.ShapeDtypeStruct(
        shape, dtype, manual_axis_type=getattr(jax.typeof(like), "manual_axis_type", None)
    )
