"""python -m benchmarks.kernel_sizes [--widths N ...] [--rounds R] [--quick] [--out DIR]: the
Pallas-Triton kernels (``rmsnorm_jax.kernels.triton``) alone over warps per program and the
backward's persistent programs, beside the XLA path, x of 32 MiB, CUPTI device time in
interleaved rounds -> OUT/kernel-sizes-<device>-<widths>.json. A GPU question."""

from __future__ import annotations

import argparse
import functools
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from rmsnorm_jax import rms_norm
from rmsnorm_jax.kernels import KernelSpec, _device, triton

from . import peers, report, timing


def programs_for(n: int, dtype, sms: int, quick: bool) -> dict:
    """``{name: (fn, args)}``: the XLA path and the kernels under each sizing."""
    rows = 32 * 2**20 // (n * np.dtype(dtype).itemsize)
    x, _, _, dy = peers.random_inputs(rows, n, dtype)
    scale = 1 + 0.1 * jax.random.normal(jax.random.key(2), (n,), jnp.float32)
    spec = KernelSpec(n, n, 1e-6, True, 0.0, True, False, np.dtype(dtype))
    stat = triton.forward(spec, x, scale, None)[1]
    xla = lambda x, s: rms_norm(x, s, dtype=x.dtype, implementation="xla")
    out = {
        "xla fwd": (xla, (x, scale)),
        "xla fwd+bwd": (peers.forward_backward(xla), (x, scale, dy)),
    }
    for w in (None, 8) if quick else (None, 4, 8, 32):
        fwd = lambda x, s, w=w: triton.forward(spec, x, s, None, warps=w)[:2]
        out[f"fwd warps={w or 'default'}"] = (fwd, (x, scale))
    for w in (None,) if quick else (None, 4, 8):
        for g in (None,) if quick else (None, sms, 2 * sms, 4 * sms):
            bwd = functools.partial(_bwd, spec, dx_dtype=dtype, programs=g, warps=w)
            out[f"bwd warps={w or 'default'} programs={g or 'default'}"] = (
                bwd,
                (x, dy, stat, scale),
            )
    return out


def _bwd(spec, x, dy, stat, s, **kw):
    dx, dscale, _ = triton.backward(spec, x, dy, stat, s, **kw)
    return dx, dscale.sum(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser("python -m benchmarks.kernel_sizes", description=__doc__)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="two widths, few variants")
    p.add_argument("--widths", type=int, nargs="+", default=[4096, 5120, 8192])
    args = p.parse_args(argv)
    if (device := jax.devices()[0]).platform not in ("gpu", "cuda"):
        print(f"kernel_sizes times GPU kernels; the device here is {device.platform}.")
        return 2
    sms, widths = _device.target().sms, (1024, 8192) if args.quick else args.widths
    argv = sys.argv[1:] if argv is None else argv
    results = dict(device=device.device_kind, jax=jax.__version__, python=platform.python_version())
    results |= dict(sms=sms, mib=32, command=report.command(argv, p.prog), rows={})
    for dtype in (jnp.bfloat16, jnp.float32):
        for n in widths:
            compiled = timing.compile_all(programs_for(n, dtype, sms, args.quick), workers=16)
            ok = {k: v for k, v in compiled.items() if not isinstance(v, str)}
            timed = timing.interleaved(ok, timing.CuptiTimer(10), args.rounds)
            timed |= {k: dict(status="failed", note=v) for k, v in compiled.items() if k not in ok}
            rows = results["rows"][f"{np.dtype(dtype).name} n={n}"] = {}
            for name, r in timed.items():
                rows[name] = {k: v for k, v in r.items() if k != "kernels"}
                print(f"{np.dtype(dtype).name} n={n} {name:40s} {report.us(r.get('median_s'))} us")
    name = f"kernel-sizes-{device.device_kind.replace(' ', '-')}-{'-'.join(map(str, widths))}"
    report.output_dir(args.out, False).mkdir(parents=True, exist_ok=True)
    (report.output_dir(args.out, False) / f"{name}.json").write_text(report.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
