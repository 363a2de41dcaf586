"""python -m benchmarks.peak {step,gemma} ... --norm NAME: one train step's peak memory.

Runs the one program that ``step`` or ``gemma`` times with that norm once in this fresh
process (a process's peak cannot be reset) and prints ``{"peak_bytes", "before_bytes"}``.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

from . import gemma, peers, step, timing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peak")
    sub = p.add_subparsers(dest="section", required=True)
    s, g = sub.add_parser("step"), sub.add_parser("gemma")
    s.add_argument("--mlp", required=True)
    s.add_argument("--dtype", required=True)
    g.add_argument("--mode", required=True, choices=gemma.MODES)
    g.add_argument("--batch", type=int, required=True)
    g.add_argument("--seq", type=int, required=True)
    for sp in (s, g):
        sp.add_argument("--norm", required=True)
        sp.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    platform = timing.device_platform(jax.devices()[0])
    if args.section == "step":
        programs = step.programs(args.mlp, args.dtype, args.quick, platform)
    else:
        norms = {n: f for n, f in peers.gemma_norms(platform).items() if n == args.norm}
        programs = gemma.programs(args.mode, norms, args.quick, args.batch, args.seq)
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
