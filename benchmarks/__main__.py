"""python -m benchmarks SECTION [--quick] [--target T] [--out DIR] ...

Each section answers one question, measured in one of three ways:

  device time   on the device jax sees: a GPU (CUPTI, the sum of the program's kernel
                times) or a TPU (the profiler trace's XLA Modules events);
  CPU wall      when that device is a CPU: wall-clock per call (XLA:CPU timings);
  estimate      with --target T (h100, tpu-v5e, tpu-v6e, ...): a deviceless compile for T,
                its temporary memory and the compiler's cost model (no hardware timing).

sections:
  ops        How fast is each norm on its own, and what does its backward keep?
             Forward and forward+backward of rms_norm (p = 1, 0.0625), the RMSNorm Module,
             add_rms_norm, gated_rms_norm and the fused kernels (implementation="pallas",
             not on CPU) against flax RMSNorm and LayerNorm, the plain formula under
             autodiff, the flax compositions of the fused ops, jax's Pallas rms_norm (GPU)
             and tokamax (where installed), beside a copy and a traffic baseline measured in
             the same rounds. Device time or CPU wall; x of 32 and 256 MiB, 1024-8192
             features, float32 and bfloat16.
             Writes OUT/<device>-measured.md, .json, .png (section "ops").
  step       What does a whole train step cost with each norm, in time and memory?
             An 8-layer pre-norm stack (d 2048, 16k tokens; SwiGLU and gelu, float32 and
             bfloat16) with each norm, the residual add fused (add_rms_norm), remat keeping
             only rms_norm_stat, and the x * scale floor. Device time or CPU wall, the
             compiled temporary memory and the device's peak memory.
             Writes OUT/<device>-measured.md, .json, .png (section "step").
  gemma      How do the norms compare inside a real model's train step, Gemma-3-style?
             Gemma 3 270M's shape, batch 8 x 1024, loss + grad + AdamW, per norm (each
             written the way one library or model writes it, and the x * (1 + scale)
             floor: by default on a device, when named in --norms with --target), blocks
             unrolled and under scan, each mode's norms in interleaved rounds.
             On the device jax sees: step device time and peak memory (on a CPU always the
             2-block config, a smoke run), into OUT/<device>-measured.* (section "gemma").
             With --target T: estimate: temporary memory, kernels, the compiler's estimate
             of the step and of its non-matmul part; writes OUT/gemma-<target>.md, .json.
  maxtext    Is our norm ever behind MaxText's own inside a MaxText-shaped model?
             Needs --target T: a Llama2-style decoder as MaxText builds it (4 layers, d
             1024, 8 heads of 128, MLP 3584, vocab 32,000, batch 4 x 1024; loss + grad +
             AdamW) with MaxText's norm (two roundings) and with ours, layers under scan
             and unrolled, remat full, minimal and none; estimate: temporary memory,
             kernels, the compiler's estimate of the step and of its non-matmul part,
             ours over MaxText's; writes OUT/maxtext-<target>-jax<version>.md, .json.
  estimates  What do the TPU and GPU compilers make of the ops and the pre-norm step?
             Needs --target T: estimate of the ops programs, the fused ops, the step's
             memory and kernels per MLP and a whole unrolled step; writes
             OUT/<target>.md, <target>-summary.md, <target>-fused.md, .json, -fused.json.

OUT is benchmarks/results/ unless --out is given. --quick: tiny shapes and few rounds, a
smoke run (every table and plot says "smoke run: not a measurement"), written to a new
temporary directory unless --out is given, so it never overwrites the committed results.
`python -m benchmarks SECTION --help` lists a section's options. benchmarks/README.md lists
the committed result files and the command that wrote each.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shlex
import sys
import time
from pathlib import Path

if "--target" in sys.argv or any(a.startswith("--target=") for a in sys.argv):
    # Deviceless compiles for TPU/GPU need the CPU runtime alone (rmsnorm_jax.aot), set
    # before jax is imported.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

from . import models, peers, report, timing

SECTIONS = ("ops", "step", "gemma", "maxtext", "estimates")
SIZES_MIB, QUICK_SIZES_MIB = (32, 256), (0.125,)
FEATURES, QUICK_FEATURES = (1024, 4096, 5120, 8192), (256,)
ESTIMATE_FEATURES = (256, 1024, 4096, 5120, 8192)
DTYPES = ("float32", "bfloat16")
STEP_CONFIGS = tuple((mlp, dtype) for mlp in ("swiglu", "gelu") for dtype in DTYPES)
QUICK_STEP_CONFIGS = (("swiglu", "bfloat16"), ("gelu", "float32"))  # each MLP, each dtype
STEP_SHAPE = dict(layers=8, d=2048, tokens=16384)
QUICK_STEP_SHAPE = dict(layers=2, d=64, tokens=128)
GEMMA_BATCH, QUICK_GEMMA_BATCH = (8, 1024), (2, 16)
QUICK_GEMMA_ESTIMATE_BATCH = (2, 64)
MAXTEXT_BATCH, QUICK_MAXTEXT_BATCH = (4, 1024), (2, 128)


# ---------------------------------------------------------------- the command line


def _doc_part(name: str) -> str:
    """A section's paragraph of this module's docstring."""
    lines = __doc__.split("sections:\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {name} "))
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i][:3].strip() or not lines[i]),
        len(lines),
    )
    return "\n".join(line[2:] for line in lines[start:end])


def parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    top = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=formatter,
    )
    sub = top.add_subparsers(dest="section", required=True, metavar="SECTION")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--quick",
        action="store_true",
        help="tiny shapes, few rounds: a smoke run, not a measurement",
    )
    common.add_argument(
        "--out",
        default=None,
        help="output directory (default: benchmarks/results, or a new temporary directory for "
        "--quick); a device run keeps the other sections of an earlier report there",
    )
    timed = argparse.ArgumentParser(add_help=False)
    timed.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 3)"
    )
    timed.add_argument(
        "--iterations", type=int, default=None, help="iterations per program and round on a device"
    )
    timed.add_argument(
        "--compile-workers",
        type=int,
        default=None,
        help="threads compiling programs (default: 8 on an accelerator, 1 on CPU)",
    )

    def section(name, parents):
        return sub.add_parser(
            name,
            parents=parents,
            help=_doc_part(name).splitlines()[0].split(None, 1)[1],
            description=_doc_part(name),
            formatter_class=formatter,
        )

    dtypes = argparse.ArgumentParser(add_help=False)
    dtypes.add_argument("--dtypes", default=",".join(DTYPES), help="comma separated")
    ops = section("ops", [common, dtypes, timed])
    ops.add_argument("--sizes", default=None, help="MiB of x, comma separated (default 32,256)")
    ops.add_argument("--features", default=None, help="comma separated (default 1024,...,8192)")
    section("step", [common, dtypes, timed])
    gemma = section("gemma", [common, timed])
    gemma.add_argument("--target", default=None, help="compile for T without it (an estimate)")
    gemma.add_argument(
        "--norms",
        default=None,
        help="comma separated, from: "
        + ", ".join(peers.gemma_norms("gpu"))
        + " (default: all; the pallas one on a GPU or TPU only; with --target all but "
        "the floor)",
    )
    gemma.add_argument("--modes", default="unrolled,scan")
    gemma.add_argument("--batch", type=int, default=None, help="default 8 (quick: 2)")
    gemma.add_argument(
        "--seq", type=int, default=None, help="default 1024 (quick: 16, 64 with --target)"
    )
    gemma.add_argument(
        "--hlo-dir", default=None, help="--target: also write each optimized program"
    )
    gemma.add_argument(
        "--merge",
        default=None,
        help="--target: a JSON of an earlier run: its records for the norms and modes not "
        "compiled in this run are kept",
    )
    maxtext = section("maxtext", [common])
    maxtext.add_argument("--target", required=True, help="h100, tpu-v5e, tpu-v6e, ...")
    maxtext.add_argument("--modes", default="scan,unrolled", help="layers: scan, unrolled")
    maxtext.add_argument(
        "--remats", default=",".join(models.REMAT_POLICIES), help="full, minimal, none"
    )
    maxtext.add_argument("--batch", type=int, default=None, help="default 4 (quick: 2)")
    maxtext.add_argument("--seq", type=int, default=None, help="default 1024 (quick: 128)")
    maxtext.add_argument("--hlo-dir", default=None, help="also write each optimized program there")
    estimates = section("estimates", [common, dtypes])
    estimates.add_argument("--target", required=True, help="h100, tpu-v5e, tpu-v6e, ...")
    estimates.add_argument(
        "--features", default=None, help="comma separated (default 256,1024,4096,5120,8192)"
    )
    estimates.add_argument("--mib", type=float, default=32.0, help="size of x per shape")
    for name, sp in sub.choices.items():
        if name in ("ops", "step"):
            sp.add_argument(
                "--target",
                default=None,
                help=argparse.SUPPRESS,  # refused with the command that does it
            )
    return top


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.section in ("ops", "step") and args.target:
        p.error(
            f"{args.section} measures on the device jax sees; for the compiler's estimates "
            f"without a device run: python -m benchmarks estimates --target {args.target}"
        )
    if hasattr(args, "dtypes"):
        args.dtypes = args.dtypes.split(",")
    if getattr(args, "rounds", None) is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    args.command = "python -m benchmarks " + shlex.join(argv)
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.section == "estimates":
        return run_estimates(args)
    if args.section == "gemma" and args.target:
        return run_gemma_estimates(args)
    if args.section == "maxtext":
        return run_maxtext_estimates(args)
    return run_device(args)


# ---------------------------------------------------------------- on the device jax sees


def run_device(args) -> dict:
    """``ops``, ``step`` or ``gemma`` on the default device, into ``<device>-measured.*``."""
    device = jax.devices()[0]
    platform = timing.device_platform(device)
    on_device = platform != "cpu"
    args.rounds = args.rounds or (3 if args.quick else 5)
    # A step is 10-100x an op: 10 iterations a round make the round medians of the steps
    # agree to about 1 % (the H200's spread with 2 was up to 10 %, issue 34).
    default_iterations = 10
    args.iterations = args.iterations or (1 if not on_device else default_iterations)
    if args.compile_workers is None:
        args.compile_workers = min(8, os.cpu_count() or 1) if on_device else 1
    out = report.output_dir(args.out, args.quick)
    stem = f"{report.device_slug(device)}-measured"
    rep = dict(
        device=device.device_kind if on_device else f"CPU ({report.cpu_model()})",
        platform=platform,
        machine=report.machine(),
        jax=jax.__version__,
        sections={},
    )
    previous = out / f"{stem}.json"
    if previous.exists():
        try:
            rep["sections"].update(json.loads(previous.read_text()).get("sections", {}))
        except (OSError, ValueError):
            pass
    timer = timing.make_timer(platform, args.iterations)
    where = timer.method if on_device else "CPU wall-clock"
    print(
        f"{args.section}: {report.machine()}; {where}; writing {out / stem}.md/.json/.png",
        flush=True,
    )
    start = time.perf_counter()
    earlier = rep["sections"].get(args.section)
    section = dict(
        command=args.command,
        machine=report.machine(),
        quick=args.quick,
        date=time.strftime("%Y-%m-%d %H:%M"),
        rounds=args.rounds,
        iterations=args.iterations if on_device else None,
        method=timer.method,
        results=[],
    )
    rep["sections"][args.section] = section

    def progress(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {text}", flush=True)
        section["method"] = timer.method
        report.write_report(rep, out, stem)
        gc.collect()

    if args.section == "ops":
        run_ops(args, platform, timer, section, progress)
    elif args.section == "step":
        run_step(args, platform, timer, section, progress)
    else:
        run_gemma(args, platform, timer, section, earlier, progress)
    report.write_report(rep, out, stem, with_plot=True)
    print(report.report_markdown(rep))
    progress(f"wrote {out / stem}.md, .json and .png")
    rep["out"], rep["stem"] = str(out), stem
    return rep


def measure_ops_shape(mib, features, dtype, platform, timer, args) -> list[dict]:
    """Every program of one shape in interleaved rounds; one row per program and kind."""
    itemsize = jnp.dtype(dtype).itemsize
    rows = max(8, int(mib * 2**20 / (itemsize * features)))
    x, other, scale, dy = peers.random_inputs(rows, features, jnp.dtype(dtype))
    progs = peers.op_programs(platform)
    programs, absent = {}, []
    for p in progs:
        for kind, fn in (("fwd", p.fwd), ("fwd+bwd", p.fwd_bwd)):
            if p.status != "ok":
                absent.append((p, kind))
            elif fn is not None:
                if p.group == "norm":
                    inputs = (x, scale) if kind == "fwd" else (x, scale, dy)
                else:
                    inputs = (x, other, scale) if kind == "fwd" else (x, other, scale, dy)
                programs[(p.impl, kind)] = (fn, inputs)
    compiled = timing.compile_all(programs, args.compile_workers)
    runnable = {k: v for k, v in compiled.items() if not isinstance(v, str)}
    timings = timing.interleaved(runnable, timer, args.rounds)
    by_impl = {p.impl: p for p in progs}

    def row_of(p, kind, **fields):
        moves = peers.BASELINE_MOVES.get(p.impl) or peers.MOVES[(p.group, kind)]
        return dict(
            section="ops",
            impl=p.impl,
            kind=kind,
            group=p.group,
            role=p.role,
            size_mib=mib,
            features=features,
            rows=rows,
            dtype=dtype,
            x_bytes=x.nbytes,
            moves=moves,
            **fields,
        )

    results = []
    for (impl, kind), value in compiled.items():
        p = by_impl[impl]
        row = row_of(p, kind, method=timer.method)
        if isinstance(value, str):
            row.update(status="failed", note=f"compile: {value}")
        else:
            row["status"] = "ok"
            row.update(timings[(impl, kind)])
            if p.role == "ours":
                row["uses_kernel"] = timing.uses_custom_kernel(value[0])
        if kind == "fwd+bwd" and p.role != "baseline" and row["status"] == "ok":
            args_ = (x, scale) if p.group == "norm" else (x, other, scale)
            row["residual_x"] = peers.residual_bytes(p.fwd, *args_) / x.nbytes
        results.append(row)
    for p, kind in absent:
        results.append(row_of(p, kind, status=p.status, note=p.note))
    report.add_op_ratios(results, with_bound=shows_bound(platform, args.quick))
    return results


def shows_bound(platform: str, quick: bool) -> bool:
    """Whether ``ops`` gives each program's "% of bound": in full runs on a GPU or TPU.

    Not in a smoke run (a copy of 0.125 MiB is launch overhead, not a bound), and not on
    a CPU: there the copy baseline's rate is no bound. XLA:CPU spends most of a copy into a
    fresh 32 MiB output on page faults (most of the benchmark's CPU time is system time,
    docs/cpu.md), which a program that writes less or reuses a buffer avoids; issue 35 saw
    programs at up to 505 % of the copy's rate, which no cache explains.
    """
    return not quick and platform != "cpu"


def run_ops(args, platform, timer, section, progress) -> None:
    sizes = args.sizes or ",".join(map(str, QUICK_SIZES_MIB if args.quick else SIZES_MIB))
    features = args.features or ",".join(map(str, QUICK_FEATURES if args.quick else FEATURES))
    sizes, features = [float(s) for s in sizes.split(",")], [int(f) for f in features.split(",")]
    total, done, ops_start = len(sizes) * len(args.dtypes) * len(features), 0, time.perf_counter()
    for mib in sizes:
        for dtype in args.dtypes:
            for f in features:
                rows = measure_ops_shape(mib, f, dtype, platform, timer, args)
                section["results"].extend(rows)
                done += 1
                eta = (time.perf_counter() - ops_start) / done * (total - done)
                rms = {r["kind"]: r for r in rows if r["impl"] == "rms_norm"}
                progress(
                    f"ops {mib:g} MiB {dtype} {f}: rms_norm fwd "
                    f"{report._us(rms['fwd'].get('median_s'))} us, fwd+bwd "
                    f"{report._us(rms['fwd+bwd'].get('median_s'))} us "
                    f"({report._x(rms['fwd+bwd'].get('vs_best_peer'))}x the best peer); shape "
                    f"{done}/{total}, done in about {eta:.0f} s"
                )


def step_programs(mlp: str, dtype: str, quick: bool, platform: str) -> dict:
    """``{norm: (step, (params, h))}``: the pre-norm stack's train step with each norm."""
    shape = QUICK_STEP_SHAPE if quick else STEP_SHAPE
    programs, params, h = {}, None, None
    for label, kw in peers.step_norms(platform).items():
        step, params_shapes = models.prenorm_stack_train_step(layers=shape["layers"], mlp=mlp, **kw)
        if params is None:
            params, h = models.step_inputs(
                params_shapes, shape["d"], shape["tokens"], jnp.dtype(dtype)
            )
        programs[label] = (step, (params, h))
    return programs


