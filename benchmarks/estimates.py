"""``estimates --target T``: each program compiled deviceless for one device of a TPU or GPU
(``rmsnorm_jax.aot``), read back as temporary memory, kernels and the cost model's estimates
(TPU cycles, GPU microseconds): no hardware timing, a loop body counts once."""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rmsnorm_jax import aot

from . import models, peers, report
from .peers import IMPLEMENTATIONS, NORM_PEERS, scale_only

FEATURES = (256, 1024, 4096, 5120, 8192)
MEMORY_FLOOR = peers.STEP_FLOOR
MEMORY_NORMS = ("rms_norm", "add_rms_norm", *NORM_PEERS, MEMORY_FLOOR)
COST_NORMS = ("rms_norm", *NORM_PEERS)
GEMMA_MODES, MAXTEXT_MODES = ("unrolled", "scan"), ("scan", "unrolled")
DEVICELESS = (
    "Every number is from a deviceless compile: temp memory from the compiled program, estimates "
    "in {} from the compiler's cost model (not a hardware timing). Under `scan` a loop body "
    "counts once in the estimates and kernels."
)


def target(name: str) -> aot.Target:
    """The target called ``name``; a SystemExit where its compiler has no cost model."""
    if (found := aot.get_target(name)).estimate_unit is None:
        tpus = ", ".join(n for n in aot.target_names() if n.startswith("tpu"))
        raise SystemExit(
            f"python -m benchmarks: --target {name}: the compiler has no cost model for "
            f"{found.name} in this jaxlib, so there is nothing to estimate (its programs still "
            f"compile, with their memory: `python examples/train_lm.py --compile-for {name}`, "
            f"or rmsnorm_jax.aot); pick h100 or a TPU ({tpus})."
        )
    return found


def header(t: aot.Target, command: str, quick: bool) -> str:
    """The first words of a deviceless section's page."""
    smoke = report.caption(quick) + "\n\n" * quick
    return smoke + f"Target: {t.name} ({t.devices[0].device_kind}); written by `{command}`"


def begin(args, section: str, suffix: str = "") -> tuple:
    """``(target, out, stem, head)`` of a deviceless section written to ``<section>-<target>``."""
    t, out = target(args.target), report.output_dir(args.out, args.quick)
    stem = f"{section}-{t.name.replace(':', '_')}{suffix}" + "-quick" * args.quick
    print(f"{section} for {t.name}; writing {out / stem}.md/.json", flush=True)
    return t, out, stem, header(t, args.command, args.quick)


def unit(t: aot.Target) -> str:
    return {"cycles": "TPU cycles", "us": "microseconds"}[t.estimate_unit]


