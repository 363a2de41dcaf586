"""The TPU and GPU compilers' own estimates for every implementation (no device needed).

Used by ``bench.py --target tpu-v5e|tpu-v6e|h100|...``. For each shape and dtype, each
implementation of ``implementations.py`` is compiled for the target, forward and
forward+backward, beside a copy (``x * 2``) and a traffic baseline (``x * 2, x * dy``)
compiled the same way. Reported per program: the compiler's estimate (TPU: cycles;
GPU: microseconds), the number of kernels, the ratio to the baseline and, on GPU, the
fraction of the bandwidth bound (forward 2, forward+backward 5 bytes moved per byte of
x, over the device's HBM bandwidth). Then the temporary memory of a train step (an
8-layer bfloat16 stack of pre-norm blocks with two norms each, d = 2048, 16k tokens;
relu, gelu and SwiGLU MLPs) with each norm, and with ``x * scale``: the floor, what any
norm with a learnable scale followed by a matmul must keep.

These are estimates from the compilers' cost models of deviceless compiles, not
hardware timings: nothing runs and nothing is autotuned.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from implementations import (
    FUSED,
    IMPLEMENTATIONS,
    MLPS,
    copy_baseline,
    forward_backward,
    fused_forward_backward,
    prenorm_stack_train_step,
    scale_only,
    traffic_baseline,
)
from jax.sharding import PartitionSpec as P

from rmsnorm_jax import aot

MEMORY_FLOOR = "x * scale (floor)"
MEMORY_NORMS = (
    "rms_norm",
    "add_rms_norm",
    "flax RMSNorm",
    "flax LayerNorm",
    "jnp + autodiff",
    MEMORY_FLOOR,
)


def _one_device(target: aot.Target):
    return jax.sharding.Mesh(target.devices[:1], ("d",))


def _compiled_estimate(target, fn, *args) -> tuple[float, int]:
    compiled = target.compile(jax.jit(fn), *args)
    kernels = aot.kernels(compiled, target)
    return sum(k.estimate for k in kernels), len(kernels)


def estimate_shape(target: aot.Target, rows: int, features: int, dtype) -> list[dict]:
    """One dict per implementation (and the baseline) for x of ``rows x features``."""
    mesh = _one_device(target)
    x = aot.struct((rows, features), dtype, mesh, P())
    scale = aot.struct((features,), dtype, mesh, P())
    xbytes = rows * features * jnp.dtype(dtype).itemsize
    programs = {"baseline": (copy_baseline, traffic_baseline)}
    programs.update({name: (fn, forward_backward(fn)) for name, fn in IMPLEMENTATIONS.items()})
    results = []
    for name, (fwd, fwd_bwd) in programs.items():
        fwd_est, fwd_kernels = _compiled_estimate(target, fwd, x, scale)
        fb_est, fb_kernels = _compiled_estimate(target, fwd_bwd, x, scale, x)
        results.append(
            dict(
                impl=name,
                rows=rows,
                features=features,
                dtype=jnp.dtype(dtype).name,
                fwd=fwd_est,
                fwd_kernels=fwd_kernels,
                fwd_bwd=fb_est,
                fwd_bwd_kernels=fb_kernels,
            )
        )
    copy, traffic = results[0]["fwd"], results[0]["fwd_bwd"]
    flax = next(r for r in results if r["impl"] == "flax RMSNorm")
    for r in results:
        r["fwd_vs_baseline"] = r["fwd"] / copy
        r["fwd_bwd_vs_baseline"] = r["fwd_bwd"] / traffic
        r["fwd_bwd_speedup_vs_flax"] = flax["fwd_bwd"] / r["fwd_bwd"]
        if target.estimate_unit == "us":
            bound_us = xbytes / target.hbm_bytes_per_s * 1e6
            r["fwd_of_bound"] = 2 * bound_us / r["fwd"]
            r["fwd_bwd_of_bound"] = 5 * bound_us / r["fwd_bwd"]
    return results


def estimate_fused(target: aot.Target, rows: int, features: int, dtype) -> dict[str, float]:
    """The compiler's forward+backward estimate of each fused op and its composition."""
    mesh = _one_device(target)
    x = aot.struct((rows, features), dtype, mesh, P())
    scale = aot.struct((features,), dtype, mesh, P())
    return {
        name: _compiled_estimate(target, fused_forward_backward(fn), x, x, scale, x)[0]
        for name, fn in FUSED.items()
    }


