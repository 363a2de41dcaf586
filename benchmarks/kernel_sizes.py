"""python -m benchmarks.kernel_sizes [--backend B] [--widths N ...] [--dtypes D,...]
[--rounds R] [--quick] [--out DIR]: one Pallas backend's kernels alone under each sizing
choice, beside the XLA path, x of 32 MiB, CUPTI device time in interleaved rounds.

- ``triton`` (the default): warps per program and the backward's persistent programs
  -> OUT/kernel-sizes-<device>-<widths>.json.
- ``mosaic_gpu``: each choice of ``mosaic_gpu_sizing.Sizing`` halved and doubled, one at a
  time, from the data's (``kernels/data/mosaic_gpu_sizing.json``); a choice that leaves a
  call's plan and grid as the data's is not timed again -> OUT/kernel-sizes-mosaic_gpu-
  <device>-<widths>.json, written again after each width, with each plan, GB/s and per
  shape the fastest sizing of each kernel.

A GPU question: elsewhere it refuses, except ``--backend mosaic_gpu --quick`` on a CPU
(the GPU visit's dry run: the kernels interpreted on 64 rows, not a timing)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from rmsnorm_jax import rms_norm
from rmsnorm_jax.kernels import KernelSpec, _device, mosaic_gpu, mosaic_gpu_sizing, triton

from . import peers, report, timing

WIDTHS = {"triton": (4096, 5120, 8192), "mosaic_gpu": (128, 1024, 4096, 16384)}
# Bytes a kernel moves, in x's size: the forward reads x, writes y; the backward reads x
# and dy, writes dx (the row statistic and the partial sums are a row's or a block's).
MOVES = {"forward": 2, "backward": 3, "xla fwd": 2, "xla fwd+bwd": peers.MOVES["norm", "fwd+bwd"]}


def _inputs(rows: int, n: int, dtype):
    x, _, _, dy = peers.random_inputs(rows, n, dtype)
    scale = 1 + 0.1 * jax.random.normal(jax.random.key(2), (n,), jnp.float32)
    spec = KernelSpec(n, n, 1e-6, True, 0.0, True, False, np.dtype(dtype))
    return spec, x, scale, dy


def _xla(x, scale, dy) -> dict:
    xla = lambda x, s: rms_norm(x, s, dtype=x.dtype, implementation="xla")
    return {
        "xla fwd": (xla, (x, scale)),
        "xla fwd+bwd": (peers.forward_backward(xla), (x, scale, dy)),
    }


def triton_programs(n: int, dtype, sms: int, quick: bool) -> dict:
    """``{name: (fn, args)}``: the XLA path and the Triton kernels under each sizing."""
    rows = 32 * 2**20 // (n * np.dtype(dtype).itemsize)
    spec, x, scale, dy = _inputs(rows, n, dtype)
    stat = triton.forward(spec, x, scale, None)[1]
    out = _xla(x, scale, dy)
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


def sizings(quick: bool) -> dict[str, mosaic_gpu_sizing.Sizing]:
    """The data's sizing, and each of its choices halved and doubled (``--quick``: the
    chunks doubled)."""
    base = mosaic_gpu_sizing.SIZING
    out = {"data's": base}
    fields = ("forward_chunk", "backward_chunk")
    for field in fields if quick else [f.name for f in dataclasses.fields(base)]:
        value = getattr(base, field)
        for new in (value * 2,) if quick else (value // 2, value * 2):
            out[f"{field}={new}"] = dataclasses.replace(base, **{field: new})
    return out


def describe(plan: mosaic_gpu_sizing.Plan, programs: int) -> str:
    """One plan and grid, as the results file records it."""
    layout = f"split rows, T={plan.T} splits" if plan.split else f"row tiles, T={plan.T} rows"
    return (
        f"{layout}, {plan.J}x{plan.S} (v={plan.v}, {plan.lanes} lanes), R={plan.R}, "
        f"{plan.slots} slots{', streamed' if plan.stream else ''}, {plan.smem} B smem, "
        f"{programs} programs"
    )


def mosaic_gpu_programs(n: int, dtype, rows: int, sms: int, quick: bool, interpret: bool):
    """``({name: (fn, args)}, {name: plan or why not timed})``: the XLA path and the
    Mosaic GPU kernels, forward and backward, under each sizing of :func:`sizings` whose
    plan or grid differs from one timed already."""
    spec, x, scale, dy = _inputs(rows, n, dtype)
    run = dict(interpret=interpret)
    stat = mosaic_gpu.forward(spec, x, scale, None, **run)[1]
    out, plans = _xla(x, scale, dy), {}
    for kind in ("forward", "backward"):
        seen: dict = {}
        for name, sizing in sizings(quick).items():
            label = f"{kind} {name}"
            dtypes = {"dx_dtype": dtype} if kind == "backward" else {}
            plan = mosaic_gpu_sizing.plan(spec, rows, dtype, kind, sizing=sizing, **dtypes)
            if plan is None:
                plans[label] = "does not fit shared memory"
                continue
            programs = plan.programs(rows, sms)
            key = (dataclasses.replace(plan, max_blocks_per_sm=0), programs)
            if key in seen:
                plans[label] = f"the plan of {seen[key]}"
                continue
            seen[key], plans[label] = label, describe(plan, programs)
            if kind == "forward":
                fn = functools.partial(_mosaic_fwd, spec, sizing=sizing, **run)
                out[label] = (fn, (x, scale))
            else:
                fn = functools.partial(_mosaic_bwd, spec, dx_dtype=dtype, sizing=sizing, **run)
                out[label] = (fn, (x, dy, stat, scale))
    return out, plans


def fastest(table: dict) -> dict:
    """Per kernel, the sizing with the least median time and its time over the data's
    sizing's (the Mosaic GPU sweep's summary of one shape)."""
    out = {}
    for kind in ("forward", "backward"):
        timed = {
            k: r["median_s"] for k, r in table.items() if k.startswith(kind) and "median_s" in r
        }
        if f"{kind} data's" in timed:
            best = min(timed, key=timed.get)
            out[kind] = dict(sizing=best.removeprefix(f"{kind} "),
                             vs_data=timed[best] / timed[f"{kind} data's"])  # fmt: skip
    return out


def _mosaic_fwd(spec, x, s, **kw):
    return mosaic_gpu.forward(spec, x, s, None, **kw)[:2]


def _mosaic_bwd(spec, x, dy, stat, s, **kw):
    dx, dscale, _ = mosaic_gpu.backward(spec, x, dy, stat, s, **kw)
    return dx, dscale.sum(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser("python -m benchmarks.kernel_sizes", description=__doc__)
    p.add_argument("--backend", choices=tuple(WIDTHS), default="triton")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="the smallest sizes, few variants")
    p.add_argument("--widths", type=int, nargs="+", help="features (default: per backend)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma separated")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    gpu = device.platform in ("gpu", "cuda")
    if not gpu and not (args.quick and args.backend == "mosaic_gpu"):
        print(
            f"kernel_sizes times GPU kernels; the device here is {device.platform} "
            "(on a CPU, --backend mosaic_gpu --quick runs the sweep interpreted: a dry run)."
        )
        return 2
    if args.backend == "mosaic_gpu" and not mosaic_gpu.available():
        print(f"the Mosaic GPU kernels need jax >= 0.11.2; this is jax {jax.__version__}.")
        return 2
    sms = _device.target().sms
    widths = args.widths or WIDTHS[args.backend]
    if args.quick:
        widths = (1024, 8192) if args.backend == "triton" else (256,)
    dtypes = [jnp.dtype(d) for d in args.dtypes.split(",")]
    argv = sys.argv[1:] if argv is None else argv
    results = dict(device=device.device_kind, jax=jax.__version__, python=platform.python_version())
    results |= dict(sms=sms, mib=32, command=report.command(argv, p.prog), rows={})
    if args.backend == "mosaic_gpu":
        results["sizing"] = dataclasses.asdict(mosaic_gpu_sizing.SIZING)
        results |= dict(plans={}, fastest={})
    if args.quick:
        results["note"] = "smoke run (--quick): not a measurement"
    stem = "kernel-sizes" + ("-mosaic_gpu" if args.backend == "mosaic_gpu" else "")
    name = f"{stem}-{device.device_kind.replace(' ', '-')}-{'-'.join(map(str, widths))}"
    out = report.output_dir(args.out, False) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    timer = timing.CuptiTimer(10) if gpu else timing.WallTimer()
    for dtype in dtypes:
        for n in widths:
            key = f"{dtype.name} n={n}"
            rows = 64 if args.quick else 32 * 2**20 // (n * dtype.itemsize)
            if args.backend == "triton":
                programs = triton_programs(n, dtype, sms, args.quick)
            else:
                programs, results["plans"][key] = mosaic_gpu_programs(
                    n, dtype, rows, sms, args.quick, interpret=not gpu
                )
            compiled = timing.compile_all(programs, workers=16 if gpu else 1)
            ok = {k: v for k, v in compiled.items() if not isinstance(v, str)}
            timed = timing.interleaved(ok, timer, args.rounds)
            timed |= {k: dict(status="failed", note=v) for k, v in compiled.items() if k not in ok}
            table = results["rows"][key] = {}
            for label, r in timed.items():
                table[label] = {k: v for k, v in r.items() if k != "kernels"}
                if gpu and args.backend == "mosaic_gpu" and r.get("median_s"):
                    moves = MOVES.get(label) or MOVES[label.split()[0]]
                    table[label]["gbs"] = moves * rows * n * dtype.itemsize / r["median_s"] / 1e9
                print(f"{key} {label:40s} {report.us(r.get('median_s'))} us")
            if args.backend == "mosaic_gpu":
                results["fastest"][key] = fastest(table)
                print(f"{key} fastest: {results['fastest'][key]}")
            out.write_text(report.dumps(results) + "\n")  # kept if a later width runs out
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