def _num(t: aot.Target):
    return (lambda v: f"{v:,.1f}") if t.estimate_unit == "us" else (lambda v: f"{v:,.0f}")


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``; None without a base or where it is 0 (a TPU compiler can keep a
    small step's temporaries on chip, leaving 0 bytes in HBM)."""
    return None if value is None or not base else value / base


def _compile(t: aot.Target, fn, *shapes, donate=()):
    """``fn`` compiled for one device of ``t`` on ``ShapeDtypeStruct`` trees."""
    mesh = jax.sharding.Mesh(t.devices[:1], ("d",))
    structs = jax.tree.map(lambda s: aot.struct(s.shape, s.dtype, mesh, P()), shapes)
    return t.compile(jax.jit(fn, donate_argnums=donate), *structs)


def _estimate(t: aot.Target, fn, *shapes) -> tuple[float, int]:
    kernels = aot.kernels(_compile(t, fn, *shapes), t)
    return sum(k.estimate for k in kernels), len(kernels)


# ---------------------------------------------------------------- isolated ops


def estimate_shape(t: aot.Target, rows: int, features: int, dtype) -> list[dict]:
    """Per implementation and the baselines: the estimates and kernels of the forward and
    forward+backward, their ratios to the baselines and the speed-up over flax RMSNorm."""
    x, s = jax.ShapeDtypeStruct((rows, features), dtype), jax.ShapeDtypeStruct((features,), dtype)
    programs = {"baseline": (peers.copy_baseline, peers.traffic_baseline)}
    programs |= {name: (fn, peers.forward_backward(fn)) for name, fn in IMPLEMENTATIONS.items()}
    results = []
    for name, (fwd, fwd_bwd) in programs.items():
        (f, fk), (fb, fbk) = _estimate(t, fwd, x, s), _estimate(t, fwd_bwd, x, s, x)
        row = dict(impl=name, rows=rows, features=features, dtype=jnp.dtype(dtype).name)
        results.append(row | dict(fwd=f, fwd_kernels=fk, fwd_bwd=fb, fwd_bwd_kernels=fbk))
    (base, *_), flax = results, next(r for r in results if r["impl"] == "flax RMSNorm")
    for r in results:
        r["fwd_vs_baseline"], r["fwd_bwd_vs_baseline"] = (
            r["fwd"] / base["fwd"],
            r["fwd_bwd"] / base["fwd_bwd"],
        )
        r["fwd_bwd_speedup_vs_flax"] = flax["fwd_bwd"] / r["fwd_bwd"]
    return results


def estimate_fused(t: aot.Target, rows: int, features: int, dtype) -> list[dict]:
    """Per fused op and composition: the forward+backward estimate, over the composition's,
    and the residuals in bytes(x)."""
    x, s = jax.ShapeDtypeStruct((rows, features), dtype), jax.ShapeDtypeStruct((features,), dtype)
    fb = peers.forward_backward
    cost = {n: _estimate(t, fb(fn), x, x, s, x)[0] for n, fn in peers.FUSED.items()}
    out = []
    for name, fn in peers.FUSED.items():
        vs = cost[name] / cost[peers.COMPOSITION.get(name, name)]
        kept = peers.residual_bytes(fn, x, x, s) / (x.size * x.dtype.itemsize)
        row = dict(impl=name, features=features, rows=rows, dtype=jnp.dtype(dtype).name)
        out.append(row | dict(fwd_bwd=cost[name], vs_composition=vs, residual_x=kept))
    return out


# ---------------------------------------------------------------- kernels of a program

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.-]+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.-]+)")
_MATMUL = re.compile(r"\b(?:dot|convolution)\(|__cublas|__triton_gemm|cudnn")


def _computations(text: str) -> dict[str, str]:
    """The body of every computation of an HLO module, by name."""
    bodies, name, lines = {}, None, []
    for line in text.splitlines():
        match = _COMPUTATION.match(line)
        if match and not line.startswith(" "):
            name, lines = match.group(1), []
        elif line.startswith("}") and name is not None:
            bodies[name], name = "\n".join(lines), None
        elif name is not None:
            lines.append(line)
    return bodies


def _is_matmul(line: str, bodies: dict[str, str], depth: int = 0) -> bool:
    """Whether an instruction holds a dot or a convolution, itself or in what it calls."""
    if _MATMUL.search(line):
        return True
    calls = _CALLS.findall(line) if depth <= 3 else []
    return any(_is_matmul(bodies.get(c, ""), bodies, depth + 1) for c in calls)


def kernel_fields(compiled, t: aot.Target) -> dict:
    """A step's kernels: how many, the matmuls (a dot or convolution, or cuBLAS and cuDNN)
    and the rest with their estimates, and the five costliest of the rest."""
    text, lines = compiled.as_text(), {}
    for line in text.splitlines():
        if match := re.match(r"^\s*(?:ROOT\s+)?%?([\w.-]+)\s*=", line):
            lines.setdefault(match.group(1), line)
    bodies, matmul, other = _computations(text), [], []
    for k in aot.kernels(compiled, t):
        (matmul if _is_matmul(lines.get(k.name, ""), bodies) else other).append(k)
    costliest = [(k.name, k.estimate) for k in sorted(other, key=lambda k: -k.estimate)[:5]]
    mm, rest = sum(k.estimate for k in matmul), sum(k.estimate for k in other)
    fields = dict(kernels=len(matmul) + len(other), matmul_kernels=len(matmul), matmul_estimate=mm)
    return fields | dict(other_kernels=len(other), other_estimate=rest, costliest_other=costliest)


def _step_record(t: aot.Target, record: dict, compile_step) -> tuple:
    """``(record, compiled)`` with temp memory, :func:`kernel_fields`, the estimates of the
    step and of its non-matmul kernels; ``compiled`` None where the TPU compiler refused
    the step for its HBM (``fits`` False, ``temp_bytes`` what it asked for)."""
    start = time.perf_counter()
    try:
        compiled = compile_step()
    except jax.errors.JaxRuntimeError as err:
        if not (need := re.search(r"HLO temporaries \(([\d.]+)G\)", str(err))):
            raise
        record.update(fits=False, temp_bytes=float(need.group(1)) * 2**30)
        return record | dict(compile_s=time.perf_counter() - start), None
    fields = kernel_fields(compiled, t)
    record.update(fits=True, temp_bytes=compiled.memory_analysis().temp_size_in_bytes, **fields)
    record.update(step=fields["matmul_estimate"] + fields["other_estimate"])
    record.update(non_matmul=fields["other_estimate"], compile_s=time.perf_counter() - start)
    return record, compiled


