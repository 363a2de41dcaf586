"""RMSNorm forward and forward+backward speed, and backward-pass memory, side by side.

    python benchmarks/bench.py            # full table (x of 32 MiB per shape)
    python benchmarks/bench.py --quick    # smoke run, small shapes, 3 repeats (written to a
                                          # temporary directory unless --out is given)

For each shape and dtype it times, in one process (ratios within one run are what
count on a shared machine): ``rms_norm`` (p = 1 and p = 0.0625), the ``RMSNorm``
Module, ``flax.linen.RMSNorm``, ``flax.linen.LayerNorm`` and the plain jnp formula
under autodiff; plus two baselines that allocate their outputs the same way: a
jitted ``x * 2`` (the forward's traffic: read x, write y) and ``(x * 2, x * dy)``
(forward+backward traffic: read x, write y, read x and dy, write dx).

Reported: median time of N interleaved rounds after warm-up, effective GB/s by the byte model of
``../shared/FACTS.md`` (forward 2 bytes-per-element moves, forward+backward 5), the
ratio to the baseline, the speed-up over ``flax.linen.RMSNorm``, and the bytes the
backward pass keeps alive (``jax.vjp`` residuals) as a multiple of bytes(x). Writes
``results.json``, ``results.md`` and ``results.png`` into ``--out`` (default
``benchmarks/results/``; a ``--quick`` run writes to a new temporary directory instead, so
that it never overwrites the committed results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if "--target" in sys.argv:
    # Deviceless compiles for TPU/GPU need the CPU runtime alone (rmsnorm_jax.aot), set
    # before jax is imported.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from implementations import (
    FUSED,
    IMPLEMENTATIONS,
    copy_baseline,
    forward_backward,
    fused_forward_backward,
    fused_residual_bytes,
    random_inputs,
    traffic_baseline,
)

FEATURES = (256, 1024, 4096, 5120, 8192)
RESULTS_DIR = Path(__file__).parent / "results"


def output_dir(out: str | None, quick: bool, prefix: str = "bench") -> Path:
    """Where a run writes: ``out`` if given; for a ``--quick`` run a new temporary
    directory (a smoke run never overwrites the committed results); else ``results/``."""
    if out is not None:
        return Path(out)
    if quick:
        return Path(tempfile.mkdtemp(prefix=f"{prefix}-quick-"))
    return RESULTS_DIR


def time_rounds(
    calls: dict[str, tuple[Callable, tuple]], repeats: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Wall times in seconds of each call, one per round, after ``warmup`` calls of each.

    The calls are interleaved, one of each per round, so that every implementation and
    its baseline see the same machine state (load from other processes, allocator and
    cache state) and the ratios within a round are fair on a shared, noisy machine.
    """
    for fn, args in calls.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return times


def time_calls(calls: dict[str, tuple[Callable, tuple]], repeats: int) -> dict[str, float]:
    """Median wall time in seconds of each call over interleaved rounds (``time_rounds``)."""
    return {name: statistics.median(t) for name, t in time_rounds(calls, repeats).items()}


def residual_bytes(fn, x, scale) -> int:
    _, vjp = jax.vjp(fn, x, scale)
    return sum(leaf.nbytes for leaf in jax.tree.leaves(vjp))


