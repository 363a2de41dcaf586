"""What is compared: our norms, their peers and the baselines, as the programs every section
shares (a device time, a CPU time and an estimate of one name are of the same program)."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import rmsnorm_jax

EPS = 1e-6


def plain_formula(x, scale):
    """What a user writes by hand: float32 statistics, autodiff for the gradient."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS) * scale
    return y.astype(jnp.result_type(x, scale))


def _module(cls) -> Callable:
    bias = (lambda s: {"bias": jnp.zeros_like(s)}) if cls is nn.LayerNorm else (lambda s: {})
    return lambda x, s: cls(epsilon=EPS).apply({"params": {"scale": s, **bias(s)}}, x)


IMPLEMENTATIONS: dict[str, Callable] = {  # norm(x, scale) -> y
    "rms_norm": lambda x, s: rmsnorm_jax.rms_norm(x, s, EPS),
    "rms_norm p=0.0625": lambda x, s: rmsnorm_jax.rms_norm(x, s, EPS, p=0.0625),
    "RMSNorm module": _module(rmsnorm_jax.RMSNorm),
    "flax RMSNorm": _module(nn.RMSNorm),
    "flax LayerNorm": _module(nn.LayerNorm),
    "jnp + autodiff": plain_formula,
}
NORM_PEERS = ("flax RMSNorm", "flax LayerNorm", "jnp + autodiff")
_flax = IMPLEMENTATIONS["flax RMSNorm"]
FUSED: dict[str, Callable] = {  # fn(x, other, scale), other the residual stream or the gate
    "add_rms_norm": lambda x, r, s: rmsnorm_jax.add_rms_norm(x, r, s, EPS),
    "flax RMSNorm + add": lambda x, r, s: (_flax(x + r, s), x + r),
    "gated_rms_norm": lambda x, z, s: rmsnorm_jax.gated_rms_norm(x, z, s, EPS),
    "flax RMSNorm * silu": lambda x, z, s: _flax(x, s) * jax.nn.silu(z),
}
COMPOSITION = {"add_rms_norm": "flax RMSNorm + add", "gated_rms_norm": "flax RMSNorm * silu"}
# ``rms_norm(..., implementation=...)`` besides "auto": XLA, and the kernels of the device's own
# backend (Mosaic GPU or Triton on a GPU, Mosaic TPU on a TPU; ops' rows name which ran).
PATHS = ("xla", "pallas")


def path(op: str, implementation: str) -> Callable:
    """``rms_norm`` (``(x, s)``) or ``add_rms_norm`` (``(x, r, s)``) on one path."""
    if op == "rms_norm":
        return lambda x, s: rmsnorm_jax.rms_norm(x, s, EPS, implementation=implementation)
    return lambda x, r, s: rmsnorm_jax.add_rms_norm(x, r, s, EPS, implementation=implementation)


def copy_baseline(x, scale):
    """A copy of x's bytes that XLA cannot elide, as 32-bit words where x's size allows
    (the lowest bit of each flipped): the device's copy rate whatever x's dtype, where a
    16-bit dtype's own arithmetic can run below it (benchmarks/README.md)."""
    per_word = 4 // x.dtype.itemsize
    if x.dtype.itemsize > 4 or x.size % per_word:
        return x * 2
    words = x.reshape(-1, per_word) if per_word > 1 else x.reshape(-1)
    return jax.lax.bitcast_convert_type(words, jnp.uint32) ^ jnp.uint32(1)


def traffic_baseline(x, scale, dy):
    """One fused kernel that reads x and dy once and writes two outputs: 4 moves."""
    return x * 2, x * dy


def scale_only(x, scale):
    """Not a norm: what any norm with a learnable scale before a matmul keeps for its
    backward (x, for the scale's gradient): the floor of the train-step memory tables."""
    return x * scale


STEP_FLOOR = "x * scale (floor)"
# The least bytes a program moves, in bytes(x); a forward+backward counts a separate
# forward and backward, as in a network.
MOVES = {
    ("norm", "fwd"): 2,  # read x, write y
    ("norm", "fwd+bwd"): 5,  # and read x and dy, write dx
    ("add", "fwd"): 4,  # read x and the stream, write y and h
    ("add", "fwd+bwd"): 8,  # and read h and dy, write both input gradients
    ("gated", "fwd"): 3,  # read x and the gate, write y
    ("gated", "fwd+bwd"): 8,  # and read x, the gate and dy, write their gradients
}
BASELINE_MOVES = {"copy baseline": 2, "traffic baseline": 4}


def forward_backward(fn):
    """``(outputs, gradients)`` of ``fn(x, scale)`` or ``fn(x, other, scale)``, the last
    argument ``dy`` the cotangent of every output: one program."""

    def run(*args):
        *args, dy = args
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(jax.tree.map(lambda o: dy.astype(o.dtype), out))

    return run