# ---------------------------------------------------------------- the train steps


def compile_train_step(t: aot.Target, norm, d: int, tokens: int, dtype, **model):
    """One SGD step of :func:`models.prenorm_stack_train_step` for one device of ``t``."""
    step, shapes = models.prenorm_stack_train_step(norm, **model)
    h = jax.ShapeDtypeStruct((tokens, d), jnp.dtype(dtype))
    return _compile(t, step, shapes(d, jnp.dtype(dtype)), h, donate=0)


def train_step_memory(t, norm_names=MEMORY_NORMS, d=2048, tokens=16384, mlps=models.MLPS, layers=8):
    """Per MLP and norm, one bfloat16 step (``lax.scan`` over ``layers``): temp bytes and
    kernels, ``vs_flax`` and ``vs_floor`` (the ``x * scale`` step's)."""
    norms, out = {**IMPLEMENTATIONS, "add_rms_norm": None, MEMORY_FLOOR: scale_only}, []
    for mlp in mlps:
        for name in norm_names:
            model = dict(mlp=mlp, layers=layers)
            step = lambda f=norms[name], m=model: compile_train_step(
                t, f, d, tokens, "bfloat16", **m
            )
            out.append(_step_record(t, dict(mlp=mlp, norm=name), step)[0])
        temp = {r["norm"]: r["temp_bytes"] for r in out if r["mlp"] == mlp}
        for r in out[-len(norm_names) :]:
            r["vs_flax"] = ratio(r["temp_bytes"], temp.get("flax RMSNorm"))
            r["vs_floor"] = ratio(r["temp_bytes"], temp.get(MEMORY_FLOOR))
    return out


def train_step_cost(
    t, norm_names=COST_NORMS, d=1024, tokens=8192, dtypes=("float32", "bfloat16"), layers=2
):
    """Per dtype and norm, the estimate of a whole SwiGLU step with its scan unrolled (``dy``
    comes back through a matmul from ``y``, unlike in the isolated programs)."""
    out = []
    for dtype in dtypes:
        for name in norm_names:
            compiled = compile_train_step(
                t, IMPLEMENTATIONS[name], d, tokens, dtype, layers=layers, unroll=True
            )
            out.append(dict(dtype=dtype, norm=name, step=aot.estimate(compiled, t)))
        for r in out[-len(norm_names) :]:
            ours = out[-len(norm_names)]["step"]
            r.update(vs_ours=ratio(r["step"], ours), minus_ours=r["step"] - ours)
    return out


def gemma_step(t, cfg: models.Config, name: str, mode: str, batch: int, seq: int):
    """``(record, compiled)`` of the Gemma-3-style step with one norm, ``unrolled`` or ``scan``."""
    step = models.gemma_train_step(cfg, peers.gemma_norms()[name], mode == "scan")
    shapes = models.gemma_step_shapes(cfg, mode == "scan", batch, seq)
    record = dict(norm=name, mode=mode, batch=batch, seq=seq, layers=cfg.layers)
    return _step_record(t, record, lambda: _compile(t, step, *shapes, donate=(0, 1)))


def maxtext_step(t, cfg: models.MaxTextConfig, name, mode: str, remat: str, batch: int, seq: int):
    """``(record, compiled)`` of the MaxText-shaped step with one norm, mode and remat."""
    step = models.maxtext_train_step(cfg, peers.MAXTEXT_NORMS[name], mode == "scan", remat)
    shapes = models.maxtext_step_shapes(cfg, mode == "scan", batch, seq)
    record = dict(norm=name, mode=mode, remat=remat, batch=batch, seq=seq, layers=cfg.layers)
    return _step_record(t, record, lambda: _compile(t, step, *shapes, donate=(0, 1)))


def add_ratios(records: list[dict], baseline: str, group: tuple[str, ...], suffix: str) -> None:
    """Each record's temp, step and non-matmul over those of the ``baseline`` norm in its
    group (``<key>_vs_<suffix>``), and its kernels minus that norm's."""
    for r in records:
        same = [b for b in records if b["norm"] == baseline and all(b[k] == r[k] for k in group)]
        for key in ("temp_bytes", "step", "non_matmul") if same else ():
            if r.get(key) is not None and same[0].get(key):
                r[f"{key}_vs_{suffix}"] = r[key] / same[0][key]
        if same and r.get("kernels") is not None and same[0].get("kernels") is not None:
            r[f"kernels_minus_{suffix}"] = r["kernels"] - same[0]["kernels"]


