"""python -m benchmarks.kernel_sizes [--out DIR] [--rounds R] [--quick]

Which block sizing makes the GPU kernels fastest at each width? Times the Pallas-Triton
forward and backward kernels (``rmsnorm_jax.kernels.gpu``) alone, CUPTI device time, over
the warps per program and (backward) the persistent grid's size, beside the XLA path's
forward and forward+backward of the same call, on x of 32 MiB, float32 and bfloat16,
--widths features (4096, 5120, 8192 by default). Each variant is compiled with its
sizing and timed in interleaved rounds. Writes
OUT/kernel-sizes-<device>-<widths>.json and prints a table.

A GPU question: on another platform it refuses (the kernels' speed on a CPU means nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rmsnorm_jax import rms_norm
from rmsnorm_jax.kernels import gpu
from rmsnorm_jax.kernels._spec import KernelSpec

from .timing import CuptiTimer, compile_all, interleaved


def _spec(n: int, dtype) -> KernelSpec:
    return KernelSpec(
        n=n,
        k=n,
        eps=1e-6,
        inside=True,
        scale_offset=0.0,
        has_scale=True,
        has_bias=False,
        out_dtype=np.dtype(dtype),
    )


def programs_for(n: int, dtype, mib: int, sms: int, quick: bool) -> dict:
    """``{name: (fn, args)}``: the XLA path and the kernels under each sizing."""
    rows = mib * 2**20 // (n * np.dtype(dtype).itemsize)
    key = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key[0], (rows, n), dtype)
    dy = jax.random.normal(key[1], (rows, n), dtype)
    scale = 1 + 0.1 * jax.random.normal(key[2], (n,), jnp.float32)
    spec = _spec(n, dtype)
    _, stat, _ = gpu.forward(spec, x, scale, None)

    def xla_fwd(x, s):
        return rms_norm(x, s, dtype=x.dtype, implementation="xla")

    def xla_fwd_bwd(x, s, dy):
        y, vjp = jax.vjp(xla_fwd, x, s)
        return y, vjp(dy)

    out = {"xla fwd": (xla_fwd, (x, scale)), "xla fwd+bwd": (xla_fwd_bwd, (x, scale, dy))}
    for warps in (None, 8) if quick else (None, 4, 8, 32):
        out[f"fwd warps={warps or 'default'}"] = (
            functools.partial(_fwd, spec, warps=warps),
            (x, scale),
        )
    for warps in (None,) if quick else (None, 4, 8):
        for programs in (None,) if quick else (None, sms, 2 * sms, 4 * sms, rows):
            out[f"bwd warps={warps or 'default'} programs={programs or 'default'}"] = (
                functools.partial(_bwd, spec, warps=warps, programs=programs, dtype=dtype),
                (x, dy, stat, scale),
            )
    return out


def _fwd(spec, x, s, *, warps):
    return gpu.forward(spec, x, s, None, warps=warps)[:2]


def _bwd(spec, x, dy, stat, s, *, warps, programs, dtype):
    dx, ds, _ = gpu.backward(spec, x, dy, stat, s, dx_dtype=dtype, programs=programs, warps=warps)
    return dx, ds.sum(0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="two widths, few variants")
    parser.add_argument("--widths", type=int, nargs="+", default=[4096, 5120, 8192])
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    if device.platform not in ("gpu", "cuda"):
        print(f"kernel_sizes times GPU kernels; the device here is {device.platform}.")
        return 2
    sms = gpu.multiprocessors()
    widths = (1024, 8192) if args.quick else args.widths
    results = dict(
        device=device.device_kind,
        jax=jax.__version__,
        python=platform.python_version(),
        sms=sms,
        mib=32,
        rows={},
    )
    for dtype in (jnp.bfloat16, jnp.float32):
        for n in widths:
            compiled = compile_all(programs_for(n, dtype, 32, sms, args.quick), workers=16)
            failed = {k: v for k, v in compiled.items() if isinstance(v, str)}
            ok = {k: v for k, v in compiled.items() if not isinstance(v, str)}
            timed = interleaved(ok, CuptiTimer(10), rounds=args.rounds)
            timed.update({k: dict(status="failed", note=v) for k, v in failed.items()})
            key = f"{np.dtype(dtype).name} n={n}"
            results["rows"][key] = {
                name: {k: v for k, v in r.items() if k != "kernels"} for name, r in timed.items()
            }
            print(f"\n## {key}")
            for name, r in timed.items():
                med = r.get("median_s")
                print(
                    f"{name:40s} "
                    + (
                        f"{med * 1e6:8.1f} us  ({r['min_s'] * 1e6:.1f}-{r['max_s'] * 1e6:.1f})"
                        if med
                        else r.get("note", "")
                    )
                )
            sys.stdout.flush()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = device.device_kind.replace(" ", "-")
    (out / f"kernel-sizes-{name}-{'-'.join(map(str, widths))}.json").write_text(
        json.dumps(results, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
