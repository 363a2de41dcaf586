"""The numbers of the README, docs/ and the notebook, read back from the committed results
files they come from: a number that a results file no longer gives fails here.

Two ways a page ties a number to its file:

- a table right below ``<!-- rows from PATH -->`` (an HTML comment, invisible on the
  rendered page) copies rows of the results file ``PATH``: each of its rows with a digit
  must be a row of that file, verbatim;
- a claim below (``CLAIMS``): a sentence of a page with its numbers left as ``{names}``,
  the results files, and how each number follows from them (a range over several runs
  where the number depends on the machine). The page must hold the sentence with the
  numbers the files give (whitespace aside) and name the files' directory.

Results files: ``benchmarks/results/`` (``benchmarks/results/README.md`` gives each one's
command and commit) and ``examples/results/`` (``examples/reproduce.py``; each file holds
its command, commit, Python, versions and machine).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = "benchmarks/results"
EXAMPLE = "examples/results"
ROWS_FROM = re.compile(r"^<!-- rows from (\S+) -->$")


def _load(*patterns: str) -> list[dict]:
    """Every JSON file under ROOT matching one of ``patterns``, in their order (each
    pattern's files in name order)."""
    files = []
    for pattern in patterns:
        paths = sorted(ROOT.glob(pattern))
        assert paths, f"no results file matches {pattern}"
        files += [json.loads(p.read_text()) for p in paths]
    return files


def _span(values, fmt: str, sep: str = "-") -> str:
    """``min-max`` of ``values`` in ``fmt``; one value where both format alike."""
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}{sep}{high}"


def _normalised(text: str) -> str:
    return " ".join(text.split())


@dataclasses.dataclass(frozen=True)
class Claim:
    page: str
    text: str  # as on the page, with {name} for each number
    sources: tuple[str, ...]  # globs of results files under ROOT
    values: Callable[[list[dict]], dict[str, str]]

    @property
    def id(self) -> str:
        return f"{self.page}: {self.text[:50]}"


# ---------------------------------------------------------------- XLA:CPU (docs/cpu.md)


def _cpu_results(files):
    (saved,) = files
    at = {(r["impl"], r["features"], r["dtype"]): r for r in saved["results"]}
    shapes = sorted({(f, d) for _, f, d in at})
    return at, shapes


def _cpu_speedups(files):
    at, shapes = _cpu_results(files)

    def over_flax(impl, dtypes=("float32", "bfloat16")):
        return [at[(impl, f, d)]["speedup_vs_flax"] for f, d in shapes if d in dtypes]

    def ours_over(peers):
        return [
            at[("rms_norm", f, d)]["fwd_bwd_s"] / min(at[(p, f, d)]["fwd_bwd_s"] for p in peers)
            for f, d in shapes
        ]

    return {
        "flax": _span(ours_over(["flax RMSNorm"]), ".2f"),
        "all": _span(over_flax("rms_norm"), ".1f", "x to "),
        "bf16": _span(over_flax("rms_norm", ("bfloat16",)), ".1f", "x to "),
        "plain": _span(ours_over(["jnp + autodiff"]), ".2f"),
        "best": _span(ours_over(["flax RMSNorm", "flax LayerNorm", "jnp + autodiff"]), ".2f"),
        "p1": _span(over_flax("rms_norm"), ".2f"),
        "p0625": _span(over_flax("rms_norm p=0.0625"), ".2f"),
        "traffic256": f"{1e3 * at[('baseline', 256, 'bfloat16')]['fwd_bwd_s']:.0f}",
        "traffic1024": f"{1e3 * at[('baseline', 1024, 'bfloat16')]['fwd_bwd_s']:.0f}",
    }


def _cpu_runs_glance(files):
    """The README's XLA:CPU row: forward+backward of ``rms_norm`` over flax RMSNorm, the
    plain formula and the best of those and flax LayerNorm, as ranges over the shapes and
    over the runs (each run a ``python -m benchmarks ops`` report on the 2-core CPU)."""
    medians = [_ops_medians(saved) for saved in files]
    ratios = _over_peers(
        (median[(*shape, "fwd+bwd", "rms_norm")], [median[(*shape, "fwd+bwd", p)] for p in PEERS])
        for median in medians
        for shape in sorted({key[:3] for key in median})
    )
    return {"runs": str(len(files)), **{k: _span(v, ".2f") for k, v in ratios.items()}}


# ---------------------------------------------------------------- estimates