def run_step(args, platform, timer, section, progress) -> None:
    shape = QUICK_STEP_SHAPE if args.quick else STEP_SHAPE
    section["shape"] = shape
    for mlp, dtype in QUICK_STEP_CONFIGS if args.quick else STEP_CONFIGS:
        if dtype not in args.dtypes:
            continue
        programs = step_programs(mlp, dtype, args.quick, platform)
        own = ["step", "--mlp", mlp, "--dtype", dtype] + (["--quick"] if args.quick else [])
        rows = timing.measure_steps(
            programs,
            platform,
            timer,
            args.rounds,
            args.compile_workers,
            "flax RMSNorm",
            peak_command=lambda name, own=own: peak_command([*own, "--norm", name]),
        )
        for norm, row in rows.items():
            section["results"].append(
                dict(section="step", model="pre-norm stack", mlp=mlp, dtype=dtype, norm=norm)
                | shape
                | row
            )
        del programs
        progress(
            f"step {mlp} {dtype}: "
            + ", ".join(f"{n} {report._ms(r.get('median_s'))} ms" for n, r in rows.items())
        )


def peak_command(argv: list[str]) -> list[str]:
    """The command that measures one train step's peak in a process of its own."""
    return [sys.executable, "-m", "benchmarks.peak", *argv]


