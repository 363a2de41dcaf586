"""A linear map with a hand-written transpose: how the norms get forward mode and keep
their analytic backward.

Each norm is a ``jax.custom_jvp`` whose rule returns the primal output and its tangent
``T(res; dt)``, a map linear in the tangents ``dt`` given residuals ``res``. The
tangent is computed by :func:`linear_call`, a primitive of this library whose transpose
is the norm's backward rule ``B(res; dy)``. So:

- forward mode (``jax.jvp``, ``jacfwd``, ``linearize``) evaluates ``T``;
- reverse mode linearizes (the residuals are what ``T`` reads: ``x``, ``scale`` and one
  float32 per row, as a ``custom_vjp`` would keep) and transposes ``T`` into ``B``:
  the hand-written backward, XLA or Pallas, never autodiff of the forward. ``B`` is
  traced into the program at that point (its operations are the program's own, seen by
  every pass: remat, sharding, ``jax.jit`` of a vjp function);
- differentiating ``B`` again (forward-over-reverse, grad-of-grad, ``hessian``), or ``T``
  with respect to the residuals, is jax's own autodiff of their operations (a Pallas
  kernel in them differentiates as its XLA twin: ``kernels/_launch.py``).

jax's ``jax.custom_derivatives.linear_call`` does the custom transpose too, but has no
batching rule and refuses tangents on its residuals (jax 0.10), which ``vmap``,
``jacfwd`` and second order need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive, unmapped_aval
from jax.interpreters import ad, batching, mlir

Fn = Callable[[tuple, tuple], Sequence[jax.Array]]

linear_call_p = Primitive("rmsnorm_jax_linear")
linear_call_p.multiple_results = True


def linear_call(
    fwd: Fn,
    bwd: Fn,
    res: Sequence[jax.Array],
    lin: Sequence[jax.Array],
    out_types: Sequence,
) -> list[jax.Array]:
    """``fwd(res, lin)``, a map linear in ``lin``, transposed by ``bwd(res, cts)``.

    Args:
      fwd: ``(res, lin) -> outs``, linear in ``lin`` for fixed ``res``.
      bwd: ``(res, cts) -> lin cotangents``, one per ``lin`` entry, in their types.
      res, lin: tuples of arrays (no None).
      out_types: ``jax.typeof`` of each output (shape, dtype, sharding, varying axes).
    """
    res, lin = tuple(res), tuple(lin)
    lin_types = tuple(jax.typeof(a) for a in lin)
    return linear_call_p.bind(
        *res,
        *lin,
        fwd=fwd,
        bwd=bwd,
        num_res=len(res),
        out_types=tuple(out_types),
        lin_types=lin_types,
    )


def _split(args, num_res):
    return tuple(args[:num_res]), tuple(args[num_res:])


def _impl(*args, fwd, num_res, **_):
    res, lin = _split(args, num_res)
    return list(fwd(res, lin))


def _abstract_eval(*args, out_types, **_):
    return list(out_types)


def _jvp(primals, tangents, **params):
    num_res, fwd = params["num_res"], params["fwd"]
    res, lin = _split(primals, num_res)
    res_dot, lin_dot = _split(tangents, num_res)
    out = linear_call_p.bind(*primals, **params)
    out_dot = [ad.Zero(t.to_tangent_aval()) for t in params["out_types"]]
    if any(type(t) is not ad.Zero for t in lin_dot):
        # Linear in lin: the tangent is the same map of the tangents.
        lin_dot = tuple(ad.instantiate_zeros(t) for t in lin_dot)
        out_dot = linear_call_p.bind(*res, *lin_dot, **params)
    if any(type(t) is not ad.Zero for t in res_dot):
        # Through the residuals: jax's autodiff of the map, for fixed lin.
        res_dot = tuple(ad.instantiate_zeros(t) for t in res_dot)
        _, through_res = jax.jvp(lambda *r: tuple(fwd(r, lin)), res, res_dot)
        out_dot = [
            b if type(a) is ad.Zero else a + b for a, b in zip(out_dot, through_res, strict=True)
        ]
    return out, out_dot


def _transpose(cts, *args, fwd, bwd, num_res, out_types, lin_types):
    res, lin = _split(args, num_res)
    if any(ad.is_undefined_primal(r) for r in res):
        raise NotImplementedError(
            "rmsnorm_jax: transposing a norm's tangent map with respect to its "
            "residuals; please report this with the code that raised it."
        )
    cts = tuple(ad.instantiate_zeros(ct) for ct in cts)
    # The backward is traced here, into the program being transposed, not bound as a
    # primitive that would trace it only when lowered: every pass over the program sees
    # its operations (a kernel's ``custom_partitioning`` among them, which jax checks for
    # operations that need the devices while lowering, and ``jax.jit`` of a vjp function).
    lin_cts = bwd(res, cts)
    return [None] * num_res + [
        ct if ad.is_undefined_primal(a) else None for a, ct in zip(lin, lin_cts, strict=True)
    ]


def _vmapped(fn: Fn, res_axes: tuple) -> Fn:
    def batched(res, lin):
        return tuple(jax.vmap(lambda r, v: tuple(fn(r, v)), in_axes=(res_axes, 0))(res, lin))

    return batched


def _batch(args, dims, *, fwd, bwd, num_res, out_types, lin_types):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    res, lin = _split(args, num_res)
    res_dims, lin_dims = _split(dims, num_res)
    res = tuple(
        r if d is None else jnp.moveaxis(r, d, 0) for r, d in zip(res, res_dims, strict=True)
    )
    res_axes = tuple(None if d is None else 0 for d in res_dims)
    # Every linear operand batched at 0, so that the transpose is batched alike.
    lin = tuple(
        batching.broadcast(a, size, 0, None) if d is None else jnp.moveaxis(a, d, 0)
        for a, d in zip(lin, lin_dims, strict=True)
    )

    def batched_type(t):
        return unmapped_aval(size, 0, t)

    out = linear_call_p.bind(
        *res,
        *lin,
        fwd=_vmapped(fwd, res_axes),
        bwd=_vmapped(bwd, res_axes),
        num_res=num_res,
        out_types=tuple(batched_type(t) for t in out_types),
        lin_types=tuple(jax.typeof(a) for a in lin),
    )
    return out, [0] * len(out)


def nonzero(tangents: Sequence) -> tuple[bool, ...]:
    """Which tangents of a ``custom_jvp(symbolic_zeros=True)`` rule are not zero."""
    return tuple(
        t is not None and not isinstance(t, jax.custom_derivatives.SymbolicZero) for t in tangents
    )


def fill(present: Sequence[bool], values: Sequence) -> list:
    """``values`` spread over the True places of ``present``, None elsewhere."""
    it = iter(values)
    return [next(it) if p else None for p in present]


def tangents_of(outs: Sequence[jax.Array], res: Sequence, tangents: Sequence, tangent, backward):
    """The tangents of ``outs`` for a ``custom_jvp(symbolic_zeros=True)`` rule.

    Args:
      outs: the primal outputs.
      res: the residuals the maps read (None allowed).
      tangents: the rule's tangents of the differentiable inputs (None or
        ``SymbolicZero`` where zero).
      tangent: ``T(res, tangents) -> out tangents``, linear in the tangents (None where
        zero), each output's tangent in its type.
      backward: ``B(res, cts) -> input cotangents``, one per entry of ``tangents``
        (None allowed where the input is absent), each in its input's type.
    """
    present = nonzero(tangents)
    if not any(present):
        return [jnp.zeros_like(o) for o in outs]
    lin = [t for t, p in zip(tangents, present, strict=True) if p]
    res_present = tuple(r is not None for r in res)
    res_arrays = tuple(r for r in res if r is not None)

    def fwd(res_arrays, lin):
        return list(tangent(fill(res_present, res_arrays), fill(present, lin)))

    def bwd(res_arrays, cts):
        cts = backward(fill(res_present, res_arrays), cts)
        return [c for c, p in zip(cts, present, strict=True) if p]

    return linear_call(fwd, bwd, res_arrays, lin, [jax.typeof(o) for o in outs])


linear_call_p.def_impl(_impl)
linear_call_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[linear_call_p] = _jvp
ad.primitive_transposes[linear_call_p] = _transpose
batching.primitive_batchers[linear_call_p] = _batch
mlir.register_lowering(linear_call_p, mlir.lower_fun(_impl, multiple_results=True))
