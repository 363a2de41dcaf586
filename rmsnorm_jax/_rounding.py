"""Rounding to a narrow float that XLA cannot skip.

``add_rms_norm`` returns ``h = x + residual`` rounded to its dtype and normalizes that
same ``h``. XLA computes 16-bit arithmetic in float32 where the hardware has no 16-bit
unit (XLA:CPU, TPU v5e and older), and with excess precision allowed (its default) it
drops a float32 -> bfloat16 -> float32 round trip: the statistic and ``y`` then see the
unrounded float32 sum, up to one ulp of ``h`` away from the ``h`` returned and saved
for the backward, and ``y`` is no longer ``rms_norm(h)``. With a float32 operand, XLA may
also add it unrounded in one fusion and rounded in another. :func:`added` keeps every
rounding, so that each reader of ``h`` sees the one value written.

``lax.reduce_precision`` is the exact rounding of normal numbers, but it flushes the
subnormals of the narrow format to zero: a float16 row whose ``h`` is all subnormal
would then have a zero mean square and, with ``eps=0``, give NaN where the formula is
finite. Below the smallest normal the narrow format's values are the multiples of its
smallest subnormal, so there the rounding is ``round(v / q) * q``, scaled by exact
powers of two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def rounded(v: jax.Array, dtype) -> jax.Array:
    """``v`` (float32) rounded to nearest-even in ``dtype``'s format, kept in float32.

    Bitwise ``v.astype(dtype).astype(float32)`` (subnormals, ties, overflow to inf and
    NaN included), written so that no compiler simplifies it away.

    >>> import jax.numpy as jnp
    >>> v = jnp.array([1 + 2.0**-9, 3e-6, 7e4], jnp.float32)
    >>> rounded(v, jnp.float16).tolist() == v.astype(jnp.float16).astype(jnp.float32).tolist()
    True

    ``v`` itself for float32 and wider ``dtype``.
    """
    info = jnp.finfo(dtype)
    if info.bits >= 32:
        return v
    normal = lax.reduce_precision(v, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    if info.nexp >= 8:
        # float32's exponent range (bfloat16): reduce_precision rounds float32's own
        # subnormals bit for bit, and they are the format's subnormals.
        return normal
    # 1 / q = 2**e (2**24 for float16), applied in two exact power-of-two steps so that
    # no factor leaves float32's range for any format.
    e = -int(np.log2(float(info.smallest_subnormal)))
    half, rest = e // 2, e - e // 2
    subnormal = jnp.round(v * 2.0**half * 2.0**rest) * 2.0**-half * 2.0**-rest
    return jnp.where(jnp.abs(v) < float(info.smallest_normal), subnormal, normal)


def pinned(h: jax.Array) -> jax.Array:
    """``h`` (any float dtype) with its rounding to ``h.dtype`` kept in what reads it.

    The identity on values; for dtypes narrower than float32 it rounds the float32
    value again, so a compiler that kept ``h`` in float32 gets the rounded value.
    """
    if jnp.finfo(h.dtype).bits >= 32:
        return h  # nothing to keep, and no conversions to add
    return rounded(h.astype(jnp.float32), h.dtype).astype(h.dtype)


def added(a: jax.Array, b: jax.Array, dtype, *, keep: bool = True) -> jax.Array:
    """``a.astype(dtype) + b.astype(dtype)``, each of its roundings kept in what reads it.

    With excess precision XLA may add a float32 operand unrounded, or keep the sum in
    float32, in one fusion and not in another, so that the ``h`` written and the ``h``
    normalized differ; here every reader sees the one rounded ``h``. ``keep=False``
    gives the plain sum, for compilers that round it themselves (Triton, Mosaic,
    XLA:GPU: ``_xla/per_compiler.residual_sum``).

    >>> import jax.numpy as jnp
    >>> added(jnp.float32(1.0), jnp.float32(2.0**-9), jnp.bfloat16).dtype
    dtype(bfloat16)
    """
    dtype = np.dtype(dtype)
    if not keep:
        return a.astype(dtype) + b.astype(dtype)

    def to(v):
        return v if v.dtype == dtype else pinned(v.astype(dtype))

    return pinned(to(a) + to(b))