def _gemma_norms(args, platform: str | None) -> dict:
    """``--norms``; by default every norm on a device, and without the floor for --target
    (each deviceless compile of the full model takes minutes: name it to add it)."""
    norms = peers.gemma_norms(platform)
    if args.norms is None:
        return norms if platform else {n: f for n, f in norms.items() if n != peers.GEMMA_FLOOR}
    unknown = [n for n in args.norms.split(",") if n not in norms]
    if unknown:
        raise SystemExit(f"--norms: unknown {unknown}; choose from {list(norms)}")
    return {n: norms[n] for n in args.norms.split(",")}


def _gemma_modes(args) -> list[str]:
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in ("unrolled", "scan")]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; choose from unrolled, scan")
    return modes


def gemma_programs(mode: str, norms: dict, smoke: bool, batch: int, seq: int) -> dict:
    """``{norm: (step, inputs)}``: the Gemma-3-style train step with each norm."""
    cfg = models.SMALL if smoke else models.GEMMA3_270M
    scan = mode == "scan"
    inputs = models.gemma_inputs(cfg, scan, batch, seq)
    return {
        name: (models.gemma_train_step(cfg, norm, scan), inputs) for name, norm in norms.items()
    }


def run_gemma(args, platform, timer, section, earlier, progress) -> None:
    """The Gemma-3-style step on the device jax sees; a CPU runs the 2-block config."""
    smoke = args.quick or platform == "cpu"
    cfg = models.SMALL if smoke else models.GEMMA3_270M
    default = QUICK_GEMMA_BATCH if smoke else GEMMA_BATCH
    batch, seq = args.batch or default[0], args.seq or default[1]
    model = (
        f"`models.{'SMALL' if smoke else 'GEMMA3_270M'}` ({cfg.layers} blocks, d {cfg.d}, "
        f"vocab {cfg.vocab:,})"
    )
    section.update(quick=smoke, model=model, batch=batch, seq=seq)
    modes = _gemma_modes(args)
    if earlier and all(earlier.get(k) == section[k] for k in ("quick", "model", "batch", "seq")):
        # Another run of the same model measured other modes: keep them.
        section["results"] = [r for r in earlier["results"] if r["mode"] not in modes]
    norms = _gemma_norms(args, platform)
    for mode in modes:
        programs = gemma_programs(mode, norms, smoke, batch, seq)
        own = ["gemma", "--mode", mode, "--batch", str(batch), "--seq", str(seq)]
        own += ["--quick"] if smoke else []
        rows = timing.measure_steps(
            programs,
            platform,
            timer,
            args.rounds,
            args.compile_workers,
            peers.GEMMA_REFERENCE,
            peak_command=lambda name, own=own: peak_command([*own, "--norm", name]),
        )
        section["results"] = [r for r in section["results"] if r["mode"] != mode]
        for norm, row in rows.items():
            section["results"].append(dict(section="gemma", mode=mode, norm=norm) | row)
        section["results"].sort(key=lambda r: ("unrolled", "scan").index(r["mode"]))
        del programs
        progress(
            f"gemma {mode}: "
            + ", ".join(f"{n} {report._ms(r.get('median_s'))} ms" for n, r in rows.items())
        )