def residual_bytes(fn, *args) -> int:
    """Bytes the backward of ``fn(*args)`` keeps (``jax.vjp``'s residuals), from shapes."""
    residuals = jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *args)
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(residuals))


def random_inputs(rows: int, features: int, dtype):
    """``(x, other, scale, dy)``: standard normal, the scale near 1, one seed for all."""
    kx, ko, ks, kd = jax.random.split(jax.random.key(0), 4)
    x, other, dy = (jax.random.normal(k, (rows, features)).astype(dtype) for k in (kx, ko, kd))
    return x, other, (1 + 0.1 * jax.random.normal(ks, (features,))).astype(dtype), dy


@dataclasses.dataclass
class OpProgram:
    """One implementation's programs in ``ops``, or why it has none (``status``, ``note``)."""

    impl: str
    group: str  # "norm", "add" or "gated"
    role: str  # "ours", "peer" or "baseline"
    fwd: Callable | None  # (x, scale) or (x, other, scale)
    fwd_bwd: Callable | None  # (x, scale, dy) or (x, other, scale, dy)
    note: str = ""
    status: str = "ok"


def _tokamax(implementation: str, platform: str) -> tuple:
    """``(tokamax's norm on one of its paths, "ok", "")``, or ``(None, status, why)``."""
    if importlib.util.find_spec("tokamax") is None:
        return (
            None,
            "missing",
            "tokamax is not installed (optional peer: Python >= 3.12, jax >= 0.11.1)",
        )
    if implementation == "triton" and platform != "gpu":
        return None, "skipped", "GPU only (Triton through jax_triton)"
    try:
        import tokamax
        from tokamax._src.ops.normalization import api

        if implementation not in api.IMPLEMENTATIONS:  # tokamax left it out: why
            from tokamax._src.ops.normalization import triton  # noqa: F401
    except Exception as err:
        return (
            None,
            "missing",
            f"tokamax has no {implementation} path here: {type(err).__name__}: {err}",
        )
    kw = dict(epsilon=EPS, subtract_mean=False, implementation=implementation)
    return (lambda x, s: tokamax.layer_norm(x, s, None, **kw)), "ok", ""


def chosen(every: dict, names: str | None, keep=()) -> dict:
    """``--norms``: the entries of ``every`` named (comma separated; all where None), and
    those of ``keep`` (a table's reference) besides."""
    if names is None:
        return every
    wanted = [*names.split(","), *(k for k in keep if k not in names.split(","))]
    if unknown := [n for n in wanted if n not in every]:
        raise SystemExit(f"--norms: unknown {unknown}; choose from {list(every)}")
    return {n: every[n] for n in wanted}


def op_programs(platform: str) -> list[OpProgram]:
    """Every program of one shape of ``ops``, and a row saying why for each one absent."""
    progs = [
        OpProgram("copy baseline", "norm", "baseline", copy_baseline, None),
        OpProgram("traffic baseline", "norm", "baseline", None, traffic_baseline),
    ]

    def add(name, group, role, fn, status="ok", note=""):
        bwd = fn and forward_backward(fn)
        progs.append(OpProgram(name, group, role, fn, bwd, note, status))

    for name, fn in IMPLEMENTATIONS.items():
        add(name, "norm", "peer" if name in NORM_PEERS else "ours", fn)
    for p in ("triton", "xla"):
        add(f"tokamax layer_norm [{p}]", "norm", "peer", *_tokamax(p, platform))
    for name, fn in FUSED.items():
        add(name, "add" if "add" in name else "gated", "peer" if "flax" in name else "ours", fn)
    cpu = (None, "skipped", "CPU runs the kernels in Pallas interpret mode: not a timing")
    skip = platform == "cpu"
    # On a GPU, the Triton kernels beside the ones "pallas" takes (Mosaic GPU on Hopper).
    paths = PATHS + ("triton",) * (platform == "gpu")
    for op, group in (("rms_norm", "norm"), ("add_rms_norm", "add")):
        for p in paths:
            add(f"{op} [{p}]", group, "ours", *(cpu if skip and p != "xla" else [path(op, p)]))
    return progs


