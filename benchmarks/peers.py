"""What the benchmarks compare: our norms, their peers, the baselines, and the programs of each.

Every section measures exactly these programs, so a device time, a CPU time and a compiler
estimate of one name are of the same program:

- :data:`IMPLEMENTATIONS`: ``rms_norm`` (p = 1 and p = 0.0625) and the ``RMSNorm`` Module,
  beside flax's ``RMSNorm`` and ``LayerNorm`` and the plain formula under autodiff
  (``norm(x, scale) -> y``);
- :data:`FUSED`: ``add_rms_norm`` and ``gated_rms_norm`` beside the hand-written flax
  compositions (``fn(x, other, scale)``);
- the copy and traffic baselines, and :data:`MOVES`, the least bytes each program moves;
- :func:`op_programs`: the isolated-op programs of one shape, with jax's Pallas-Triton
  RMSNorm, tokamax and our fused kernels where the platform has them;
- :func:`step_norms`: the norms of the pre-norm train step (``models.prenorm_stack_train_step``);
- :data:`GEMMA_NORMS`: the ``(1 + scale)`` norms of the Gemma-3-style step, each the way one
  library or model writes it;
- :data:`MAXTEXT_NORMS`: MaxText's ``x_hat * scale`` norm (two roundings) and ours on its
  parameter, for the MaxText-shaped step.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import rmsnorm_jax

EPS = 1e-6

# ---------------------------------------------------------------- the norms, (x, scale) -> y


def plain_formula(x, scale):
    """What a user writes by hand: float32 statistics, autodiff for the gradient."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS) * scale
    return y.astype(jnp.result_type(x, scale))


def _module(cls, **kw) -> Callable:
    module = cls(epsilon=EPS, **kw)

    def apply(x, scale):
        params = {"scale": scale}
        if cls is nn.LayerNorm:
            params["bias"] = jnp.zeros_like(scale)
        return module.apply({"params": params}, x)

    return apply


IMPLEMENTATIONS: dict[str, Callable] = {
    "rms_norm": lambda x, s: rmsnorm_jax.rms_norm(x, s, EPS),
    "rms_norm p=0.0625": lambda x, s: rmsnorm_jax.rms_norm(x, s, EPS, p=0.0625),
    "RMSNorm module": _module(rmsnorm_jax.RMSNorm),
    "flax RMSNorm": _module(nn.RMSNorm),
    "flax LayerNorm": _module(nn.LayerNorm),
    "jnp + autodiff": plain_formula,
}
NORM_PEERS = ("flax RMSNorm", "flax LayerNorm", "jnp + autodiff")


def _flax_rms_norm(x, scale):
    return nn.RMSNorm(epsilon=EPS).apply({"params": {"scale": scale}}, x)


# The fused LLM-layer ops beside what a user writes by hand with flax's norm. Each takes
# (x, other, scale): other is the residual stream or the gate.
FUSED: dict[str, Callable] = {
    "add_rms_norm": lambda x, r, s: rmsnorm_jax.add_rms_norm(x, r, s, EPS),
    "flax RMSNorm + add": lambda x, r, s: (_flax_rms_norm(x + r, s), x + r),
    "gated_rms_norm": lambda x, z, s: rmsnorm_jax.gated_rms_norm(x, z, s, EPS),
    "flax RMSNorm * silu": lambda x, z, s: _flax_rms_norm(x, s) * jax.nn.silu(z),
}
COMPOSITION = {"add_rms_norm": "flax RMSNorm + add", "gated_rms_norm": "flax RMSNorm * silu"}

HAS_IMPLEMENTATION = "implementation" in inspect.signature(rmsnorm_jax.rms_norm).parameters

# ---------------------------------------------------------------- baselines and programs


def copy_baseline(x, scale):
    del scale
    return x * 2


def traffic_baseline(x, scale, dy):
    del scale
    return x * 2, x * dy


def scale_only(x, scale):
    """Not a norm: only multiplies by the scale. The least any norm with a learnable scale
    can keep for its backward when a matmul follows it (x for the scale's gradient; the
    matmul keeps the output): the floor of the train-step memory tables."""
    return x * scale


