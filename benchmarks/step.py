"""``step``: a whole train step of the pre-norm stack with each norm, in time and memory."""

from __future__ import annotations

import sys

import jax.numpy as jnp

from . import models, peers, report, timing

TITLE = "Train step"
CONFIGS = tuple((mlp, dtype) for mlp in ("swiglu", "gelu") for dtype in ("float32", "bfloat16"))
QUICK_CONFIGS = (("swiglu", "bfloat16"), ("gelu", "float32"))  # each MLP, each dtype
SHAPE, QUICK_SHAPE = dict(layers=8, d=2048, tokens=16384), dict(layers=2, d=64, tokens=128)
REFERENCE = "flax RMSNorm"
PEAK = (
    "Device peak: `peak_bytes_in_use` of the step run in a process of its own (`python -m "
    "benchmarks.peak`). Round spread: the largest minus the smallest round median, over the "
    "median. Wall ms: wall-clock per step in separate interleaved rounds (accelerators). "
)


def programs(mlp: str, dtype: str, quick: bool, platform: str, names=None) -> dict:
    """``{norm: (step, (params, h))}``: the pre-norm stack's train step with each norm
    (``names``: ``--norms``, flax RMSNorm, the reference, always among them)."""
    shape, out, inputs = QUICK_SHAPE if quick else SHAPE, {}, None
    norms = peers.chosen(peers.step_norms(platform, quick), names, keep=(REFERENCE,))
    for label, kw in norms.items():
        step, shapes = models.prenorm_stack_train_step(layers=shape["layers"], mlp=mlp, **kw)
        inputs = inputs or models.step_inputs(shapes, shape["d"], shape["tokens"], jnp.dtype(dtype))
        out[label] = (step, inputs)
    return out


def measure(programs: dict, own: list[str], platform, timer, args, reference: str) -> dict:
    """``timing.measure_steps``, each step's peak from ``benchmarks.peak <own> --norm N``."""
    own = [sys.executable, "-m", "benchmarks.peak", *own] + ["--quick"] * args.quick
    workers, peak = args.compile_workers, lambda name: [*own, "--norm", name]
    return timing.measure_steps(programs, platform, timer, args.rounds, workers, reference, peak)


def run(args, platform, timer, section, progress) -> None:
    section["shape"] = shape = QUICK_SHAPE if args.quick else SHAPE
    for mlp, dtype in QUICK_CONFIGS if args.quick else CONFIGS:
        if dtype in args.dtypes:
            steps = programs(mlp, dtype, args.quick, platform, args.norms)
            own = ["step", "--mlp", mlp, "--dtype", dtype]
            rows = measure(steps, own, platform, timer, args, REFERENCE)
            for norm, row in rows.items():
                config = dict(
                    section="step", model="pre-norm stack", mlp=mlp, dtype=dtype, norm=norm
                )
                section["results"].append(config | shape | row)
            times = ", ".join(f"{n} {report.ms(r.get('median_s'))} ms" for n, r in rows.items())
            progress(f"step {mlp} {dtype}: {times}")


def describe(section: dict) -> str:
    s = section["shape"]
    shape = f"{s['layers']} layers, d {s['d']}, {s['tokens']} tokens"
    return f"`models.prenorm_stack_train_step`: {shape}. {PEAK}"


def markdown(section: dict, reference: str = REFERENCE) -> str:
    """One row per train step: time, spread, wall time, the ratio to ``reference``, memory."""
    rows, quick = section["results"], section.get("quick", False)
    first = ["mode"] if any("mode" in r for r in rows) else ["model", "mlp", "dtype"]

    def cells(r):
        ok, ms, medians = "median_s" in r, report.ms, r.get("round_medians_s") or [0]
        spread = (
            f"{(max(medians) - min(medians)) / r['median_s']:.1%}"
            if ok and len(medians) > 1
            else ""
        )
        peak = r.get("peak_bytes") and ("" if r.get("peak_is_own") else "<= ") + report.mib(
            r["peak_bytes"]
        )
        note = "" if r.get("status") == "ok" else f"{r.get('status')}: {r.get('note', '')}"
        span = f"{ms(r.get('min_s'))}-{ms(r.get('max_s'))}" if ok else ""
        return [*(r.get(k, "") for k in first), r["norm"], ms(r.get("median_s")), span, spread,
                ms(r.get("wall_median_s")), report.x(r.get("vs_reference")),
                report.mib(r.get("temp_bytes")), peak or "", note]  # fmt: skip

    head = " | ".join(first) + " | norm | step ms (median) | min-max ms | round spread | wall ms "
    head += f"| vs {reference} | compiled temp MiB | device peak MiB | note"
    table = report.table(head, map(cells, rows), "l" * len(first) + "lrlrrrrrl")
    return report.caption(quick) + "\n\n" * quick + table
