"""What differs per compiler: chosen when a program is lowered, not when it is traced.

The maths of each pass lives in ``_vjp.py``, once. This file holds the few lines that
exist for one backend only, each with the measurement that put it there. The choice is
made by ``lax.platform_dependent``, which lowers only the branch of the platform being
compiled for, so a TPU or GPU program compiled from a CPU process (``rmsnorm_jax.aot``)
gets the accelerator expression and never sees a CPU workaround.
"""

from __future__ import annotations

from jax import lax


def cpu_barrier(operands):
    """``lax.optimization_barrier(operands)`` on XLA:CPU; the operands unchanged elsewhere.

    Each pass of the forward and backward rules reads ``x`` (and ``dy``) through one,
    so that XLA:CPU fuses every pass with its own dtype casts and broadcasts instead of
    materialising full-size float32 copies shared between passes (measured on XLA:CPU:
    the backward 1.5x to 3.5x faster, bfloat16 forwards of wide rows 3x to 7x).
    On GPU and TPU a barrier does harm: on H100 it splits the forward's single fused
    kernel into three (1.55x slower by XLA's cost model), and on TPU v5e it costs
    33-44 % more estimated cycles for forward+backward.
    """
    return lax.platform_dependent(operands, cpu=lax.optimization_barrier, default=lambda a: a)
