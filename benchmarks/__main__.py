"""python -m benchmarks SECTION [--quick] [--rounds N] [--target T] [--out DIR] ...

Each section answers one question, measured one of three ways: device time on the device
jax sees (a GPU: CUPTI, the sum of the program's kernel times; elsewhere wall-clock), CPU
wall-clock (XLA:CPU timings), or, with --target T (h100, tpu-v5e, ...), an estimate: a
deviceless compile for T, its memory and the compiler's cost model, not a hardware timing.

OUT is benchmarks/results/ unless --out is given; --quick is a smoke run (tiny shapes, few
rounds; every table says "smoke run: not a measurement") written to a new temporary folder
unless --out is given. benchmarks/README.md lists the committed results.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SECTIONS = {
    "ops": "each norm alone, forward and forward+backward, against flax, the plain formula, "
    "tokamax (its Triton kernel and XLA path) and our paths (auto, XLA, each kernel backend), "
    "with GB/s and % of the copy's rate; device time or CPU wall -> OUT/<device>-measured.md, "
    ".json, .png (GB/s against features)",
    "step": "a whole train step of an 8-layer pre-norm stack with each norm: device time or CPU "
    "wall, compiled temp and peak memory -> OUT/<device>-measured.md, .json",
    "gemma": "the Gemma-3-style step (270M shape) with each norm, unrolled and under scan: on a "
    "device -> OUT/<device>-measured.*; with --target T, an estimate -> OUT/gemma-<target>.md",
    "maxtext": "--target T: a MaxText-shaped Llama2-style step with MaxText's norm and ours, per "
    "layer mode and remat policy; an estimate -> OUT/maxtext-<target>-jax<version>.md",
    "estimates": "--target T: the ops, fused ops and the pre-norm step, deviceless; an estimate "
    "-> OUT/<target>.md, <target>-summary.md, <target>-fused.md and their .json",
}
DEVICE, STEPS = ("ops", "step", "gemma"), ("gemma", "maxtext")
OPTIONS = [  # (sections, flag, argparse keywords)
    (SECTIONS, "--quick", dict(action="store_true", help="tiny shapes, few rounds: a smoke run")),
    (SECTIONS, "--out", dict(help="output folder (benchmarks/results; --quick: a new one)")),
    (SECTIONS, "--dtypes", dict(default="float32,bfloat16", help="comma separated")),
    (DEVICE, "--rounds", dict(type=int, help="interleaved rounds (default 5; --quick 3)")),
    (DEVICE, "--iterations", dict(type=int, help="iterations per program and round (GPU: 10)")),
    (DEVICE, "--compile-workers", dict(type=int, help="threads compiling (8; a CPU: 1)")),
    (("gemma",), "--target", dict(help="h100, tpu-v5e, tpu-v6e, ...: an estimate")),
    (("maxtext", "estimates"), "--target", dict(required=True, help="h100, tpu-v5e, ...")),
    (("ops", "step"), "--target", dict(help=argparse.SUPPRESS)),  # refused with what does it
    (("ops", "estimates"), "--features", dict(help="comma separated")),
    (("ops",), "--sizes", dict(help="MiB of x, comma separated (default 32,256)")),
    (STEPS, "--batch", dict(type=int)),
    (STEPS, "--seq", dict(type=int)),
    (("gemma",), "--modes", dict(default="unrolled,scan")),
    (("maxtext",), "--modes", dict(default="scan,unrolled")),
    (("maxtext",), "--remats", dict(default="full,minimal,none")),
    (("gemma", "step"), "--norms", dict(help="comma separated (default: all; estimate: no floor)")),
    (("gemma",), "--merge", dict(help="--target: a JSON whose records for other norms are kept")),
    (("estimates",), "--mib", dict(type=float, default=32.0, help="size of x per shape")),
]  # fmt: skip


def parser() -> argparse.ArgumentParser:
    kind = argparse.RawDescriptionHelpFormatter
    text = __doc__.split("\n\n", 1)[1]
    top = argparse.ArgumentParser("python -m benchmarks", description=text, formatter_class=kind)
    sub = top.add_subparsers(dest="section", required=True, metavar="SECTION")
    for name, text in SECTIONS.items():
        p = sub.add_parser(name, help=text.replace("%", "%%"), description=text)
        for sections, flag, kw in OPTIONS:
            if name in sections:
                p.add_argument(flag, **kw)
    return top


def _choices(p, value: str, allowed, option: str) -> list[str]:
    if unknown := [c for c in value.split(",") if c not in allowed]:
        p.error(f"{option}: unknown {unknown}; choose from {', '.join(allowed)}")
    return value.split(",")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    if args.section in ("ops", "step") and args.target:
        why = f"{args.section} measures on the device jax sees; for the compiler's estimates"
        p.error(
            f"{why} without a device run: python -m benchmarks estimates --target {args.target}"
        )
    if getattr(args, "rounds", None) is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.target:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless compiles: before jax starts
    from . import estimates, gemma, maxtext, models, plot, report

    args.dtypes = _choices(p, args.dtypes, ("float32", "bfloat16", "float16"), "--dtypes")
    if args.section in STEPS:
        args.modes = _choices(p, args.modes, ("unrolled", "scan"), "--modes")
    if args.section == "maxtext":
        args.remats = _choices(p, args.remats, models.REMAT_POLICIES, "--remats")
    args.command = report.command(argv)
    if args.section in ("ops", "step") or not args.target:
        rep = report.run_device(args, args.section)
        if args.section == "ops":
            plot.draw(rep, Path(rep["out"]) / f"{rep['stem']}.json")
        return rep
    run = {"gemma": gemma.run_target, "maxtext": maxtext.run, "estimates": estimates.run}
    return run[args.section](args)


if __name__ == "__main__":
    main()
