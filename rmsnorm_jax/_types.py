"""What a value's type says beyond shape and dtype: the mesh axes it varies along inside
``shard_map`` and its explicit sharding; and a cotangent cast back to its primal's type."""

from __future__ import annotations

import jax
from jax import lax


def vma(aval) -> frozenset:
    """Mesh axes along which a value of type ``aval`` varies inside ``shard_map``."""
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def varying(a: jax.Array, axes: frozenset) -> jax.Array:
    """``a`` marked as varying along the mesh ``axes`` it does not vary along yet."""
    extra = tuple(sorted(axes - vma(jax.typeof(a))))
    return lax.pcast(a, extra, to="varying") if extra else a


def match_vma(ct: jax.Array, target_vma: frozenset) -> jax.Array:
    """Sums a cotangent over the mesh axes along which its primal was replicated.

    Inside ``shard_map`` a parameter replicated over an axis that ``x`` is split along
    gets one partial gradient per device; the true gradient is their sum, and JAX's
    varying-axes check insists the cotangent be replicated like the primal.
    """
    extra = tuple(sorted(vma(ct) - target_vma))
    return lax.psum(ct, extra) if extra else ct


def explicit_spec(aval) -> tuple | None:
    """The partition spec of ``aval`` (one entry per dim) when any of its axes is
    explicitly sharded (``jax.sharding.AxisType.Explicit``), else None."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    if spec is None or all(entry is None for entry in spec):
        return None
    return tuple(spec) + (None,) * (len(aval.shape) - len(spec))


def cotangent_like(ct: jax.Array, primal_type) -> jax.Array:
    """``ct`` in its primal's type: shape, dtype, varying axes and explicit sharding (a
    parameter split over an explicit mesh axis gets its gradient split alike)."""
    ct = ct.reshape(primal_type.shape).astype(primal_type.dtype)
    spec, ct_spec = explicit_spec(primal_type), explicit_spec(jax.typeof(ct))
    if spec != ct_spec:
        ct = jax.sharding.reshard(ct, primal_type.sharding.spec)
    return match_vma(ct, vma(primal_type))