# ---------------------------------------------------------------- the section

QUICK_SHAPES = dict(
    memory=dict(layers=2, d=256, tokens=512), cost=dict(layers=1, d=256, tokens=512)
)
SHAPES = dict(memory=dict(layers=8, d=2048, tokens=16384), cost=dict(layers=2, d=1024, tokens=8192))


def run(args) -> dict:
    """The ops, fused ops and pre-norm step for ``--target``: ``<target>.md``, ``.json``,
    ``-summary.md``, ``-fused.md``, ``-fused.json``."""
    t, mib = target(args.target), 0.25 if args.quick else args.mib
    shapes = QUICK_SHAPES if args.quick else SHAPES
    out, stem = report.output_dir(args.out, args.quick), t.name.replace(":", "_")
    print(f"estimates for {t.name}; writing {out / stem}*.md/.json", flush=True)
    results, fused = [], []
    for dtype in map(jnp.dtype, args.dtypes):
        for f in report.numbers(args.features, (256,) if args.quick else FEATURES):
            rows = max(8, int(mib * 2**20 / (dtype.itemsize * f)))
            results += estimate_shape(t, rows, f, dtype)
            fused += estimate_fused(t, rows, f, dtype)
            print(f"compiled: {t.name} {dtype} {rows}x{f}", flush=True)
    mlps = ("swiglu",) if args.quick else models.MLPS
    memory = train_step_memory(t, mlps=mlps, **shapes["memory"])
    cost = train_step_cost(t, dtypes=args.dtypes, **shapes["cost"])
    head = header(t, args.command, args.quick) + f"; estimates in {unit(t)} from the compiler's "
    head += (
        f"cost model of a deviceless compile (not a hardware timing); x = {mib:g} MiB per shape."
    )
    steps = step_tables(t, memory, cost, shapes)
    saved = dict(target=t.name, unit=t.estimate_unit, command=args.command, quick=args.quick)
    saved |= dict(
        jax=jax.__version__, results=results, memory=memory, step_cost=cost, shapes=shapes
    )
    report.write(out, stem, saved, f"{head}\n\n{ops_table(t, results)}\n\n{steps}")
    (out / f"{stem}-summary.md").write_text(f"{head}\n\n{summary_table(results)}\n\n{steps}")
    fused_head = f"{head} Fused ops against hand-written flax compositions (`flax.linen.RMSNorm`)."
    report.write(out, f"{stem}-fused", fused, f"{fused_head}\n\n{fused_table(t, fused)}")
    print((out / f"{stem}-summary.md").read_text())
    return saved | dict(fused=fused, out=str(out), stem=stem)


def ops_table(t, results: list[dict]) -> str:
    num, u = _num(t), t.estimate_unit
    head = f"features | dtype | implementation | fwd ({u}) | kernels | fwd / copy | fwd+bwd ({u}) "
    head += "| kernels | fwd+bwd / traffic | fwd+bwd speed-up vs flax"
    rows = [f"{r['features']} | {r['dtype']} | {r['impl']} | {num(r['fwd'])} | {r['fwd_kernels']} "
            f"| {r['fwd_vs_baseline']:.2f} | {num(r['fwd_bwd'])} | {r['fwd_bwd_kernels']} | "
            f"{r['fwd_bwd_vs_baseline']:.2f} | {r['fwd_bwd_speedup_vs_flax']:.2f}x"
            for r in results]  # fmt: skip
    return report.table(head, rows, "rrlrrrrrrr")


def summary_table(results: list[dict]) -> str:
    """Per shape and dtype: rms_norm (p = 1) against the baselines and peers."""
    rows = []
    for f, dtype in dict.fromkeys((r["features"], r["dtype"]) for r in results):
        at = {r["impl"]: r for r in results if (r["features"], r["dtype"]) == (f, dtype)}
        ours, best = at["rms_norm"], min(at[p]["fwd_bwd"] for p in NORM_PEERS)
        ups = ", ".join(f"{at[k]['fwd_bwd_speedup_vs_flax']:.2f}x" for k in list(at)[1:4])
        rows.append(f"{f} | {dtype} | {ours['fwd_vs_baseline']:.2f} | "
                    f"{ours['fwd_bwd_vs_baseline']:.2f} | "
                    f"{ours['fwd_bwd'] / best:.2f} | {ups}")  # fmt: skip
    head = "features | dtype | fwd / copy | fwd+bwd / traffic | fwd+bwd vs best peer "
    return report.table(head + "| fwd+bwd speed-up vs flax (p=1, p=0.0625, module)", rows, "rlrrrr")