STEP_FLOOR = "x * scale (floor)"

# Bytes each program must move at the least, in units of bytes(x) (FACTS.md's model). A
# forward+backward counts a separate forward and backward, as in a network; an isolated
# program that takes dy as an input may read x once for both (4 moves for the norm).
MOVES = {
    ("norm", "fwd"): 2,  # read x, write y
    ("norm", "fwd+bwd"): 5,  # and read x and dy, write dx
    ("add", "fwd"): 4,  # read x and the stream, write y and h
    ("add", "fwd+bwd"): 8,  # and read h and dy, write both input gradients
    ("gated", "fwd"): 3,  # read x and the gate, write y
    ("gated", "fwd+bwd"): 8,  # and read x, the gate and dy, write their gradients
}
# The baselines: the copy reads x and writes 2x; the traffic baseline's one fused kernel
# reads x and dy once and writes its two outputs.
BASELINE_MOVES = {"copy baseline": 2, "traffic baseline": 4}


def forward_backward(fn):
    """``(y, (dx, dscale))`` of ``fn`` for the cotangent ``dy``: one jitted program."""

    def run(x, scale, dy):
        y, vjp = jax.vjp(fn, x, scale)
        return y, vjp(dy)

    return run


def fused_forward_backward(fn):
    """Outputs and the gradients for (x, other, scale), cotangent ``dy`` for every output."""

    def run(x, other, scale, dy):
        out, vjp = jax.vjp(fn, x, other, scale)
        cts = jax.tree.map(lambda o: dy.astype(o.dtype), out)
        return out, vjp(cts)

    return run


def residual_bytes(fn, *args) -> int:
    """Bytes the backward pass of ``fn(*args)`` keeps alive (``jax.vjp``'s residuals), from
    shapes alone: nothing is computed or allocated."""
    residuals = jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *args)
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(residuals))