# ---------------------------------------------------------------- deviceless: --target


def _target(estimates, name: str):
    """The target, or the command's exit with the reason it cannot be estimated."""
    try:
        return estimates.target(name)
    except ValueError as err:
        raise SystemExit(f"python -m benchmarks: {err}") from None


def run_estimates(args) -> dict:
    """The compiler's estimates of the ops, the fused ops and the pre-norm step for T."""
    from . import estimates

    target = _target(estimates, args.target)
    features = args.features or ",".join(map(str, (256,) if args.quick else ESTIMATE_FEATURES))
    features = [int(f) for f in features.split(",")]
    mib = 0.25 if args.quick else args.mib
    out = report.output_dir(args.out, args.quick)
    stem = target.name.replace(":", "_")
    print(f"estimates for {target.name}; writing {out / stem}*.md/.json", flush=True)
    results, fused = [], []
    for dtype in args.dtypes:
        itemsize = jnp.dtype(dtype).itemsize
        for f in features:
            rows = max(8, int(mib * 2**20 / (itemsize * f)))
            results.extend(estimates.estimate_shape(target, rows, f, jnp.dtype(dtype)))
            cost = estimates.estimate_fused(target, rows, f, jnp.dtype(dtype))
            x, other, scale, _ = (
                jax.ShapeDtypeStruct(s, jnp.dtype(dtype))
                for s in ((rows, f), (rows, f), (f,), (rows, f))
            )
            for name, fn in peers.FUSED.items():
                fused.append(
                    dict(
                        impl=name,
                        features=f,
                        rows=rows,
                        dtype=jnp.dtype(dtype).name,
                        fwd_bwd=cost[name],
                        vs_composition=cost[name] / cost[peers.COMPOSITION.get(name, name)],
                        residual_x=peers.residual_bytes(fn, x, other, scale)
                        / (rows * f * itemsize),
                    )
                )
            print(f"compiled: {target.name} {dtype} {rows}x{f}", flush=True)
    shapes = dict(
        memory=dict(layers=2, d=256, tokens=512)
        if args.quick
        else dict(layers=8, d=2048, tokens=16384),
        cost=dict(layers=1, d=256, tokens=512)
        if args.quick
        else dict(layers=2, d=1024, tokens=8192),
    )
    memory = estimates.train_step_memory(
        target, mlps=("swiglu",) if args.quick else models.MLPS, **shapes["memory"]
    )
    print(f"compiled: {target.name} train steps (memory, kernels)", flush=True)
    cost = estimates.train_step_cost(target, dtypes=args.dtypes, **shapes["cost"])
    header = report.estimates_header(target, args.command, args.quick, mib)
    tables = report.step_tables(target, memory, cost, shapes)
    out.mkdir(parents=True, exist_ok=True)
    rep = dict(
        target=target.name,
        unit=target.estimate_unit,
        command=args.command,
        quick=args.quick,
        jax=jax.__version__,
        results=results,
        memory=memory,
        step_cost=cost,
        shapes=shapes,
    )
    (out / f"{stem}.json").write_text(json.dumps(rep, indent=1))
    (out / f"{stem}.md").write_text(
        header + report.estimates_markdown(target, results) + "\n\n" + tables
    )
    summary = header + report.summary_markdown(results) + "\n\n" + tables
    (out / f"{stem}-summary.md").write_text(summary)
    (out / f"{stem}-fused.json").write_text(json.dumps(fused, indent=1))
    (out / f"{stem}-fused.md").write_text(report.fused_markdown(target, fused, header) + "\n")
    print(summary)
    rep["fused"], rep["out"], rep["stem"] = fused, str(out), stem
    return rep


