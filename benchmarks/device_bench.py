"""Device time of the norms on the accelerator jax sees: isolated ops and a whole train step.

    python benchmarks/device_bench.py                # full run (about 8 minutes on an H100)
    python benchmarks/device_bench.py --only ops     # or --only step: one section, merged
                                                     # into the same result files
    python benchmarks/device_bench.py --quick        # tiny shapes (CI, CPU); writes to a
                                                     # temporary directory unless --out

How each program is timed, by the platform of the default device:

- GPU: device time from CUPTI, ``jax.experimental.mosaic.gpu.profiler.measure(compiled,
  aggregate=False, iterations=N)``: per iteration the sum of the program's kernel times;
  the median over every iteration of every round. Each program's kernel list (the
  iteration nearest the median) is kept in the JSON. Never wall-clock for kernels.
- TPU: device time of the program's ``XLA Modules`` events in a ``jax.profiler`` trace of
  each round; where the trace cannot be read, wall-clock over many dispatches per timing
  (labelled so in the results).
- CPU: wall-clock, one call per sample (``bench.time_rounds``): a smoke test of this code.

``--quick``: x of 0.125 MiB with 256 features, 3 rounds; a 2-layer step (d 64, 128
tokens), SwiGLU in bfloat16 and gelu in float32.

Every section interleaves its programs: each once per round, a warm-up round, then
``--rounds`` rounds, so that a program measured first in a fresh process is not favoured
or penalised.

Ops (``--only ops``): forward and forward+backward of ``rms_norm`` (p = 1 and 0.0625), the
``RMSNorm`` Module, ``add_rms_norm`` and ``gated_rms_norm``; their peers: flax RMSNorm,
flax LayerNorm, the plain formula under autodiff, the hand-written flax compositions for
the fused ops; on a GPU jax's Pallas-Triton ``rms_norm``; tokamax's
``layer_norm(..., subtract_mean=False)`` where installed; the fused Pallas kernels
(``implementation="pallas"``) where the installed ``rmsnorm_jax`` has them (not on CPU,
where they run in interpret mode). x of 32 and 256 MiB; 1024, 4096, 5120 and 8192
features; float32 and bfloat16. In the same rounds the copy (``x * 2``) and traffic
(``(x * 2, x * dy)``) baselines. Each result as a ratio to the best peer, and as % of the
bandwidth bound at the copy rate measured for that shape: bytes moved (in units of
bytes(x): forward 2, forward+backward 5; ``add_rms_norm`` 4 and 8, ``gated_rms_norm`` 3
and 8) over the copy's bytes per second.

Train step (``--only step``): ``implementations.prenorm_stack_train_step`` (SwiGLU and
gelu; bfloat16 and float32; 8 layers, d 2048, 16k tokens) with each norm, plus
``rms_norm`` with every layer under ``jax.checkpoint`` saving only ``"rms_norm_stat"``,
and the ``x * scale`` floor. Step time (device time as above, and on an accelerator also
wall-clock per step), the compiled program's temporary memory, and the device's
``peak_bytes_in_use`` where ``memory_stats()`` reports it. The peak cannot be reset: each
program runs once on its own, in order of increasing compiled size, before the timing
rounds, and the process-wide peak after it is recorded; where it rose, it is that
program's own peak (``peak_is_own``), else the program's peak is at most that value.
More models join the section through :data:`EXTRA_STEPS`.

Writes ``<out>/<device>-measured.md``, ``.json`` (rewritten after every shape and every
train-step configuration, so an interrupted run keeps what it measured) and ``.png``.

The code: ``device_timing.py`` (the timers, the interleaved rounds, compiling),
``device_ops.py`` (the isolated-op programs), ``device_step.py`` (the train step, its
memory, :data:`EXTRA_STEPS`) and ``device_report.py`` (the markdown, JSON and plot); this
file is the command line, and every public name of those can be imported from it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))

import bench
from device_ops import (
    DTYPES,
    FEATURES,
    HAS_IMPLEMENTATION,
    MOVES,
    SIZES_MIB,
    OpProgram,
    add_op_ratios,
    bench_op_shape,
    op_programs,
)
from device_report import (
    _ms,
    _us,
    _x,
    device_slug,
    ops_markdown,
    plot,
    report_markdown,
    step_markdown,
    write_report,
)
from device_step import (
    EXTRA_STEPS,
    QUICK_STEP_CONFIGS,
    QUICK_STEP_SHAPE,
    STEP_CONFIGS,
    STEP_SHAPE,
    StepFactory,
    memory_stats,
    prenorm_programs,
    run_step_group,
    step_inputs,
    step_norms,
)
from device_timing import (
    CuptiTimer,
    DispatchTimer,
    Sample,
    TraceTimer,
    WallTimer,
    _error,
    compile_all,
    device_platform,
    interleaved,
    make_timer,
    median_kernels,
    module_name,
    named,
    summarize,
    trace_module_times,
    uses_custom_kernel,
)
from implementations import (
    EPS,
    FUSED,
    IMPLEMENTATIONS,
    copy_baseline,
    forward_backward,
    fused_forward_backward,
    prenorm_stack_train_step,
    scale_only,
    traffic_baseline,
)

# What tests and callers use as ``device_bench.X``, from the modules it was split into.
__all__ = [
    "DTYPES",
    "EPS",
    "EXTRA_STEPS",
    "FEATURES",
    "FUSED",
    "HAS_IMPLEMENTATION",
    "IMPLEMENTATIONS",
    "MOVES",
    "QUICK_STEP_CONFIGS",
    "QUICK_STEP_SHAPE",
    "SIZES_MIB",
    "STEP_CONFIGS",
    "STEP_SHAPE",
    "CuptiTimer",
    "DispatchTimer",
    "OpProgram",
    "Sample",
    "StepFactory",
    "TraceTimer",
    "WallTimer",
    "add_op_ratios",
    "bench_op_shape",
    "compile_all",
    "copy_baseline",
    "device_platform",
    "device_slug",
    "forward_backward",
    "fused_forward_backward",
    "interleaved",
    "main",
    "make_timer",
    "median_kernels",
    "memory_stats",
    "module_name",
    "named",
    "op_programs",
    "ops_markdown",
    "parse_args",
    "plot",
    "prenorm_programs",
    "prenorm_stack_train_step",
    "report_markdown",
    "run_step_group",
    "scale_only",
    "step_inputs",
    "step_markdown",
    "step_norms",
    "summarize",
    "trace_module_times",
    "traffic_baseline",
    "uses_custom_kernel",
    "write_report",
]

# ---------------------------------------------------------------- main


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    parser.add_argument("--only", choices=("ops", "step"), default=None)
    parser.add_argument(
        "--out",
        default=None,
        help="output directory (default: benchmarks/results, or a new temporary directory "
        "for --quick); with --only, the other section of an earlier result is kept",
    )
    parser.add_argument("--rounds", type=int, default=None, help="ops: rounds (default 5)")
    parser.add_argument(
        "--iterations", type=int, default=None, help="ops: iterations per round on a device"
    )
    parser.add_argument("--step-rounds", type=int, default=5, help="train step: rounds (>= 5)")
    parser.add_argument(
        "--step-iterations", type=int, default=2, help="train step: iterations per round"
    )
    parser.add_argument("--sizes", default=None, help="MiB of x, comma separated")
    parser.add_argument("--features", default=None, help="comma separated")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument(
        "--compile-workers",
        type=int,
        default=None,
        help="threads compiling programs (default: 8 on an accelerator, 1 on CPU)",
    )
    args = parser.parse_args(argv)
    platform = device_platform(jax.devices()[0])
    if args.quick:
        sizes, features = (0.125,), (256,)
        args.rounds = args.rounds or 3
    else:
        sizes, features = SIZES_MIB, FEATURES
        args.rounds = args.rounds or 5
    args.sizes = [float(s) for s in args.sizes.split(",")] if args.sizes else list(sizes)
    args.features = [int(f) for f in args.features.split(",")] if args.features else features
    args.dtypes = args.dtypes.split(",")
    args.iterations = args.iterations or (1 if platform == "cpu" else 10)
    if args.compile_workers is None:
        args.compile_workers = 1 if platform == "cpu" else min(8, os.cpu_count() or 1)
    if args.step_rounds < 1 or args.rounds < 1:
        parser.error("--rounds and --step-rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = jax.devices()[0]
    platform = device_platform(device)
    out = bench.output_dir(args.out, args.quick, prefix="device_bench")
    stem = f"{device_slug(device)}-measured"
    print(f"device_bench: {bench.machine()}; writing {out / stem}.md/.json/.png", flush=True)
    report = dict(
        device=device.device_kind if platform != "cpu" else f"CPU ({bench._cpu_model()})",
        platform=platform,
        machine=bench.machine(),
        jax=jax.__version__,
        argv=argv,
        sections={},
    )
    previous = out / f"{stem}.json"
    if args.only and previous.exists():
        try:
            earlier = json.loads(previous.read_text())
            report["sections"].update(
                {k: v for k, v in earlier.get("sections", {}).items() if k != args.only}
            )
        except (OSError, ValueError):
            pass
    start = time.perf_counter()

    def elapsed() -> str:
        return f"[{time.perf_counter() - start:6.1f} s]"

    if args.only in (None, "ops"):
        timer = make_timer(platform, args.iterations)
        section = dict(
            date=time.strftime("%Y-%m-%d %H:%M"),
            rounds=args.rounds,
            iterations=args.iterations if platform != "cpu" else None,
            method=timer.method,
            results=[],
        )
        report["sections"]["ops"] = section
        total, done, ops_start = len(args.sizes) * len(args.dtypes) * len(args.features), 0, 0.0
        for mib in args.sizes:
            for dtype in args.dtypes:
                for f in args.features:
                    ops_start = ops_start or time.perf_counter()
                    rows = bench_op_shape(mib, f, dtype, platform, timer, args)
                    done += 1
                    eta = (time.perf_counter() - ops_start) / done * (total - done)
                    section["results"].extend(rows)
                    section["method"] = timer.method
                    rms = {r["kind"]: r for r in rows if r["impl"] == "rms_norm"}
                    print(
                        f"{elapsed()} ops {mib:g} MiB {dtype} {f}: rms_norm fwd "
                        f"{_us(rms['fwd'].get('median_s'))} us, fwd+bwd "
                        f"{_us(rms['fwd+bwd'].get('median_s'))} us "
                        f"({_x(rms['fwd+bwd'].get('vs_best_peer'))}x the best peer); shape "
                        f"{done}/{total}, ops done in about {eta:.0f} s",
                        flush=True,
                    )
                    write_report(report, out, stem)
                    gc.collect()
    if args.only in (None, "step"):
        shape = QUICK_STEP_SHAPE if args.quick else STEP_SHAPE
        timer = make_timer(platform, args.step_iterations)
        section = dict(
            date=time.strftime("%Y-%m-%d %H:%M"),
            rounds=args.step_rounds,
            iterations=args.step_iterations if platform != "cpu" else None,
            shape=shape,
            method=timer.method,
            results=[],
        )
        report["sections"]["step"] = section
        for mlp, dtype in QUICK_STEP_CONFIGS if args.quick else STEP_CONFIGS:
            if dtype not in args.dtypes:
                continue
            programs = prenorm_programs(mlp, dtype, platform, shape)
            rows = run_step_group("pre-norm stack", programs, platform, timer, args, shape)
            for r in rows:
                r.update(mlp=mlp, dtype=dtype)
            section["results"].extend(rows)
            section["method"] = timer.method
            print(
                f"{elapsed()} step {mlp} {dtype}: "
                + ", ".join(f"{r['norm']} {_ms(r.get('median_s'))} ms" for r in rows),
                flush=True,
            )
            write_report(report, out, stem)
            del programs
            gc.collect()
        for title, factory in EXTRA_STEPS.items():
            try:
                programs = factory(args.quick)
                rows = run_step_group(title, programs, platform, timer, args, {})
            except Exception as err:
                rows = [
                    dict(section="step", model=title, norm="", status="failed", note=_error(err))
                ]
            section["results"].extend(rows)
            print(f"{elapsed()} step {title}: done", flush=True)
            write_report(report, out, stem)
            gc.collect()
    write_report(report, out, stem, with_plot=True)
    print(report_markdown(report))
    print(f"{elapsed()} wrote {out / stem}.md, .json and .png", flush=True)
    report["out"], report["stem"] = str(out), stem
    return report


if __name__ == "__main__":
    main()