def random_inputs(rows: int, features: int, dtype):
    """``(x, other, scale, dy)`` of one benchmark shape: x, the residual stream or gate, and
    the cotangent standard normal, the scale near 1; the same seed for every program."""
    kx, ko, ks, kd = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (rows, features), jnp.float32).astype(dtype)
    other = jax.random.normal(ko, (rows, features), jnp.float32).astype(dtype)
    scale = (1 + 0.1 * jax.random.normal(ks, (features,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, (rows, features), jnp.float32).astype(dtype)
    return x, other, scale, dy


@dataclasses.dataclass
class OpProgram:
    """One implementation's programs in the ops section, or the reason it has none."""

    impl: str
    group: str  # "norm", "add" or "gated"
    role: str  # "ours", "peer" or "baseline"
    fwd: Callable | None  # (x, scale) or (x, other, scale)
    fwd_bwd: Callable | None  # (x, scale, dy) or (x, other, scale, dy)
    note: str = ""  # why there is no program (skipped or missing)
    status: str = "ok"


def _jax_pallas_rms_norm():
    from jax.experimental.pallas.ops.gpu import rms_norm as pallas_ops

    def fn(x, scale):
        # (batch, seq, features), weight and bias; num_warps, num_stages, eps positional
        # (its custom_vjp's non-differentiable arguments).
        x3 = x.reshape(1, *x.shape)
        bias = jnp.zeros_like(scale)
        return pallas_ops.rms_norm(x3, scale, bias, None, 3, EPS).reshape(x.shape)

    return fn


def _tokamax_rms_norm():
    import tokamax

    def fn(x, scale):
        return tokamax.layer_norm(x, scale, None, epsilon=EPS, subtract_mean=False)

    return fn


def _optional_peer(name: str, make: Callable, why_missing: str | None = None) -> OpProgram:
    try:
        fn = make()
    except ImportError as err:
        why = why_missing or f"{type(err).__name__}: {err}"
        return OpProgram(name, "norm", "peer", None, None, why, "missing")
    return OpProgram(name, "norm", "peer", fn, forward_backward(fn))


def op_programs(platform: str) -> list[OpProgram]:
    """Every program of one shape, with the rows that say why a program is absent."""
    progs = [
        OpProgram("copy baseline", "norm", "baseline", copy_baseline, None),
        OpProgram("traffic baseline", "norm", "baseline", None, traffic_baseline),
    ]
    for name, fn in IMPLEMENTATIONS.items():
        role = "peer" if name in NORM_PEERS else "ours"
        progs.append(OpProgram(name, "norm", role, fn, forward_backward(fn)))
    if platform == "gpu":
        progs.append(_optional_peer("jax Pallas rms_norm", _jax_pallas_rms_norm))
    else:
        why = "GPU only (Pallas-Triton)"
        progs.append(OpProgram("jax Pallas rms_norm", "norm", "peer", None, None, why, "skipped"))
    progs.append(
        _optional_peer(
            "tokamax layer_norm", _tokamax_rms_norm, "tokamax is not installed (optional peer)"
        )
    )
    for name, fn in FUSED.items():
        group = "add" if "add" in name else "gated"
        role = "ours" if name in COMPOSITION else "peer"
        progs.append(OpProgram(name, group, role, fn, fused_forward_backward(fn)))
    pallas = {
        "rms_norm [pallas]": (
            "norm",
            lambda x, s: rmsnorm_jax.rms_norm(x, s, EPS, implementation="pallas"),
        ),
        "add_rms_norm [pallas]": (
            "add",
            lambda x, r, s: rmsnorm_jax.add_rms_norm(x, r, s, EPS, implementation="pallas"),
        ),
    }
    for name, (group, fn) in pallas.items():
        if not HAS_IMPLEMENTATION:
            why = "rmsnorm_jax has no implementation= argument (no fused kernels)"
            progs.append(OpProgram(name, group, "ours", None, None, why, "missing"))
        elif platform == "cpu":
            why = "CPU runs the kernels in Pallas interpret mode: not a timing"
            progs.append(OpProgram(name, group, "ours", None, None, why, "skipped"))
        else:
            bwd = forward_backward(fn) if group == "norm" else fused_forward_backward(fn)
            progs.append(OpProgram(name, group, "ours", fn, bwd))
    return progs


def step_norms(platform: str) -> dict[str, dict]:
    """The norms of the pre-norm train step: ``{label: prenorm_stack_train_step kwargs}``.

    ``norm=None`` fuses every residual add into the next norm (``add_rms_norm``); the remat
    row checkpoints every layer keeping only each norm's float32 statistic per row.
    """
    stat_only = jax.checkpoint_policies.save_only_these_names("rms_norm_stat")
    norms = {
        "rms_norm": dict(norm=IMPLEMENTATIONS["rms_norm"]),
        "flax RMSNorm": dict(norm=IMPLEMENTATIONS["flax RMSNorm"]),
        "flax LayerNorm": dict(norm=IMPLEMENTATIONS["flax LayerNorm"]),
        "jnp + autodiff": dict(norm=IMPLEMENTATIONS["jnp + autodiff"]),
        "add_rms_norm": dict(norm=None),
        "rms_norm, remat saving rms_norm_stat": dict(
            norm=IMPLEMENTATIONS["rms_norm"], remat_policy=stat_only
        ),
        STEP_FLOOR: dict(norm=scale_only),
    }
    if HAS_IMPLEMENTATION and platform != "cpu":
        norms["rms_norm [pallas]"] = dict(
            norm=lambda x, s: rmsnorm_jax.rms_norm(x, s, EPS, implementation="pallas")
        )
    return norms


# ---------------------------------------------------------------- Gemma's (1 + scale) norms
# ``norm(x, scale) -> y`` in x's dtype, ``scale`` the stored zero-centred parameter: every
# one computes y = x / RMS(x) * (1 + scale).


def gemma_ours(x, scale):
    """``rmsnorm_jax.rms_norm`` with ``scale_offset=1.0``."""
    return rmsnorm_jax.rms_norm(x, scale, EPS, scale_offset=1.0, dtype=x.dtype)


def gemma_ours_pallas(x, scale):
    """:func:`gemma_ours` through the fused Pallas kernels."""
    return rmsnorm_jax.rms_norm(
        x, scale, EPS, scale_offset=1.0, dtype=x.dtype, implementation="pallas"
    )


def gemma_flax_linen(x, scale):
    """``flax.linen.RMSNorm`` on the parameter ``1 + scale``."""
    module = nn.RMSNorm(epsilon=EPS, dtype=x.dtype)
    return module.apply({"params": {"scale": 1 + scale}}, x)


def gemma_flax_nnx(x, scale):
    """``flax.nnx.RMSNorm`` on the parameter ``1 + scale``."""
    module = nnx.RMSNorm(
        x.shape[-1],
        epsilon=EPS,
        dtype=x.dtype,
        param_dtype=scale.dtype,
        scale_init=lambda key, shape, dtype: (1 + scale).astype(dtype),
        rngs=nnx.Rngs(0),
    )
    return module(x)


def gemma_plain_formula(x, scale):
    """What a user writes by hand: all in float32, autodiff for the gradient."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
    return (y * (1 + scale.astype(jnp.float32))).astype(x.dtype)


def gemma_formula(x, scale):
    """Gemma's own norm: normalise in float32, then ``(1 + scale)`` in x's dtype."""
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)).astype(x.dtype)
    return normed * (1 + scale.astype(x.dtype))


def gemma_scale_only(x, scale):
    """Not a norm: ``x * (1 + scale)`` in x's dtype. What any norm with a learnable scale
    keeps for its backward (``x``, for the scale's gradient) and nothing more: the floor of
    the memory tables."""
    return x * (1 + scale.astype(x.dtype))


GEMMA_FLOOR = "x * (1 + scale) (floor)"
GEMMA_REFERENCE = "gemma's own"

GEMMA_NORMS: dict[str, Callable] = {
    "rms_norm": gemma_ours,
    GEMMA_REFERENCE: gemma_formula,
    "flax nnx RMSNorm": gemma_flax_nnx,
    "jnp + autodiff": gemma_plain_formula,
    "flax linen RMSNorm": gemma_flax_linen,
}


def gemma_norms(platform: str | None = None) -> dict[str, Callable]:
    """Every norm the Gemma step can be measured with: the model's, the floor, and on an
    accelerator ``rms_norm [pallas]`` (``platform`` None: a deviceless compile, where a
    kernel carries no cost estimate)."""
    norms = {**GEMMA_NORMS, GEMMA_FLOOR: gemma_scale_only}
    if HAS_IMPLEMENTATION and platform not in (None, "cpu"):
        norms["rms_norm [pallas]"] = gemma_ours_pallas
    return norms


# ---------------------------------------------------------------- MaxText's x_hat * scale norms
# ``norm(x, scale) -> y`` in x's dtype, ``scale`` the stored float32 parameter (ones-
# initialised): every one computes y = x / RMS(x) * scale, with llama2's epsilon.

MAXTEXT_EPS = 1e-5
MAXTEXT_REFERENCE = "maxtext's own"


def maxtext_formula(x, scale, eps: float = MAXTEXT_EPS):
    """MaxText's ``RMSNorm.__call__`` (``maxtext/layers/normalizations.py``, 0.2.5) with
    ``scale_offset=0`` and ``dtype`` = x's dtype: normalise in float32 and round ``x_hat``
    to x's dtype, then multiply by the scale cast to x's dtype, in that dtype (two
    roundings); the multiply is MaxText's ``einsum``."""
    xf = x.astype(jnp.float32)
    mean2 = jnp.mean(jax.lax.square(xf), axis=-1, keepdims=True)
    y = (xf * jax.lax.rsqrt(mean2 + eps)).astype(x.dtype)
    return jnp.einsum("...k,k->...k", y, scale.astype(jnp.float32).astype(x.dtype))


def maxtext_ours(x, scale, eps: float = MAXTEXT_EPS):
    """``rmsnorm_jax.rms_norm`` on MaxText's parameter: float32 arithmetic, one rounding
    to x's dtype (what ``integrations.patch_maxtext()`` computes)."""
    return rmsnorm_jax.rms_norm(x, scale, eps, dtype=x.dtype)


MAXTEXT_NORMS: dict[str, Callable] = {
    "rms_norm": maxtext_ours,
    MAXTEXT_REFERENCE: maxtext_formula,
}