def _compile_train_step(target: aot.Target, norm, d: int, tokens: int, dtype, **model):
    """One SGD step of :func:`prenorm_stack_train_step` (``model``: its options),
    compiled for one device of ``target``."""
    mesh = _one_device(target)
    step, shapes = prenorm_stack_train_step(norm, **model)
    params = jax.tree.map(
        lambda s: aot.struct(s.shape, s.dtype, mesh, P()), shapes(d, jnp.dtype(dtype))
    )
    h = aot.struct((tokens, d), jnp.dtype(dtype), mesh, P())
    return target.compile(jax.jit(step, donate_argnums=0), params, h)


def _train_step_temp_bytes(target: aot.Target, norm, mlp: str, d: int, tokens: int):
    """``(temp bytes per device, fits)`` of one bfloat16 SGD step of the stack."""
    try:
        compiled = _compile_train_step(target, norm, d, tokens, jnp.bfloat16, mlp=mlp)
        return compiled.memory_analysis().temp_size_in_bytes, True
    except jax.errors.JaxRuntimeError as err:
        # The TPU compiler refuses a program that exceeds the chip's HBM and says how
        # much its temporaries need.
        need = re.search(r"HLO temporaries \(([\d.]+)G\)", str(err))
        if need is None:
            raise
        return float(need.group(1)) * 2**30, False


def train_step_memory(
    target: aot.Target,
    norm_names=MEMORY_NORMS,
    d: int = 2048,
    tokens: int = 16384,
    mlps=MLPS,
) -> list[dict]:
    """Temporary bytes per device of one SGD step of the block stack, per MLP and norm.

    One dict per (mlp, norm), with ``vs_flax`` (against ``flax RMSNorm`` with the same
    MLP) and ``vs_floor`` (against ``scale_only``, the least a scaled norm can keep).
    """
    norms = {**IMPLEMENTATIONS, "add_rms_norm": None, MEMORY_FLOOR: scale_only}
    out = []
    for mlp in mlps:
        rows = []
        for name in norm_names:
            temp, fits = _train_step_temp_bytes(target, norms[name], mlp, d, tokens)
            rows.append(dict(mlp=mlp, norm=name, temp_bytes=temp, fits=fits))
        flax = next(r["temp_bytes"] for r in rows if r["norm"] == "flax RMSNorm")
        floor = next((r["temp_bytes"] for r in rows if r["norm"] == MEMORY_FLOOR), None)
        for r in rows:
            r["vs_flax"] = r["temp_bytes"] / flax
            r["vs_floor"] = None if floor is None else r["temp_bytes"] / floor
        out.extend(rows)
    return out


COST_NORMS = ("rms_norm", "flax RMSNorm", "flax LayerNorm", "jnp + autodiff")


def train_step_cost(
    target: aot.Target,
    norm_names=COST_NORMS,
    d: int = 1024,
    tokens: int = 8192,
    dtypes=("float32", "bfloat16"),
    layers: int = 2,
) -> list[dict]:
    """The compiler's estimate of one whole SGD step of the block stack, per norm.

    The isolated forward+backward programs of :func:`estimate_shape` take the
    cotangent ``dy`` as an input, so XLA may compute ``y`` inside the backward's
    reduction kernel; in a network ``dy`` depends on ``y`` and it cannot. This is the
    same comparison where ``y`` feeds a matmul and ``dy`` comes back through it: the
    SwiGLU stack of :func:`prenorm_stack_train_step` with its scan unrolled (a loop
    body would be counted once), parameters and activations in ``dtype``.
    """
    out = []
    for dtype in dtypes:
        rows = []
        for name in norm_names:
            compiled = _compile_train_step(
                target,
                IMPLEMENTATIONS[name],
                d,
                tokens,
                dtype,
                layers=layers,
                mlp="swiglu",
                unroll=True,
            )
            rows.append(dict(dtype=dtype, norm=name, step=aot.estimate(compiled, target)))
        ours = rows[0]["step"]
        for r in rows:
            r["vs_ours"] = r["step"] / ours
            r["minus_ours"] = r["step"] - ours
        out.extend(rows)
    return out


def _pivot_markdown(records: list[dict], column: str, head, cell) -> str:
    """A table with one row per norm and, per value of ``records[i][column]``, the two
    cells ``cell(record)`` (``"a | b"``) under the headings ``head(value)``."""
    columns = list(dict.fromkeys(r[column] for r in records))
    norms = list(dict.fromkeys(r["norm"] for r in records))
    by_key = {(r[column], r["norm"]): r for r in records}
    lines = [
        "| norm | " + " | ".join(head(c) for c in columns) + " |",
        "|---|" + "---:|---:|" * len(columns),
    ]
    for norm in norms:
        cells = " | ".join(cell(by_key[(c, norm)]) for c in columns)
        lines.append(f"| {norm} | {cells} |")
    return "\n".join(lines)