def step_norms(platform: str, smoke: bool = False) -> dict[str, dict]:
    """The pre-norm step's norms, ``{label: prenorm_stack_train_step kwargs}``: ``norm=None``
    fuses each residual add into the next norm; the remat row keeps only the statistics.
    Ours on each path (``rms_norm`` and the fused ``add_rms_norm``) on a device, and in a
    CPU's smoke run (``--quick``: there the kernels run interpreted, as the GPU visit's dry
    run needs them)."""
    stat_only = jax.checkpoint_policies.save_only_these_names("rms_norm_stat")
    norms = {n: dict(norm=IMPLEMENTATIONS[n]) for n in ("rms_norm", *NORM_PEERS)}
    norms["add_rms_norm"] = dict(norm=None)
    norms["rms_norm, remat saving rms_norm_stat"] = dict(norm=norms["rms_norm"]["norm"])
    norms["rms_norm, remat saving rms_norm_stat"]["remat_policy"] = stat_only
    norms[STEP_FLOOR] = dict(norm=scale_only)
    if platform != "cpu" or smoke:  # a CPU's full run: "auto" is XLA, kernels interpreted
        norms |= {f"rms_norm [{p}]": dict(norm=path("rms_norm", p)) for p in PATHS}
        norms |= {f"add_rms_norm [{p}]": dict(norm=None, implementation=p) for p in PATHS}
    return norms


# ---------------------------------------------------------------- Gemma's (1 + scale) norms
# norm(x, scale) -> y in x's dtype, scale the stored zero-centred parameter.


def gemma_ours(x, scale, implementation="auto"):
    kw = dict(scale_offset=1.0, dtype=x.dtype, implementation=implementation)
    return rmsnorm_jax.rms_norm(x, scale, EPS, **kw)


def gemma_flax_linen(x, scale):
    return nn.RMSNorm(epsilon=EPS, dtype=x.dtype).apply({"params": {"scale": 1 + scale}}, x)


def gemma_flax_nnx(x, scale):
    init = lambda key, shape, dtype: (1 + scale).astype(dtype)
    kw = dict(dtype=x.dtype, param_dtype=scale.dtype, scale_init=init, rngs=nnx.Rngs(0))
    return nnx.RMSNorm(x.shape[-1], epsilon=EPS, **kw)(x)


def gemma_plain_formula(x, scale):
    """All in float32, autodiff for the gradient."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
    return (y * (1 + scale.astype(jnp.float32))).astype(x.dtype)


def gemma_formula(x, scale):
    """Gemma's own norm: normalise in float32, then ``(1 + scale)`` in x's dtype."""
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)).astype(x.dtype)
    return normed * (1 + scale.astype(x.dtype))


def gemma_scale_only(x, scale):
    """Not a norm: ``x * (1 + scale)``, the floor of the memory tables."""
    return x * (1 + scale.astype(x.dtype))


GEMMA_FLOOR, GEMMA_REFERENCE = "x * (1 + scale) (floor)", "gemma's own"
GEMMA_NORMS: dict[str, Callable] = {
    "rms_norm": gemma_ours,
    GEMMA_REFERENCE: gemma_formula,
    "flax nnx RMSNorm": gemma_flax_nnx,
    "jnp + autodiff": gemma_plain_formula,
    "flax linen RMSNorm": gemma_flax_linen,
}


def _gemma_path(implementation: str) -> Callable:
    return lambda x, scale: gemma_ours(x, scale, implementation)


def gemma_norms(platform: str | None = None) -> dict[str, Callable]:
    """The model's norms, the floor, and on a device ours on each path, ``rms_norm [xla]``
    and ``rms_norm [pallas]`` (``None``: a deviceless compile, where a kernel has no cost
    estimate; a CPU runs the kernels interpreted, in its smoke run of the small model)."""
    norms = {**GEMMA_NORMS, GEMMA_FLOOR: gemma_scale_only}
    if platform is not None:
        norms |= {f"rms_norm [{p}]": _gemma_path(p) for p in PATHS}
    return norms


# ---------------------------------------------------------------- MaxText's x_hat * scale norms

MAXTEXT_EPS, MAXTEXT_REFERENCE = 1e-5, "maxtext's own"


def maxtext_formula(x, scale, eps: float = MAXTEXT_EPS):
    """MaxText's ``RMSNorm`` (0.2.5, ``scale_offset=0``, ``dtype`` x's): normalise in float32,
    round ``x_hat`` to x's dtype, times the scale in that dtype (two roundings)."""
    xf = x.astype(jnp.float32)
    mean2 = jnp.mean(jax.lax.square(xf), axis=-1, keepdims=True)
    y = (xf * jax.lax.rsqrt(mean2 + eps)).astype(x.dtype)
    return jnp.einsum("...k,k->...k", y, scale.astype(jnp.float32).astype(x.dtype))


def maxtext_ours(x, scale, eps: float = MAXTEXT_EPS):
    """Ours on MaxText's parameter: one rounding (what ``patch_maxtext()`` computes)."""
    return rmsnorm_jax.rms_norm(x, scale, eps, dtype=x.dtype)


MAXTEXT_NORMS: dict[str, Callable] = {"rms_norm": maxtext_ours, MAXTEXT_REFERENCE: maxtext_formula}