def _whole_step(files):
    """docs/estimates.md's whole-step table: the peers' estimate over ours, per target."""
    cells = {}
    for saved in files:
        by = {(r["dtype"], r["norm"]): r["vs_ours"] for r in saved["step_cost"]}
        for dtype in ("float32", "bfloat16"):
            cells[f"{saved['target'].split(':')[0]} {dtype}"] = ", ".join(
                f"{by[(dtype, peer)]:.3f}"
                for peer in ("flax RMSNorm", "flax LayerNorm", "jnp + autodiff")
            )
    return {
        f"{target.replace('-', '_')}_{dtype}": value
        for (target, dtype), value in ((k.split(), v) for k, v in cells.items())
    }


def _h100_step(files):
    (saved,) = files
    by = {(r["dtype"], r["norm"]): r for r in saved["step_cost"]}
    out = {}
    for dtype in ("float32", "bfloat16"):
        out[f"ours_{dtype}"] = f"{by[(dtype, 'rms_norm')]['step']:,.0f}"
        for key, peer in (
            ("rms", "flax RMSNorm"),
            ("ln", "flax LayerNorm"),
            ("plain", "jnp + autodiff"),
        ):
            out[f"{key}_{dtype}"] = f"{by[(dtype, peer)]['minus_ours']:+.0f}"
    return out


# ---------------------------------------------------------------- the example


def _version(saved: dict) -> str:
    return f"Python {saved['python'].rsplit('.', 1)[0]}, jax {saved['versions']['jax']}"


def _default_runs(files):
    """The default run's table of docs/example.md, one column per results file, and the
    README's ranges over every run."""
    rows = {
        "runs of the command": lambda f: str(len(f["runs"])),
        "wall time of the whole command (imports, compile, 600 steps, 6 evaluations)": (
            lambda f: _span([r["command_wall_s"] / 60 for r in f["runs"]], ".1f") + " min"
        ),
        "time in train steps": lambda f: _span([r["train_s"] for r in f["runs"]], ".0f") + " s",
        "median step": lambda f: _span([r["median_step_s"] for r in f["runs"]], ".2f") + " s",
        "final validation loss": (
            lambda f: "**" + _span([r["final_val_loss"] for r in f["runs"]], ".3f") + " nats/byte**"
        ),
        "unigram entropy of the corpus's bytes (best context-free model)": (
            lambda f: _span([r["unigram_entropy"] for r in f["runs"]], ".3f") + " nats/byte"
        ),
        "load average of the machine when a run started (2 cores, shared)": (
            lambda f: _span([r["loadavg_before"] for r in f["runs"]], ".0f")
        ),
    }
    lines = [
        "| | " + " | ".join(_version(f) for f in files) + " |",
        "|---|" + "---|" * len(files),
        *(
            f"| {name} | " + " | ".join(cell(f) for f in files) + " |"
            for name, cell in rows.items()
        ),
    ]
    runs = [r for f in files for r in f["runs"]]
    return {
        "table": "\n".join(lines),
        "minutes": _span([r["command_wall_s"] / 60 for r in runs], ".0f"),
        "loss": _span([r["final_val_loss"] for r in runs], ".3f"),
        "versions": " and ".join(_version(f) for f in files),
    }


def _compare_runs(files):
    """--compare's table of docs/example.md (ranges over every run of every file), the
    ratios to LayerNorm and the spread of the final losses between the norms."""
    runs = [run["rows"] for f in files for run in f["runs"]]
    norms = [r["norm"] for r in runs[0]]

    def over_runs(norm, key, fmt, scale=1.0):
        return _span(
            [scale * next(r[key] for r in rows if r["norm"] == norm) for rows in runs], fmt
        )

    lines = [
        "| norm | median step (ms) | vs LayerNorm | final val loss | training (s) |",
        "|---|---|---|---|---|",
        *(
            f"| {n} | {over_runs(n, 'median_step_ms', '.0f')} "
            f"| {over_runs(n, 'vs_layernorm', '.2f')} | {over_runs(n, 'final_val_loss', '.3f')} "
            f"| {over_runs(n, 'wall_time_s', '.0f')} |"
            for n in norms
        ),
    ]
    losses = [[r["final_val_loss"] for r in rows] for rows in runs]
    loads = [run["loadavg_before"] for f in files for run in f["runs"]]
    return {
        "load": _span(loads, ".0f"),
        "table": "\n".join(lines),
        "runs": str(len(runs)),
        "rms": over_runs("rmsnorm", "vs_layernorm", ".2f"),
        "prms": over_runs("prmsnorm", "vs_layernorm", ".2f"),
        "step_ms": _span([r["median_step_ms"] for rows in runs for r in rows], ".0f"),
        "loss_spread": _span([max(run) - min(run) for run in losses], ".2f"),
        "versions": " and ".join(_version(f) for f in files),
    }


