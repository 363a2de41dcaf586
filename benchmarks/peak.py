"""python -m benchmarks.peak {step,gemma} ... --norm NAME: one train step's peak memory.

Builds the one program that ``python -m benchmarks step`` or ``gemma`` times under that
norm, runs it once in this fresh process, and prints one JSON line:
``{"peak_bytes": ..., "before_bytes": ...}`` (the device's ``peak_bytes_in_use`` after the
run, and ``bytes_in_use`` before it: the inputs). A process's peak cannot be reset, so
each program's own peak needs a process of its own (``timing.measure_steps`` starts these).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

from . import peers, timing
from .__main__ import gemma_programs, step_programs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peak")
    sub = p.add_subparsers(dest="section", required=True)
    step = sub.add_parser("step")
    step.add_argument("--mlp", required=True)
    step.add_argument("--dtype", required=True)
    gemma = sub.add_parser("gemma")
    gemma.add_argument("--mode", required=True, choices=("unrolled", "scan"))
    gemma.add_argument("--batch", type=int, required=True)
    gemma.add_argument("--seq", type=int, required=True)
    for sp in (step, gemma):
        sp.add_argument("--norm", required=True)
        sp.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    platform = timing.device_platform(jax.devices()[0])
    if args.section == "step":
        programs = step_programs(args.mlp, args.dtype, args.quick, platform)
    else:
        norms = peers.gemma_norms(platform)
        if args.norm not in norms:
            p.error(f"--norm: {args.norm!r} is not one of {list(norms)}")
        norms = {args.norm: norms[args.norm]}
        programs = gemma_programs(args.mode, norms, args.quick, args.batch, args.seq)
    if args.norm not in programs:
        p.error(f"--norm: {args.norm!r} is not one of {list(programs)}")
    fn, fargs = programs[args.norm]
    fargs = jax.block_until_ready(fargs)
    before = timing.memory_stats() or {}
    jax.block_until_ready(jax.jit(fn)(*fargs))
    after = timing.memory_stats() or {}
    print(
        json.dumps(
            dict(peak_bytes=after.get("peak_bytes_in_use"), before_bytes=before.get("bytes_in_use"))
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