def fused_table(t, fused: list[dict]) -> str:
    head = f"features | dtype | implementation | fwd+bwd ({t.estimate_unit}, estimate) "
    rows = [f"{r['features']} | {r['dtype']} | {r['impl']} | {r['fwd_bwd']:,.2f} "
            f"| {r['vs_composition']:.2f} | {r['residual_x']:.2f}" for r in fused]  # fmt: skip
    return report.table(head + "| vs composition | residuals / bytes(x)", rows, "rllrrr")


def step_tables(t, memory: list[dict], cost: list[dict], shapes: dict) -> str:
    """The train-step part of ``<target>.md`` and ``-summary.md``."""
    (mem, cst), num, u = shapes.values(), _num(t), t.estimate_unit
    mlps, norms = (list(dict.fromkeys(r[k] for r in memory)) for k in ("mlp", "norm"))
    dtypes = list(dict.fromkeys(r["dtype"] for r in cost))
    by, by_cost = (
        {(r["mlp"], r["norm"]): r for r in memory},
        {(r["dtype"], r["norm"]): r for r in cost},
    )

    def temp(r):
        return f"{r['temp_bytes'] / 2**20:,.0f}" + ("" if r["fits"] else " (does not fit)")

    def kernels(r):
        if not r["fits"]:
            return f"{r['mlp']} | {r['norm']} | | | | does not fit |"
        costliest = ", ".join(f"{k} {num(e)}" for k, e in r["costliest_other"][:3])
        return (f"{r['mlp']} | {r['norm']} | {r['kernels']} | {r['matmul_kernels']} "
                f"({num(r['matmul_estimate'])}) | {r['other_kernels']} "
                f"({num(r['other_estimate'])}) | {r['temp_bytes'] / 2**20:,.0f} "
                f"| {costliest}")  # fmt: skip

    memory_head = "norm | " + " | ".join(f"{m} MLP: MiB | vs flax" for m in mlps)
    memory_rows = [[n, *(f"{temp(by[m, n])} | {report.x(by[m, n]['vs_flax'])}" for m in mlps)]
                   for n in norms]  # fmt: skip
    kernel_head = f"mlp | norm | kernels | matmul kernels (estimate, {u}) "
    kernel_head += f"| other kernels (estimate, {u}) | temp MiB | costliest other kernels"
    cost_head = "norm | " + " | ".join(f"{d} step ({u}) | minus rms_norm's" for d in dtypes)
    cell = lambda r: f"{r['step']:,.0f} | {r['minus_ours']:+,.0f}"
    cost_rows = [
        [n, *(cell(by_cost[d, n]) for d in dtypes)] for n in dict.fromkeys(r["norm"] for r in cost)
    ]
    memory_table = report.table(memory_head, memory_rows, "l" + "rr" * len(mlps))
    kernel_table = report.table(kernel_head, map(kernels, memory), "llrrrrl")
    cost_table = report.table(cost_head, cost_rows, "l" + "rr" * len(dtypes))
    return (
        f"Train step: {mem['layers']} pre-norm blocks (two norms, a linear token mixer, an MLP: "
        f"relu or gelu 4x, SwiGLU 8/3x), bfloat16, `lax.scan`, d = {mem['d']}, {mem['tokens']} "
        "tokens; temporary memory per device. `x * scale (floor)` keeps what any norm with a "
        "learnable scale before a matmul must keep (x, for the scale's gradient): no norm can go "
        f"below it.\n\n{memory_table}\n\nThe same steps' kernels (a matmul kernel holds a dot "
        f"or a convolution, or calls cuBLAS or cuDNN; a loop body counts once):\n\n{kernel_table}"
        f"\n\nA whole step, the compiler's estimate ({cst['layers']} SwiGLU blocks, unrolled, "
        f"d = {cst['d']}, {cst['tokens']} tokens): y feeds a matmul and dy comes back through it, "
        "so XLA cannot compute y inside the backward's reduction kernel as in the isolated "
        f"programs.\n\n{cost_table}\n"
    )