def _compile_for(files):
    """docs/example.md's table of the large config compiled for a pod and a GPU node."""
    lines = [
        "| jax (Python) | target, mesh | parameters and optimizer state | temporaries "
        "| estimated step |",
        "|---|---|---:|---:|---:|",
    ]
    for saved in files:
        for target, report in saved["targets"].items():
            estimate, unit = report["step_estimate"], report["estimate_unit"]
            step = (
                f"{estimate / 1e6:,.1f}M cycles"
                if unit == "cycles"
                else f"{estimate / 1e3:,.0f} ms"
            )
            mesh = ",".join(str(v) for v in report["mesh"].values())
            lines.append(
                f"| {saved['versions']['jax']} ({saved['python'].rsplit('.', 1)[0]}) "
                f"| `{target}`, {mesh} | {report['state_mib']:,.0f} MiB "
                f"| {report['temp_mib']:,.0f} MiB | {step} |"
            )
    return {"table": "\n".join(lines)}


def _example_both(files):
    """The README's and the notebook's figures: the default runs' and --compare's."""
    default = _default_runs([f for f in files if f["what"] == "default"])
    compare = _compare_runs([f for f in files if f["what"] == "compare"])
    return {**compare, **{k: v for k, v in default.items() if k in ("minutes", "loss")}}


# ---------------------------------------------------------------- the H200 (the README)

H200_GEMMA = f"{BENCH}/h200-8292fdf/h200-measured.json"
H200_KERNELS = f"{BENCH}/h200-4ce9679/h200-measured.json"


H200_FIRST = f"{BENCH}/h200-e634bc7/h200-measured.json"
CPU_RUNS = f"{BENCH}/cpu-ce97396/run*/cpu-measured.json"
H200_FIRST_GEMMA = f"{BENCH}/h200-e634bc7/h200-measured-gemma.json"
PEERS = ("flax RMSNorm", "jnp + autodiff", "flax LayerNorm")


def _ops_medians(saved) -> dict:
    """``{(x MiB, features, dtype, kind, implementation): median seconds}`` of a device
    report's ``ops`` section, for the programs that ran."""
    return {
        (r["size_mib"], r["features"], r["dtype"], r["kind"], r["impl"]): r["median_s"]
        for r in saved["sections"]["ops"]["results"]
        if r.get("status") == "ok"
    }


def _over_peers(pairs) -> dict[str, list[float]]:
    """For each ``(ours, [each of PEERS])`` pair of times: ours over flax RMSNorm's
    (``"flax"``), over the plain formula's (``"plain"``) and over the best of PEERS'."""
    ratios = {"flax": [], "plain": [], "best": []}
    for ours, peers in pairs:
        ratios["flax"].append(ours / peers[0])
        ratios["plain"].append(ours / peers[1])
        ratios["best"].append(ours / min(peers))
    return ratios


def _h200_glance(files):
    """The README's "At a glance" rows measured on the H200: ``rms_norm`` over flax
    RMSNorm, over the plain formula under autodiff, and over the best of those and flax
    LayerNorm, as ranges over the shapes (ops) or the four train steps (step)."""
    (saved,) = files
    out = {}
    median = _ops_medians(saved)
    shapes = sorted({key[:3] for key in median})
    for kind, dtypes, name in (
        ("fwd", ("bfloat16",), "fwd_bf16"),
        ("fwd", ("float32",), "fwd_f32"),
        ("fwd+bwd", ("bfloat16", "float32"), "fb"),
    ):
        ratios = _over_peers(
            (median[(*shape, kind, "rms_norm")], [median[(*shape, kind, p)] for p in PEERS])
            for shape in shapes
            if shape[2] in dtypes
        )
        for peer, values in ratios.items():
            out[f"{name}_{peer}"] = _span(values, ".2f")
        if name == "fwd_bf16":
            out["faster"] = _span([1 / v for v in ratios["flax"]], ".1f")
    step = {(r["mlp"], r["dtype"], r["norm"]): r for r in saved["sections"]["step"]["results"]}
    configs = sorted({key[:2] for key in step})
    assert len(configs) == 4  # SwiGLU and gelu, bfloat16 and float32
    times = _over_peers(
        (step[(*config, "rms_norm")]["median_s"], [step[(*config, p)]["median_s"] for p in PEERS])
        for config in configs
    )
    for peer, values in times.items():
        out[f"step_{peer}"] = _span(values, ".2f")
    out["spread"] = format(
        100
        * max(
            step[(*config, norm)]["max_s"] / step[(*config, norm)]["min_s"] - 1
            for config in configs
            for norm in ("rms_norm", *PEERS)
        ),
        ".0f",
    )
    temp = {norm: step[("swiglu", "bfloat16", norm)]["temp_bytes"] for norm in ("rms_norm", *PEERS)}
    out["mem_flax"] = f"{temp['rms_norm'] / temp[PEERS[0]]:.2f}"
    out["mem_plain"] = f"{temp['rms_norm'] / temp[PEERS[1]]:.2f}"
    out["mem_best"] = f"{temp['rms_norm'] / min(temp[p] for p in PEERS):.2f}"
    return out