def _write_hlo(hlo_dir: str | None, prefix: str, norm: str, compiled) -> None:
    """With ``--hlo-dir``: the optimized program as ``<prefix>-<norm>.txt`` there."""
    if not hlo_dir or compiled is None:
        return
    hlo = Path(hlo_dir)
    hlo.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() else "_" for c in norm)
    (hlo / f"{prefix}-{safe}.txt").write_text(compiled.as_text())


def run_gemma_estimates(args) -> dict:
    """The Gemma-3-style step compiled for T, each norm in each mode."""
    from . import estimates

    target = _target(estimates, args.target)
    cfg = models.SMALL if args.quick else models.GEMMA3_270M
    default = QUICK_GEMMA_ESTIMATE_BATCH if args.quick else GEMMA_BATCH
    batch, seq = args.batch or default[0], args.seq or default[1]
    norms, modes = list(_gemma_norms(args, None)), _gemma_modes(args)
    order = list(peers.gemma_norms(None))
    stem = "gemma-" + target.name.replace(":", "_") + ("-quick" if args.quick else "")
    out = report.output_dir(args.out, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    print(f"gemma for {target.name}; writing {out / stem}.md/.json", flush=True)
    header = report.gemma_header(target, cfg, batch, seq, args.command, args.quick)
    records = json.loads(Path(args.merge).read_text())["records"] if args.merge else []
    for mode in modes:
        for name in norms:
            record, compiled = estimates.gemma_step(target, cfg, name, mode, batch, seq)
            records = [r for r in records if (r["norm"], r["mode"]) != (name, mode)]
            records.append(record)
            records.sort(
                key=lambda r: (estimates.GEMMA_MODES.index(r["mode"]), order.index(r["norm"]))
            )
            _write_hlo(args.hlo_dir, f"{stem}-{mode}", name, compiled)
            print(json.dumps(record), flush=True)
            report.gemma_relative(records)
            saved = dict(
                target=target.name,
                unit=target.estimate_unit,
                command=args.command,
                quick=args.quick,
                records=records,
            )
            (out / f"{stem}.json").write_text(json.dumps(saved, indent=1))
            (out / f"{stem}.md").write_text(header + report.gemma_markdown(target, records) + "\n")
    print(header + report.gemma_markdown(target, records))
    return dict(saved, out=str(out), stem=stem)


def _choices(value: str, allowed, option: str) -> list[str]:
    chosen = value.split(",")
    unknown = [c for c in chosen if c not in allowed]
    if unknown:
        raise SystemExit(f"{option}: unknown {unknown}; choose from {', '.join(allowed)}")
    return chosen


def run_maxtext_estimates(args) -> dict:
    """The MaxText-shaped step compiled for T: each norm, layer mode and remat policy."""
    from . import estimates

    target = _target(estimates, args.target)
    cfg = models.MAXTEXT_QUICK if args.quick else models.MAXTEXT_TABLES
    default = QUICK_MAXTEXT_BATCH if args.quick else MAXTEXT_BATCH
    batch, seq = args.batch or default[0], args.seq or default[1]
    modes = _choices(args.modes, estimates.MAXTEXT_MODES, "--modes")
    remats = _choices(args.remats, models.REMAT_POLICIES, "--remats")
    stem = (
        "maxtext-"
        + target.name.replace(":", "_")
        + f"-jax{jax.__version__}"
        + ("-quick" if args.quick else "")
    )
    out = report.output_dir(args.out, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    print(f"maxtext for {target.name}; writing {out / stem}.md/.json", flush=True)
    header = report.maxtext_header(
        target, cfg, batch, seq, args.command, args.quick, jax.__version__
    )
    records = []
    saved = {}
    for mode in modes:
        for remat in remats:
            for name in peers.MAXTEXT_NORMS:
                record, compiled = estimates.maxtext_step(
                    target, cfg, name, mode, remat, batch, seq
                )
                records.append(record)
                _write_hlo(args.hlo_dir, f"{stem}-{mode}-{remat}", name, compiled)
                print(json.dumps(record), flush=True)
                report.maxtext_relative(records)
                saved = dict(
                    target=target.name,
                    unit=target.estimate_unit,
                    jax=jax.__version__,
                    command=args.command,
                    quick=args.quick,
                    config=dict(dataclasses.asdict(cfg), dtype=jnp.dtype(cfg.dtype).name),
                    batch=batch,
                    seq=seq,
                    records=records,
                )
                (out / f"{stem}.json").write_text(json.dumps(saved, indent=1))
                (out / f"{stem}.md").write_text(
                    header + report.maxtext_markdown(target, records) + "\n"
                )
    print(header + report.maxtext_markdown(target, records))
    return dict(saved, out=str(out), stem=stem)


if __name__ == "__main__":
    main()
