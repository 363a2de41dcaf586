"""device_bench's isolated-op section: the programs of one shape and their ratios.

:func:`op_programs` lists every forward and forward+backward program (ours, the peers, the
copy and traffic baselines, with a row saying why a program is absent);
:func:`bench_op_shape` compiles and times one shape's programs in interleaved rounds and
:func:`add_op_ratios` adds the ratio to the best peer and the % of the bandwidth bound
(bytes moved, :data:`MOVES`, over the copy rate measured for that shape).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import jax.numpy as jnp
from device_timing import _error, compile_all, interleaved, uses_custom_kernel
from implementations import (
    EPS,
    FUSED,
    IMPLEMENTATIONS,
    copy_baseline,
    forward_backward,
    fused_forward_backward,
    random_inputs,
    traffic_baseline,
)

import rmsnorm_jax

SIZES_MIB = (32, 256)
FEATURES = (1024, 4096, 5120, 8192)
DTYPES = ("float32", "bfloat16")

# Bytes each program must move at the least, in units of bytes(x) (FACTS.md's model).
MOVES = {
    ("norm", "fwd"): 2,  # read x, write y
    ("norm", "fwd+bwd"): 5,  # and read x and dy, write dx
    ("add", "fwd"): 4,  # read x and the stream, write y and h
    ("add", "fwd+bwd"): 8,  # and read h and dy, write both input gradients
    ("gated", "fwd"): 3,  # read x and the gate, write y
    ("gated", "fwd+bwd"): 8,  # and read x, the gate and dy, write their gradients
}

HAS_IMPLEMENTATION = "implementation" in inspect.signature(rmsnorm_jax.rms_norm).parameters


@dataclasses.dataclass
class OpProgram:
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


def op_programs(platform: str) -> list[OpProgram]:
    """Every program of one shape, with the rows that say why a program is absent."""
    progs = [
        OpProgram("copy baseline", "norm", "baseline", copy_baseline, None),
        OpProgram("traffic baseline", "norm", "baseline", None, traffic_baseline),
    ]
    for name, fn in IMPLEMENTATIONS.items():
        role = "peer" if name in ("flax RMSNorm", "flax LayerNorm", "jnp + autodiff") else "ours"
        progs.append(OpProgram(name, "norm", role, fn, forward_backward(fn)))
    if platform == "gpu":
        try:
            fn = _jax_pallas_rms_norm()
            progs.append(OpProgram("jax Pallas rms_norm", "norm", "peer", fn, forward_backward(fn)))
        except ImportError as err:
            progs.append(
                OpProgram("jax Pallas rms_norm", "norm", "peer", None, None, _error(err), "missing")
            )
    else:
        progs.append(
            OpProgram(
                "jax Pallas rms_norm",
                "norm",
                "peer",
                None,
                None,
                "GPU only (Pallas-Triton)",
                "skipped",
            )
        )
    try:
        fn = _tokamax_rms_norm()
        progs.append(OpProgram("tokamax layer_norm", "norm", "peer", fn, forward_backward(fn)))
    except ImportError:
        progs.append(
            OpProgram(
                "tokamax layer_norm",
                "norm",
                "peer",
                None,
                None,
                "tokamax is not installed (optional peer)",
                "missing",
            )
        )
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
    for name, fn in FUSED.items():
        group = "add" if "add" in name else "gated"
        role = "ours" if name in ("add_rms_norm", "gated_rms_norm") else "peer"
        progs.append(OpProgram(name, group, role, fn, fused_forward_backward(fn)))
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


def bench_op_shape(mib: float, features: int, dtype: str, platform: str, timer, args) -> list[dict]:
    """All programs of one shape in interleaved rounds; one result row per program and kind."""
    itemsize = jnp.dtype(dtype).itemsize
    rows = max(8, int(mib * 2**20 / (itemsize * features)))
    x, other, scale, dy = random_inputs(rows, features, jnp.dtype(dtype))
    progs = op_programs(platform)
    programs, absent = {}, []
    for p in progs:
        for kind, fn in (("fwd", p.fwd), ("fwd+bwd", p.fwd_bwd)):
            if p.status != "ok":
                absent.append((p, kind))
            elif fn is not None:
                if p.group == "norm":
                    inputs = (x, scale) if kind == "fwd" else (x, scale, dy)
                else:
                    inputs = (x, other, scale) if kind == "fwd" else (x, other, scale, dy)
                programs[(p.impl, kind)] = (fn, inputs)
    compiled = compile_all(programs, args.compile_workers)
    runnable = {k: v for k, v in compiled.items() if not isinstance(v, str)}
    timings = interleaved(runnable, timer, args.rounds)
    by_impl = {p.impl: p for p in progs}
    results = []

    def row_of(p, kind, **fields):
        return dict(
            section="ops",
            impl=p.impl,
            kind=kind,
            group=p.group,
            role=p.role,
            size_mib=mib,
            features=features,
            rows=rows,
            dtype=dtype,
            x_bytes=x.nbytes,
            **fields,
        )

    for key in programs:
        impl, kind = key
        row = row_of(by_impl[impl], kind, method=timer.method)
        if isinstance(compiled[key], str):
            row.update(status="failed", note=f"compile: {compiled[key]}")
        else:
            row["status"] = "ok"
            row.update(timings[key])
            if impl in ("rms_norm", "add_rms_norm", "rms_norm [pallas]", "add_rms_norm [pallas]"):
                row["uses_kernel"] = uses_custom_kernel(compiled[key][0])
        results.append(row)
    for p, kind in absent:
        results.append(row_of(p, kind, status=p.status, note=p.note))
    add_op_ratios(results)
    return results


def add_op_ratios(results: list[dict]) -> None:
    """Ratio to the best peer and % of the bound at the copy rate, for one shape's rows."""
    ok = [r for r in results if r.get("status") == "ok"]
    copy = next((r for r in ok if r["impl"] == "copy baseline"), None)
    traffic = next((r for r in ok if r["impl"] == "traffic baseline"), None)
    for r in results:
        r.update(vs_best_peer=None, best_peer=None, pct_of_bound=None, vs_baseline=None)
        if r.get("status") != "ok":
            continue
        moves = 2 if r["impl"] == "copy baseline" else MOVES.get((r["group"], r["kind"]))
        if r["impl"] == "traffic baseline":
            moves = MOVES[("norm", "fwd+bwd")]
        r["moves"] = moves
        if copy is not None:
            r["copy_gbs"] = 2 * r["x_bytes"] / copy["median_s"] / 1e9
            r["pct_of_bound"] = 100 * moves * copy["median_s"] / (2 * r["median_s"])
        base = copy if r["kind"] == "fwd" else traffic
        if base is not None:
            r["vs_baseline"] = r["median_s"] / base["median_s"]
        if r["role"] == "baseline":
            continue
        peers = [q for q in ok if q["role"] == "peer" and _same_program(q, r)]
        if peers:
            best = min(peers, key=lambda q: q["median_s"])
            r["best_peer"] = best["impl"]
            r["vs_best_peer"] = r["median_s"] / best["median_s"]


def _same_program(a: dict, b: dict) -> bool:
    return a["group"] == b["group"] and a["kind"] == b["kind"]