def _tpu_glance(files):
    """The README's TPU row: forward+backward estimates of ``rms_norm`` over flax RMSNorm,
    the plain formula and the best peer, over every shape of TPU v5e and v6e."""
    ratios = {"flax": [], "plain": [], "best_bfloat16": [], "best_float32": []}
    for saved in files:
        est = {
            (r["impl"], r["rows"], r["features"], r["dtype"]): r["fwd_bwd"]
            for r in saved["results"]
        }
        for impl, rows, features, dtype in est:
            if impl != "rms_norm":
                continue
            ours = est[(impl, rows, features, dtype)]
            peers = [est[(p, rows, features, dtype)] for p in PEERS]
            ratios["flax"].append(ours / peers[0])
            ratios["plain"].append(ours / peers[1])
            ratios[f"best_{dtype}"].append(ours / min(peers))
    return {name: _span(values, ".2f") for name, values in ratios.items()}


def _step_vs_layernorm(files):
    """The README's footnote 4: the whole-step estimate of LayerNorm and flax RMSNorm
    against ours, over H100, TPU v5e and v6e, both dtypes."""
    less, apart = [], []
    for saved in files:
        for row in saved["step_cost"]:
            if row["norm"] == "flax LayerNorm":
                less.append(100 * (1 - 1 / row["vs_ours"]))
            elif row["norm"] == "flax RMSNorm":
                apart.append(100 * abs(1 - 1 / row["vs_ours"]))
    return {"less": _span(less, ".1f"), "apart": f"{max(apart):.1f}"}


def _h200_gemma(files):
    """The Gemma-3-style step under ``scan``: rms_norm over Gemma's own norm."""
    (saved,) = files
    rows = {r["norm"]: r for r in saved["sections"]["gemma"]["results"] if r["mode"] == "scan"}
    ours, theirs = rows["rms_norm"], rows["gemma's own"]
    assert ours["peak_is_own"] and theirs["peak_is_own"]  # each peak from its own process
    return {
        key: f"{ours[field] / theirs[field]:.2f}"
        for key, field in (("time", "median_s"), ("temp", "temp_bytes"), ("peak", "peak_bytes"))
    }


def _h200_gemma_memory(files):
    """The README's unrolled row and footnote 2: compiled temp of the Gemma-3-style step,
    unrolled and under ``scan``, ours over each peer's (the first H200 run)."""
    (saved,) = files
    temp = {(r["mode"], r["norm"]): r["temp_bytes"] for r in saved["sections"]["gemma"]["results"]}
    peers = ("flax nnx RMSNorm", "jnp + autodiff", "flax linen RMSNorm")

    def ours_over(mode, *norms):
        return f"{temp[(mode, 'rms_norm')] / min(temp[(mode, n)] for n in norms):.2f}"

    return {
        "u_flax": ours_over("unrolled", peers[0]),
        "u_plain": ours_over("unrolled", peers[1]),
        "u_best": ours_over("unrolled", *peers),
        "u_gemma": ours_over("unrolled", "gemma's own"),
        "s_flax": ours_over("scan", peers[0]),
        "s_gemma": ours_over("scan", "gemma's own"),
        "s_floor": f"{temp[('scan', 'x * (1 + scale) (floor)')] / temp[('scan', 'rms_norm')]:.2f}",
    }


STACK_TARGETS = tuple(f"{BENCH}/{t}.json" for t in ("h100", "tpu-v5e_2x2", "tpu-v6e_2x2"))