def bench_shape(rows: int, features: int, dtype, repeats: int) -> list[dict]:
    kx, ks, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (rows, features), jnp.float32).astype(dtype)
    scale = (1 + 0.1 * jax.random.normal(ks, (features,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, (rows, features), jnp.float32).astype(dtype)
    xbytes = x.nbytes
    fwd_calls = {"baseline": (jax.jit(copy_baseline), (x, scale))}
    fwd_bwd_calls = {"baseline": (jax.jit(traffic_baseline), (x, scale, dy))}
    for name, fn in IMPLEMENTATIONS.items():
        fwd_calls[name] = (jax.jit(fn), (x, scale))
        fwd_bwd_calls[name] = (jax.jit(forward_backward(fn)), (x, scale, dy))
    fwd_t = time_calls(fwd_calls, repeats)
    fwd_bwd_t = time_calls(fwd_bwd_calls, repeats)
    results = [
        dict(
            impl=name,
            fwd_s=fwd_t[name],
            fwd_bwd_s=fwd_bwd_t[name],
            residual_x=None
            if name == "baseline"
            else residual_bytes(IMPLEMENTATIONS[name], x, scale) / xbytes,
        )
        for name in fwd_calls
    ]
    copy_t, traffic_t = fwd_t["baseline"], fwd_bwd_t["baseline"]
    flax_fb = next(r["fwd_bwd_s"] for r in results if r["impl"] == "flax RMSNorm")
    for r in results:
        r.update(
            rows=rows,
            features=features,
            dtype=jnp.dtype(dtype).name,
            x_mib=xbytes / 2**20,
            fwd_gbs=2 * xbytes / r["fwd_s"] / 1e9,
            fwd_bwd_gbs=5 * xbytes / r["fwd_bwd_s"] / 1e9,
            fwd_vs_baseline=r["fwd_s"] / copy_t,
            fwd_bwd_vs_baseline=r["fwd_bwd_s"] / traffic_t,
            speedup_vs_flax=flax_fb / r["fwd_bwd_s"],
        )
    return results


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        where = f"{_cpu_model()}, {os.cpu_count()} cores"
    else:
        where = f"{jax.device_count()} x {dev.device_kind}"
    return f"{where} ({dev.platform}), jax {jax.__version__}"


def to_markdown(results: list[dict]) -> str:
    lines = [
        "| features | dtype | implementation | fwd ms | fwd GB/s | fwd / copy | fwd+bwd ms "
        "| fwd+bwd GB/s | fwd+bwd / traffic | speed-up vs flax | residuals / bytes(x) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        res = "" if r["residual_x"] is None else f"{r['residual_x']:.2f}"
        lines.append(
            f"| {r['features']} | {r['dtype']} | {r['impl']} | {1e3 * r['fwd_s']:.2f} "
            f"| {r['fwd_gbs']:.1f} | {r['fwd_vs_baseline']:.2f} | {1e3 * r['fwd_bwd_s']:.2f} "
            f"| {r['fwd_bwd_gbs']:.1f} | {r['fwd_bwd_vs_baseline']:.2f} "
            f"| {r['speedup_vs_flax']:.2f} | {res} |"
        )
    return "\n".join(lines)


def summary_markdown(results: list[dict]) -> str:
    """One line per shape and dtype: rms_norm against the baselines and flax."""
    lines = [
        "| features | dtype | rows | fwd / copy | fwd+bwd / traffic | speed-up vs flax "
        "(p=1, p=0.0625, module) | residuals / bytes(x): ours, flax |",
        "|---:|---|---:|---:|---:|---|---|",
    ]
    for f, dtype in dict.fromkeys((r["features"], r["dtype"]) for r in results):
        row = {r["impl"]: r for r in results if r["features"] == f and r["dtype"] == dtype}
        ours = row["rms_norm"]
        speedups = ", ".join(
            f"{row[k]['speedup_vs_flax']:.2f}x"
            for k in ("rms_norm", "rms_norm p=0.0625", "RMSNorm module")
        )
        lines.append(
            f"| {f} | {dtype} | {ours['rows']} | {ours['fwd_vs_baseline']:.2f} "
            f"| {ours['fwd_bwd_vs_baseline']:.2f} | {speedups} "
            f"| {ours['residual_x']:.2f}, {row['flax RMSNorm']['residual_x']:.2f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    dtypes = sorted({r["dtype"] for r in results})
    impls = [
        r["impl"]
        for r in results
        if r["features"] == results[0]["features"]
        and r["dtype"] == results[0]["dtype"]
        and r["impl"] != "baseline"
    ]
    fig = Figure(figsize=(6 * len(dtypes), 4))
    axes = fig.subplots(1, len(dtypes), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        shapes = sorted({r["features"] for r in results if r["dtype"] == dtype})
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            values = [
                next(
                    r["speedup_vs_flax"]
                    for r in results
                    if r["dtype"] == dtype and r["features"] == f and r["impl"] == impl
                )
                for f in shapes
            ]
            ax.bar(np.arange(len(shapes)) + i * width, values, width, label=impl)
        ax.axhline(1.0, color="gray", lw=1)
        ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2, [str(f) for f in shapes])
        ax.set_xlabel("features")
        ax.set_ylabel("fwd+bwd speed-up over flax.linen.RMSNorm")
        ax.set_title(dtype)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main_aot(args) -> dict:
    """``--target`` an accelerator: the compilers' estimates, written beside the CPU run."""
    import aot_bench

    from rmsnorm_jax import aot

    target = aot.get_target(args.target)
    features = [256, 1024] if args.quick else [int(f) for f in args.features.split(",")]
    mib = 0.25 if args.quick else args.mib
    results = []
    for dtype in args.dtypes.split(","):
        itemsize = jnp.dtype(dtype).itemsize
        for f in features:
            rows = max(8, int(mib * 2**20 / (itemsize * f)))
            results.extend(aot_bench.estimate_shape(target, rows, f, jnp.dtype(dtype)))
            print(f"compiled: {target.name} {dtype} {rows}x{f}", flush=True)
    memory = aot_bench.train_step_memory(
        target, d=256 if args.quick else 2048, tokens=512 if args.quick else 16384
    )
    cost_d, cost_tokens = (256, 512) if args.quick else (1024, 8192)
    cost = aot_bench.train_step_cost(target, d=cost_d, tokens=cost_tokens)
    unit = {"cycles": "TPU cycles", "us": "microseconds"}[target.estimate_unit]
    header = (
        f"Target: {target.name} ({target.devices[0].device_kind}), jax {jax.__version__}; "
        f"estimates in {unit} from the compiler's cost model of a deviceless compile "
        f"(not a hardware timing); x = {mib:g} MiB per shape.\n\n"
    )
    memory_header = (
        "Train step (8 pre-norm blocks of two norms each, a linear token mixer and an MLP: "
        "relu or gelu with 4x hidden units, or LLaMA's SwiGLU with 8/3x; "
        "bfloat16, lax.scan over layers, "
        f"d = {2048 if not args.quick else 256}, {16384 if not args.quick else 512} "
        "tokens): temporary memory per device from the compiled program. "
        "`x * scale (floor)` is not a norm: it keeps what any norm with a learnable scale "
        "followed by a matmul must keep (x for the scale's gradient), so no norm can "
        "go below it.\n\n"
    )
    cost_header = (
        "A whole train step, the compiler's estimate (2 pre-norm blocks with a SwiGLU MLP, "
        f"scan unrolled, d = {cost_d}, {cost_tokens} tokens): here y feeds a matmul and dy "
        "comes back through it, so, unlike in the isolated forward+backward programs "
        "above, XLA cannot compute y inside the backward's reduction kernel.\n\n"
    )
    step_tables = (
        memory_header
        + aot_bench.memory_markdown(memory)
        + "\n\n"
        + cost_header
        + aot_bench.cost_markdown(target, cost)
        + "\n"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = target.name.replace(":", "_")
    report = {
        "target": target.name,
        "unit": target.estimate_unit,
        "results": results,
        "memory": memory,
        "step_cost": cost,
    }
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (out / f"{stem}.md").write_text(
        header + aot_bench.estimates_markdown(target, results) + "\n\n" + step_tables
    )
    summary = header + aot_bench.summary_markdown(target, results) + "\n\n" + step_tables
    (out / f"{stem}-summary.md").write_text(summary)
    print(summary)
    return report


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--mib", type=float, default=32.0, help="size of x per shape (16-128)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--features", default=",".join(map(str, FEATURES)))
    parser.add_argument(
        "--target",
        default="cpu",
        help="cpu (time on this machine) or an accelerator to compile for without one: "
        "tpu-v5e, tpu-v6e, h100, ... (the compiler's estimates; see rmsnorm_jax.aot)",
    )
    parser.add_argument(
        "--fused",
        action="store_true",
        help="compare add_rms_norm and gated_rms_norm with their hand-written flax "
        "compositions instead (residual bytes; CPU time or the target's estimate)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="output directory (default: benchmarks/results, or a new temporary directory "
        "for --quick)",
    )
    args = parser.parse_args(argv)
    args.out = str(output_dir(args.out, args.quick))
    print(f"writing to {args.out}", flush=True)
    if args.fused:
        return main_fused(args)
    if args.target != "cpu":
        return main_aot(args)
    repeats = args.repeats or (3 if args.quick else 10)
    mib = 0.25 if args.quick else args.mib
    features = [256, 1024] if args.quick else [int(f) for f in args.features.split(",")]

    results = []
    for dtype in args.dtypes.split(","):
        itemsize = jnp.dtype(dtype).itemsize
        for f in features:
            rows = max(8, int(mib * 2**20 / (itemsize * f)))
            results.extend(bench_shape(rows, f, jnp.dtype(dtype), repeats))
            print(f"done: {dtype} {rows}x{f}", flush=True)
    table = to_markdown(results)
    header = (
        f"Machine: {machine()}; median of {repeats} interleaved rounds; "
        f"x = {mib:g} MiB per shape.\n\n"
    )
    print(header + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"machine": machine(), "repeats": repeats, "results": results}, indent=1)
    )
    (out / "results.md").write_text(header + table + "\n")
    (out / "summary.md").write_text(header + summary_markdown(results) + "\n")
    plot(results, out / "results.png")
    return results


def main_fused(args) -> list[dict]:
    """Fused LLM-layer ops against flax compositions: residual bytes and fwd+bwd cost.

    On CPU the cost is the median time of interleaved rounds; on an accelerator target,
    the compiler's estimate of a deviceless compile (not a hardware timing).
    """
    features = [256] if args.quick else [int(f) for f in args.features.split(",")]
    mib = 0.25 if args.quick else args.mib
    repeats = args.repeats or (3 if args.quick else 10)
    target = None
    if args.target != "cpu":
        import aot_bench

        from rmsnorm_jax import aot

        target = aot.get_target(args.target)
    results = []
    for dtype in args.dtypes.split(","):
        for f in features:
            rows = max(8, int(mib * 2**20 / (jnp.dtype(dtype).itemsize * f)))
            x, other, scale, dy = random_inputs(rows, f, jnp.dtype(dtype))
            if target is None:
                calls = {
                    name: (jax.jit(fused_forward_backward(fn)), (x, other, scale, dy))
                    for name, fn in FUSED.items()
                }
                cost = time_calls(calls, repeats)
            else:
                cost = aot_bench.estimate_fused(target, rows, f, jnp.dtype(dtype))
            for name, fn in FUSED.items():
                results.append(
                    dict(
                        impl=name,
                        features=f,
                        rows=rows,
                        dtype=jnp.dtype(dtype).name,
                        fwd_bwd=cost[name],
                        residual_x=fused_residual_bytes(fn, x, other, scale) / x.nbytes,
                    )
                )
            print(f"done: fused {dtype} {rows}x{f}", flush=True)
    unit = "ms, XLA:CPU" if target is None else f"{target.estimate_unit}, estimate"
    where = machine() if target is None else f"{target.name}, compiler estimates (not timings)"
    lines = [
        f"Fused ops against hand-written flax compositions; {where}; x = {mib:g} MiB.\n",
        f"| features | dtype | implementation | fwd+bwd ({unit}) | vs composition "
        "| residuals / bytes(x) |",
        "|---:|---|---|---:|---:|---:|",
    ]
    pairs = {"add_rms_norm": "flax RMSNorm + add", "gated_rms_norm": "flax RMSNorm * silu"}
    for r in results:
        peer = pairs.get(r["impl"], r["impl"])
        base = next(
            q["fwd_bwd"]
            for q in results
            if q["impl"] == peer and q["features"] == r["features"] and q["dtype"] == r["dtype"]
        )
        r["vs_composition"] = r["fwd_bwd"] / base
        value = 1e3 * r["fwd_bwd"] if target is None else r["fwd_bwd"]
        lines.append(
            f"| {r['features']} | {r['dtype']} | {r['impl']} | {value:,.2f} "
            f"| {r['vs_composition']:.2f} | {r['residual_x']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "fused" if target is None else f"{target.name.replace(':', '_')}-fused"
    (out / f"{stem}.md").write_text(table + "\n")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
