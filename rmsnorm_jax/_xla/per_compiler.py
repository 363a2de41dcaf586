"""What differs per compiler on the XLA path: chosen when a program is lowered, not when
it is traced.

The maths of each pass lives in ``passes.py``, once. This file holds the few forms that
exist for one backend only; why each is there, and what it was measured against, is in
``docs/xla-programs.md`` and ``docs/cpu.md``. The choice is made by
``lax.platform_dependent``, which lowers only the branch of the platform being compiled
for, so a TPU or GPU program compiled from a CPU process (``rmsnorm_jax.aot``) gets the
accelerator form and never sees a CPU workaround. None of them changes a rounding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from .._rounding import added
from .._types import vma


def cpu_barrier(operands):
    """``lax.optimization_barrier(operands)`` on XLA:CPU; the operands unchanged elsewhere.

    Each pass reads ``x`` (and ``dy``) through one, so that XLA:CPU fuses every pass with
    its own casts and broadcasts instead of sharing full-size float32 copies
    (``docs/cpu.md``); on GPU and TPU a barrier splits fusions (``docs/xla-programs.md``).
    """
    return lax.platform_dependent(operands, cpu=_barrier, default=_same_vma)


def _barrier(operands):
    # Inside ``shard_map`` jax 0.10 marks every output of a barrier varying along the
    # union of its operands' axes, jax 0.12 each along its own operand's: marked to the
    # union here, the outputs have the same types on every version, and the same as
    # the other branch's.
    return _same_vma(lax.optimization_barrier(operands))


def _same_vma(operands):
    """The operands, each marked varying along every mesh axis that any of them varies
    along: both branches of a ``platform_dependent`` must return the same types. Outside
    ``shard_map`` (or when they already agree) nothing changes."""
    leaves, tree = jax.tree.flatten(operands)
    vmas = [vma(jax.typeof(a)) for a in leaves]
    union = frozenset().union(*vmas)
    leaves = [
        lax.pcast(a, tuple(sorted(union - v)), to="varying") if union - v else a
        for a, v in zip(leaves, vmas, strict=True)
    ]
    return jax.tree.unflatten(tree, leaves)


def on_gpu(operands, gpu, default):
    """``gpu(operands)`` when lowering for CUDA or ROCm, ``default(operands)`` elsewhere."""
    return lax.platform_dependent(operands, cuda=gpu, rocm=gpu, default=default)


def on_backend(operands, *, gpu, tpu, default):
    """``gpu``, ``tpu`` or ``default`` applied to ``operands``, by the platform lowered for."""
    return lax.platform_dependent(operands, cuda=gpu, rocm=gpu, tpu=tpu, default=default)


def residual_sum(x: jax.Array, residual: jax.Array, dtype) -> jax.Array:
    """``h = x.astype(dtype) + residual.astype(dtype)``, the one ``h`` every reader sees.

    XLA:CPU and XLA:TPU compute a 16-bit sum in float32 and, with excess precision, may
    let the statistic read the unrounded sum: ``_rounding.added`` keeps every rounding
    there. XLA:GPU writes ``h`` from a kernel of its own, rounded already, and the kept
    float16 rounding would make it recompute ``h`` inside the normalisation, so GPUs get
    the plain sum (``docs/llm-layers.md``).
    """
    if jnp.finfo(dtype).bits >= 32:
        return added(x, residual, dtype, keep=False)  # no rounding to keep
    return on_gpu(
        (x, residual),
        gpu=lambda ops: added(ops[0], ops[1], dtype, keep=False),
        default=lambda ops: added(ops[0], ops[1], dtype),
    )


def tpu_column_sum(prod: jax.Array, keep: tuple[int, ...]) -> jax.Array:
    """``sum(prod)`` over the axes not in ``keep`` (size-1 dims kept): for TPUs.

    The scale gradient's sum over rows as a plain reduction: the generic ``dot_general``
    puts the features first, and XLA:TPU then does not merge the sum into the backward's
    other passes (one more fusion per norm; ``docs/xla-programs.md``).
    """
    contract = tuple(i for i in range(prod.ndim) if i not in keep)
    return jnp.sum(prod, contract, keepdims=True)


def row_groups(rows: int, rows_per_group: int = 128) -> int:
    """How many groups of rows a two-stage column sum splits ``rows`` into (1: none).

    The divisor of ``rows`` nearest ``rows / rows_per_group`` among the multiples of the
    largest power of two that divides ``rows`` and is at most that target, so that a
    power-of-two data-parallel split of the rows rarely cuts a group.

    >>> row_groups(16384), row_groups(3276), row_groups(1638), row_groups(100)
    (128, 28, 14, 1)
    """
    if rows < 2 * rows_per_group:
        return 1
    target = rows / rows_per_group
    unit = min(rows & -rows, 1 << (int(target).bit_length() - 1))
    candidates = [g for g in range(unit, rows + 1, unit) if rows % g == 0]
    return min(candidates, key=lambda g: (abs(g - target), g))


# The first stage's parallelism is groups x columns partial sums; below about 64k of
# them an H100 is underfilled (docs/xla-programs.md).
_PARTIAL_SUMS = 65536


def rows_per_group(rows: int, columns: int) -> int:
    """Rows per group of a two-stage column sum: enough groups for ``_PARTIAL_SUMS``
    partial sums, as a power of two from 16 to 128 (smaller inputs, smaller groups).

    >>> rows_per_group(256, 4096), rows_per_group(1024, 4096), rows_per_group(4096, 4096)
    (16, 64, 128)
    """
    groups = -(-_PARTIAL_SUMS // max(columns, 1))
    per_group = rows / groups
    nearest = 2 ** round(math.log2(per_group)) if per_group >= 1 else 1
    return max(16, min(128, nearest))


def two_stage_column_sum(prod: jax.Array, keep: tuple[int, ...]) -> jax.Array:
    """``sum(prod)`` over the axes not in ``keep``, the leading ones in two stages: for GPUs.

    XLA:GPU sums a tall matrix over its rows with one kernel whose parallelism is the
    number of columns; summing groups of rows first, then the group partials, keeps the
    GPU busy (``docs/xla-programs.md``). The ``reduce_precision`` to the partials' own
    format changes no bit; it keeps XLA's simplifier from merging the two sums again.
    """
    contract = tuple(i for i in range(prod.ndim) if i not in keep)
    lead = 0
    while lead < prod.ndim and lead in contract:
        lead += 1
    rows = math.prod(prod.shape[:lead])
    columns = math.prod(prod.shape[i] for i in keep)
    if not isinstance(rows, int):  # jax.export's symbolic rows: no groups to size
        return jnp.sum(prod, contract, keepdims=True)
    per_group = rows_per_group(rows, columns)
    if per_group == 128:
        # Large sums: two stages only where XLA's H100 cost model has them cheaper.
        large = columns >= 4096 or rows >= 2048 or (rows >= 1024 and columns >= 1024)
        groups = row_groups(rows) if lead and large else 1
    else:
        groups = row_groups(rows, per_group) if lead else 1
    if groups == 1:
        return jnp.sum(prod, contract, keepdims=True)
    rest = prod.shape[lead:]
    grouped = prod.reshape((groups, rows // groups, *rest))
    inner = (1, *(2 + i - lead for i in contract if i >= lead))
    partial = jnp.sum(grouped, inner, keepdims=True)
    info = jnp.finfo(partial.dtype)
    partial = lax.reduce_precision(partial, info.nexp, info.nmant)
    total = jnp.sum(partial, 0)
    return total.reshape(tuple(1 if i in contract else d for i, d in enumerate(prod.shape)))