def _stack_memory_table(files):
    """docs/memory.md's table: the pre-norm stack's temp memory per MLP and target."""
    mlps = (("relu", "relu, 4x"), ("gelu", "gelu (tanh), 4x"), ("swiglu", "SwiGLU, 8/3x"))
    lines = [
        "| MLP | norm | H100 (MiB) | vs flax | TPU v5e (MiB) | vs flax | TPU v6e (MiB) | vs flax |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mlp, label in mlps:
        for i, norm in enumerate(("rms_norm", "flax RMSNorm", "x * scale (floor)")):
            cells = [label if i == 0 else "", norm]
            for saved in files:
                row = next(r for r in saved["memory"] if (r["mlp"], r["norm"]) == (mlp, norm))
                fits = "" if row["fits"] else "*"
                cells += [f"{round(row['temp_bytes'] / 2**20):,}{fits}", f"{row['vs_flax']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return {"table": "\n".join(lines)}


def _stack_memory(files):
    """docs/memory.md's reading of that table: bytes(x) is 16k tokens x 2048 bfloat16, and
    the step has 17 norms (two per block of 8, and the final one)."""
    x_bytes, norms, mlps = 16384 * 2048 * 2, 17, ("relu", "gelu", "swiglu")
    temp = {(f["target"], r["mlp"], r["norm"]): r["temp_bytes"] for f in files for r in f["memory"]}
    cases = [(f["target"], mlp) for f in files for mlp in mlps]

    def ours_over(norm, t, mlp):
        return temp[(t, mlp, "rms_norm")] / temp[(t, mlp, norm)]

    flax_minus_ours = [
        temp[(*c[:1], c[1], "flax RMSNorm")] - temp[(*c[:1], c[1], "rms_norm")] for c in cases
    ]
    above = [temp[(t, m, "rms_norm")] - temp[(t, m, "x * scale (floor)")] for t, m in cases]
    v5e = files[1]["target"]
    return {
        "per_norm": _span([d / x_bytes / norms for d in flax_minus_ours], ".1f"),
        "above": f"{max(above) / x_bytes:.0f}",
        "above_pct": f"{100 * max(ours_over('x * scale (floor)', *c) - 1 for c in cases):.0f}",
        **{
            mlp: _span([ours_over("flax RMSNorm", f["target"], mlp) for f in files], ".2f")
            for mlp in mlps
        },
        **{
            key: f"{temp[(v5e, 'swiglu', norm)] / 2**30:.1f}"
            for key, norm in (
                ("ours", "rms_norm"),
                ("flax", "flax RMSNorm"),
                ("ln", "flax LayerNorm"),
            )
        },
        "add": f"{100 * max(abs(1 / ours_over('add_rms_norm', *c) - 1) for c in cases):.0f}",
    }


FUSED = tuple(f"{BENCH}/{f}.json" for f in ("fused", "h100-fused", "tpu-v5e_2x2-fused"))


def _fused_table(files):
    """docs/llm-layers.md's table: the fused ops' residuals and forward+backward cost
    against their compositions, CPU, H100 and TPU v5e side by side."""
    cpu, *_ = files
    pairs = (("add_rms_norm", "flax RMSNorm + add"), ("gated_rms_norm", "flax RMSNorm * silu"))

    def row_of(saved, impl, n, dtype):
        return next(r for r in saved if (r["impl"], r["features"], r["dtype"]) == (impl, n, dtype))

    lines = [
        "| features | dtype | add_rms_norm: residuals / bytes(x), ours vs flax + add "
        "| fwd+bwd vs flax + add: CPU, H100, v5e | gated_rms_norm: residuals, ours vs flax "
        "* silu | fwd+bwd vs flax * silu: CPU, H100, v5e |",
        "|---:|---|---|---|---|---|",
    ]
    for dtype in ("float32", "bfloat16"):
        for n in sorted({r["features"] for r in cpu}):
            cells = [str(n), dtype]
            for ours, theirs in pairs:
                kept = [row_of(cpu, impl, n, dtype)["residual_x"] for impl in (ours, theirs)]
                cells.append(f"{kept[0]:.2f} vs {kept[1]:.2f}")
                cost = [row_of(saved, ours, n, dtype)["vs_composition"] for saved in files]
                cells.append(", ".join(f"{c:.2f}" for c in cost))
            lines.append("| " + " | ".join(cells) + " |")
    return {"table": "\n".join(lines)}


def _h200_kernels(files):
    """Forward+backward with ``implementation="pallas"`` over the XLA path, per op."""
    (saved,) = files
    median = _ops_medians(saved)
    ratios = [
        (impl.split()[0], n, t / median[(mib, n, dtype, kind, impl.split()[0])])
        for (mib, n, dtype, kind, impl), t in median.items()
        if kind == "fwd+bwd" and impl.endswith("[pallas]")
    ]
    assert len(ratios) == 2 * 2 * 2 * 4  # two ops, two sizes, two dtypes, four widths
    rms = [r for op, n, r in ratios if op == "rms_norm" and n <= 5120]
    wide = [r for op, n, r in ratios if op == "rms_norm" and n > 5120]
    add = [r for op, _, r in ratios if op == "add_rms_norm"]
    return {"rms": _span(rms, ".2f"), "wide": _span(wide, ".2f"), "add": _span(add, ".2f")}


EXAMPLE_RUNS = (f"{EXAMPLE}/default-*.json", f"{EXAMPLE}/compare-*.json")

CLAIMS = [
    Claim(
        "README.md",
        "in a whole train step ours costs {less} % less than LayerNorm, within {apart} % of "
        "flax RMSNorm",
        tuple(f"{BENCH}/{t}.json" for t in ("h100", "tpu-v5e_2x2", "tpu-v6e_2x2")),
        _step_vs_layernorm,
    ),
    Claim(
        "README.md",
        "| forward+backward, TPU v5e/v6e | *{flax}x* | *{plain}x* | *{best_bfloat16}x* bf16; "
        "*{best_float32}x* f32⁴ | *estimate*: [estimates](docs/estimates.md) |",
        (f"{BENCH}/tpu-v5e_2x2.json", f"{BENCH}/tpu-v6e_2x2.json"),
        _tpu_glance,
    ),
    Claim(
        "README.md",
        "| forward+backward, XLA:CPU | **{flax}x** | **{plain}x** | **{best}x** | 2-core CPU, "
        "measured, {runs} runs at ce97396 (`cpu-measured.json`): [CPU](docs/cpu.md) |",
        (CPU_RUNS,),
        _cpu_runs_glance,
    ),
    Claim(
        "README.md",
        "| train-step memory, layers under `scan` or remat | **{mem_flax}x** | **{mem_plain}x** "
        "| **{mem_best}x** | H200, measured¹: compiled temp, SwiGLU bf16 |",
        (H200_FIRST,),
        _h200_glance,
    ),
    Claim(
        "README.md",
        "| train-step memory, layers unrolled | {u_flax}x | {u_plain}x | {u_best}x "
        "| H200, measured²: compiled temp, Gemma-3-style step;",
        (H200_FIRST_GEMMA,),
        _h200_gemma_memory,
    ),
    Claim(
        "README.md",
        "unrolled, ours needs {u_gemma}x the compiled temp of Gemma's own norm; under `scan`, "
        "{s_flax}x flax nnx RMSNorm's and {s_gemma}x Gemma's own. Under `scan` that is nearly "
        "all a norm can save: the floor, `x * (1 + scale)`, needs {s_floor}x ours",
        (H200_FIRST_GEMMA,),
        _h200_gemma_memory,
    ),
    Claim(
        "README.md",
        "| forward time, bfloat16 | **{fwd_bf16_flax}x** ({faster}x faster) | {fwd_bf16_plain}x "
        "| {fwd_bf16_best}x (the plain formula) | H200, measured¹ |",
        (H200_FIRST,),
        _h200_glance,
    ),
    Claim(
        "README.md",
        "| forward time, float32 | {fwd_f32_flax}x | {fwd_f32_plain}x | {fwd_f32_best}x "
        "| H200, measured¹ |",
        (H200_FIRST,),
        _h200_glance,
    ),
    Claim(
        "README.md",
        "| forward+backward time | **{fb_flax}x** | **{fb_plain}x** | **{fb_best}x** "
        "| H200, measured¹;",
        (H200_FIRST,),
        _h200_glance,
    ),
    Claim(
        "README.md",
        "| whole train step time | {step_flax}x | {step_plain}x | {step_best}x "
        "| H200, measured¹: within the rounds' spread³ |",
        (H200_FIRST,),
        _h200_glance,
    ),
    Claim(
        "README.md",
        "³ 3 rounds of 2 iterations: a program's fastest and slowest iterations lie up to "
        "{spread} % apart there.",
        (H200_FIRST,),
        _h200_glance,
    ),
    Claim(
        "README.md",
        "| Gemma-3-style train step under `scan`, vs Gemma's own norm | time **{time}x**, "
        "compiled temp **{temp}x**, peak **{peak}x** |",
        (H200_GEMMA,),
        _h200_gemma,
    ),
    Claim(
        "README.md",
        "forward+backward vs our XLA path | `rms_norm` **{rms}x** (1024-5120 features), "
        "`add_rms_norm` **{add}x** |",
        (H200_KERNELS,),
        _h200_kernels,
    ),
    Claim(
        "README.md",
        "On an NVIDIA H200 (head 4ce9679) forward+backward takes {add}x our XLA path's time "
        "for `add_rms_norm` and {rms}x for `rms_norm` up to 5120 features ({wide}x at 8192).",
        (H200_KERNELS,),
        _h200_kernels,
    ),
    Claim(
        "README.md",
        "(RMSNorm, embedded corpus, {minutes} min on 2 shared CPU cores)",
        EXAMPLE_RUNS,
        _example_both,
    ),
    Claim(
        "README.md",
        "On the 2-core CPU the default run took {minutes} minutes to a validation loss of "
        "{loss} nats/byte, and a step with RMSNorm took {rms}x the time of one with LayerNorm "
        "(pRMSNorm {prms}x), over the runs in `examples/results/`",
        EXAMPLE_RUNS,
        _example_both,
    ),
    Claim("docs/example.md", "{table}", (f"{EXAMPLE}/default-*.json",), _default_runs),
    Claim("docs/example.md", "{table}", (f"{EXAMPLE}/compare-*.json",), _compare_runs),
    Claim(
        "docs/example.md",
        "({runs} runs, {versions}; load average {load} on the 2 shared cores when they "
        "started), as ranges over the runs:",
        (f"{EXAMPLE}/compare-*.json",),
        _compare_runs,
    ),
    Claim(
        "docs/example.md",
        "A train step with RMSNorm took {rms}x the time of one with LayerNorm on this model, "
        "and {prms}x with pRMSNorm (p = 0.0625)",
        (f"{EXAMPLE}/compare-*.json",),
        _compare_runs,
    ),
    Claim(
        "docs/example.md",
        "The three norms' final validation losses after 300 steps lie {loss_spread} "
        "nats/byte apart in each run",
        (f"{EXAMPLE}/compare-*.json",),
        _compare_runs,
    ),
    Claim(
        "notebooks/rmsnorm_tour.ipynb",
        "in the example's 300-step runs of its default model (d_model 128, 3 layers) the "
        "three end {loss_spread} nats/byte apart ({runs} runs, {versions}: "
        "[examples/results](../examples/results/))",
        (f"{EXAMPLE}/compare-*.json",),
        _compare_runs,
    ),
    Claim(
        "notebooks/rmsnorm_tour.ipynb",
        "The README says that a step with RMSNorm takes {rms}x the time of one with LayerNorm "
        "(pRMSNorm {prms}x), over the committed runs of `python examples/train_lm.py "
        "--compare --steps 300 --eval-every 50` ([examples/results](../examples/results/)): "
        "the default model (d_model 128, 3 layers, 32 x 128 tokens a step) in the example's "
        "own process (one CPU device) on this project's shared 2-core machine, {step_ms} ms "
        "a step.",
        (f"{EXAMPLE}/compare-*.json",),
        _compare_runs,
    ),
    Claim(
        "docs/example.md",
        "{table}",
        (f"{EXAMPLE}/compile-for-*.json",),
        _compile_for,
    ),
    Claim("docs/memory.md", "{table}", STACK_TARGETS, _stack_memory_table),
    Claim(
        "docs/memory.md",
        "the temporaries differ by {per_norm}x bytes(x) for each of the 17 norms, and ours are "
        "at the floor (at most {above}x bytes(x) above it for the whole step, {above_pct} %; "
        "below it on H100). What the ratio to flax's step comes to depends on what the rest of "
        "the block keeps: {relu} with a relu MLP, {swiglu} with SwiGLU, {gelu} with the tanh gelu",
        STACK_TARGETS,
        _stack_memory,
    ),
    Claim(
        "docs/memory.md",
        "On a 16 GiB TPU v5e the SwiGLU step fits with our norm ({ours} GiB of temporaries) and "
        "does not with flax's RMSNorm or LayerNorm ({flax} and {ln} GiB). `add_rms_norm` (every "
        "residual add fused into the next norm) needs what the unfused `rms_norm` step needs "
        "(within {add} %).",
        STACK_TARGETS,
        _stack_memory,
    ),
    Claim("docs/llm-layers.md", "{table}", FUSED, _fused_table),
    Claim(
        "docs/cpu.md",
        "over the shapes and the runs, forward+backward of `rms_norm` takes {flax}x the time of "
        "flax RMSNorm, {plain}x the plain formula's under autodiff and {best}x the best of "
        "those and flax LayerNorm.",
        (CPU_RUNS,),
        _cpu_runs_glance,
    ),
    Claim(
        "docs/cpu.md",
        "forward+backward is {all} faster than `flax.linen.RMSNorm` on every shape and dtype "
        "({bf16} in bfloat16)",
        (f"{BENCH}/results.json",),
        lambda f: {k: v + "x" for k, v in _cpu_speedups(f).items() if k in ("all", "bf16")},
    ),
    Claim(
        "docs/cpu.md",
        "against the plain formula under autodiff it takes {plain}x the time, and {best}x "
        "the best of flax RMSNorm, flax LayerNorm and the plain formula",
        (f"{BENCH}/results.json",),
        _cpu_speedups,
    ),
    Claim(
        "docs/cpu.md",
        "(the traffic baseline took {traffic256} ms at 256 bfloat16 features and "
        "{traffic1024} ms at 1024)",
        (f"{BENCH}/results.json",),
        _cpu_speedups,
    ),
    Claim(
        "docs/cpu.md",
        "Its forward+backward is {p0625}x faster than flax's (the table's middle speed-up), "
        "against {p1}x for p = 1.",
        (f"{BENCH}/results.json",),
        _cpu_speedups,
    ),
    Claim(
        "docs/estimates.md",
        "| H100 | {h100_float32} | {h100_bfloat16} | "
        "| TPU v5e | {tpu_v5e_float32} | {tpu_v5e_bfloat16} | "
        "| TPU v6e | {tpu_v6e_float32} | {tpu_v6e_bfloat16} |",
        (f"{BENCH}/h100.json", f"{BENCH}/tpu-v5e_2x2.json", f"{BENCH}/tpu-v6e_2x2.json"),
        _whole_step,
    ),
    Claim(
        "docs/estimates.md",
        "`rms_norm` {ours_float32} in float32 and {ours_bfloat16} in bfloat16; flax RMSNorm "
        "{rms_float32} and {rms_bfloat16}; flax LayerNorm {ln_float32} and {ln_bfloat16}; "
        "plain autodiff {plain_float32} and {plain_bfloat16})",
        (f"{BENCH}/h100.json",),
        _h100_step,
    ),
]


def _page_text(page: str) -> str:
    """A page's text; of a notebook, its markdown cells."""
    text = (ROOT / page).read_text()
    if page.endswith(".ipynb"):
        cells = json.loads(text)["cells"]
        text = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return text


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.id)
def test_claim_reads_back_from_its_results(claim):
    page = _page_text(claim.page)
    expected = claim.text.format(**claim.values(_load(*claim.sources)))
    assert _normalised(expected) in _normalised(page), (
        f"{claim.page} should say, from {', '.join(claim.sources)}:\n  {expected}"
    )
    for source in claim.sources:
        directory, name = source.rsplit("/", 1)
        assert directory in page or name in page, f"{claim.page} quotes {source} unnamed"


def _tables_from_results() -> list[tuple[str, int, str, list[str]]]:
    """(page, line, results file, the table's rows) for each ``<!-- rows from -->``."""
    found = []
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            match = ROWS_FROM.match(line.strip())
            if not match:
                continue
            start = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("|"))
            end = next((j for j in range(start, len(lines)) if not lines[j].startswith("|")), None)
            rows = lines[start : end or len(lines)]
            found.append((page.relative_to(ROOT).as_posix(), i + 1, match.group(1), rows))
    return found