def cost_markdown(target: aot.Target, cost: list[dict]) -> str:
    """One row per norm, one column pair per dtype: the step estimate and its excess."""
    return _pivot_markdown(
        cost,
        "dtype",
        lambda dt: f"{dt} step ({target.estimate_unit}) | minus rms_norm's",
        lambda r: f"{r['step']:,.0f} | {r['minus_ours']:+,.0f}",
    )


def estimates_markdown(target: aot.Target, results: list[dict]) -> str:
    """One row per shape, dtype and implementation."""
    unit = target.estimate_unit
    gpu = unit == "us"
    head = (
        f"| features | dtype | implementation | fwd ({unit}) | kernels | fwd / copy "
        + ("| fwd of bound " if gpu else "")
        + f"| fwd+bwd ({unit}) | kernels | fwd+bwd / traffic "
        + ("| fwd+bwd of bound " if gpu else "")
        + "| fwd+bwd speed-up vs flax |"
    )
    lines = [head, _separator(head)]
    for r in results:
        cells = [
            str(r["features"]),
            r["dtype"],
            r["impl"],
            f"{r['fwd']:,.1f}" if gpu else f"{r['fwd']:,.0f}",
            str(r["fwd_kernels"]),
            f"{r['fwd_vs_baseline']:.2f}",
        ]
        if gpu:
            cells.append(f"{r['fwd_of_bound']:.0%}")
        cells += [
            f"{r['fwd_bwd']:,.1f}" if gpu else f"{r['fwd_bwd']:,.0f}",
            str(r["fwd_bwd_kernels"]),
            f"{r['fwd_bwd_vs_baseline']:.2f}",
        ]
        if gpu:
            cells.append(f"{r['fwd_bwd_of_bound']:.0%}")
        cells.append(f"{r['fwd_bwd_speedup_vs_flax']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _separator(head: str) -> str:
    columns = head.count("|") - 1
    return "|" + "|".join(["---:"] * 2 + ["---"] + ["---:"] * (columns - 3)) + "|"


def summary_markdown(target: aot.Target, results: list[dict]) -> str:
    """One line per shape and dtype: rms_norm (p = 1) against the baselines and peers."""
    gpu = target.estimate_unit == "us"
    lines = [
        "| features | dtype | fwd / copy | fwd+bwd / traffic "
        + ("| fwd, fwd+bwd of bound " if gpu else "")
        + "| fwd+bwd vs best peer | fwd+bwd speed-up vs flax (p=1, p=0.0625, module) |",
    ]
    lines.append(_summary_separator(lines[0]))
    peers = ("flax RMSNorm", "flax LayerNorm", "jnp + autodiff")
    for f, dtype in dict.fromkeys((r["features"], r["dtype"]) for r in results):
        row = {r["impl"]: r for r in results if r["features"] == f and r["dtype"] == dtype}
        ours = row["rms_norm"]
        best_peer = min(row[p]["fwd_bwd"] for p in peers)
        cells = [
            str(f),
            dtype,
            f"{ours['fwd_vs_baseline']:.2f}",
            f"{ours['fwd_bwd_vs_baseline']:.2f}",
        ]
        if gpu:
            cells.append(f"{ours['fwd_of_bound']:.0%}, {ours['fwd_bwd_of_bound']:.0%}")
        cells.append(f"{ours['fwd_bwd'] / best_peer:.2f}")
        cells.append(
            ", ".join(
                f"{row[k]['fwd_bwd_speedup_vs_flax']:.2f}x"
                for k in ("rms_norm", "rms_norm p=0.0625", "RMSNorm module")
            )
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _summary_separator(head: str) -> str:
    columns = head.count("|") - 1
    return "|" + "|".join(["---:", "---"] + ["---:"] * (columns - 2)) + "|"


def memory_markdown(memory: list[dict]) -> str:
    """One row per norm, one column per MLP: MiB per device and the ratio to flax's."""

    def cell(r):
        note = "" if r["fits"] else " (does not fit)"
        return f"{r['temp_bytes'] / 2**20:,.0f}{note} | {r['vs_flax']:.2f}"

    return _pivot_markdown(memory, "mlp", lambda m: f"{m} MLP: MiB | vs flax", cell)
