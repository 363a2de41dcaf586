"""python -m benchmarks.peak {step,gemma} ... --norm NAME: one train step's peak memory: the
one program ``step`` or ``gemma`` times with that norm, run once in this fresh process (a
process's peak cannot be reset); prints ``{"peak_bytes", "before_bytes"}``."""

from __future__ import annotations

import argparse
import json
import sys

import jax

from . import gemma, peers, step, timing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser("python -m benchmarks.peak")
    p.add_argument("section", choices=("step", "gemma"))
    for flag in ("--norm", "--mlp", "--dtype", "--mode", "--batch", "--seq"):
        p.add_argument(flag, type=int if flag in ("--batch", "--seq") else str)
    p.add_argument("--quick", action="store_true")
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
    peak = (timing.memory_stats() or {}).get("peak_bytes_in_use")
    print(json.dumps(dict(peak_bytes=peak, before_bytes=before.get("bytes_in_use"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