TABLES = _tables_from_results()


def test_pages_mark_the_tables_they_copy():
    marked = {(page, source) for page, _, source, _ in TABLES}
    assert (("docs/cpu.md", f"{BENCH}/summary.md")) in marked
    assert {
        ("docs/estimates.md", f"{BENCH}/{t}-summary.md")
        for t in ("h100", "tpu-v5e_2x2", "tpu-v6e_2x2")
    } <= marked


@pytest.mark.parametrize("page, line, source, rows", TABLES, ids=lambda v: str(v)[:40])
def test_table_rows_are_rows_of_their_results_file(page, line, source, rows):
    path = ROOT / source
    assert path.is_file(), f"{page}:{line} names {source}, which does not exist"
    known = {row.strip() for row in path.read_text().splitlines() if row.startswith("|")}
    numbered = [r for r in rows if re.search(r"\d", r) and not re.fullmatch(r"[|\-: ]+", r)]
    assert numbered, f"{page}:{line}: no numbers under the marker"
    missing = [r for r in numbered if r.strip() not in known]
    assert not missing, f"{page}:{line}: rows not in {source}:\n" + "\n".join(missing)


def test_a_wrong_number_fails():
    """The checks can fail: a claim whose page says something else, and a row changed."""
    claim = next(c for c in CLAIMS if "faster than `flax.linen.RMSNorm`" in c.text)
    claim = dataclasses.replace(claim, text=claim.text.replace("faster", "slower"))
    with pytest.raises(AssertionError, match="should say"):
        test_claim_reads_back_from_its_results(claim)
    page, line, source, rows = next(t for t in TABLES if t[0] == "docs/cpu.md")
    changed = [rows[0], rows[1], rows[2].replace("|", "| 9", 1), *rows[3:]]
    with pytest.raises(AssertionError, match="rows not in"):
        test_table_rows_are_rows_of_their_results_file(page, line, source, changed)


def test_every_at_a_glance_row_reads_back():
    """No row of the README's table of figures escapes the claims: each row with a number
    holds the text of one of the README's claims up to its first number."""
    readme = (ROOT / "README.md").read_text()
    glance = readme[readme.index("## At a glance") : readme.index("## Quickstart")]
    starts = [c.text.split("{")[0] for c in CLAIMS if c.page == "README.md"]
    rows = [
        line
        for line in glance.splitlines()
        if line.startswith("| ") and re.search(r"\d", line) and not line.startswith("|---")
    ]
    assert len(rows) >= 10
    unclaimed = [row for row in rows if not any(s in row for s in starts if s)]
    assert not unclaimed, unclaimed
