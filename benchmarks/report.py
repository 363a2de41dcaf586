"""What the benchmarks write: the derived ratios, markdown tables, JSON and plots.

Device runs (``ops``, ``step``, ``gemma`` on the device jax sees) share one report per
device, ``<out>/<device>-measured.{md,json,png}``, one entry per section in ``sections``
(a run of one section keeps the others): :func:`write_report`. Deviceless runs write
``<target>.md``, ``<target>-summary.md``, ``<target>-fused.md`` (``estimates``) and
``gemma-<target>.md`` (``gemma --target``), ``maxtext-<target>-jax<version>.md``
(``maxtext``), each with its JSON.

Labels: a ``--quick`` run says :data:`SMOKE` above each of its tables and in each plot;
"% of bound" is shown only where the copy baseline was measured in the same rounds of a
full run, and a value above 100 % carries a footnote that says why it can be.
"""

from __future__ import annotations

import json
import os
import platform
import re
import tempfile
from pathlib import Path

import numpy as np

SMOKE = "smoke run: not a measurement"
RESULTS_DIR = Path(__file__).parent / "results"


# ---------------------------------------------------------------- where and on what


def output_dir(out: str | None, quick: bool, prefix: str = "benchmarks") -> Path:
    """Where a run writes: ``out`` if given; for a ``--quick`` run a new temporary directory
    (a smoke run never overwrites the committed results); else ``benchmarks/results/``."""
    if out is not None:
        return Path(out)
    if quick:
        return Path(tempfile.mkdtemp(prefix=f"{prefix}-quick-"))
    return RESULTS_DIR


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    import jax

    dev = jax.devices()[0]
    if dev.platform == "cpu":
        where = f"{cpu_model()}, {os.cpu_count()} cores"
    else:
        where = f"{jax.device_count()} x {dev.device_kind}"
    return f"{where} ({dev.platform}), jax {jax.__version__}"


def device_slug(device) -> str:
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind
    gpu = re.search(r"\b(H100|H200|H20|A100|B200|B100|GB200|L40S|L4|A10G?)\b", kind)
    if gpu:
        return gpu.group(1).lower()
    tpu = re.fullmatch(r"TPU v(\d+)( lite|e|p)?", kind.strip())
    if tpu:
        suffix = {" lite": "e", "e": "e", "p": "p", None: ""}[tpu.group(2)]
        return f"tpu-v{tpu.group(1)}{suffix}"
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or device.platform


def caption(quick: bool, text: str = "") -> str:
    """The line above a table: :data:`SMOKE` first in a ``--quick`` run."""
    parts = [f"**{SMOKE}**"] if quick else []
    if text:
        parts.append(text)
    return " ".join(parts)


# ---------------------------------------------------------------- derived numbers


def add_op_ratios(results: list[dict], with_bound: bool = True) -> None:
    """For one shape's rows: the ratio to the baseline and to the best peer, and (with
    ``with_bound``, a full run) the % of the bound, the least bytes the program moves
    (``moves``, in bytes(x)) at the byte rate of the copy baseline measured in the same
    rounds."""
    ok = [r for r in results if r.get("status") == "ok"]
    copy = next((r for r in ok if r["impl"] == "copy baseline"), None)
    traffic = next((r for r in ok if r["impl"] == "traffic baseline"), None)
    for r in results:
        r.update(vs_best_peer=None, best_peer=None, pct_of_bound=None, vs_baseline=None)
        if r.get("status") != "ok":
            continue
        if with_bound and copy is not None:
            r["copy_gbs"] = copy["moves"] * r["x_bytes"] / copy["median_s"] / 1e9
            r["pct_of_bound"] = (
                100 * r["moves"] * copy["median_s"] / (copy["moves"] * r["median_s"])
            )
        base = copy if r["kind"] == "fwd" else traffic
        if base is not None:
            r["vs_baseline"] = r["median_s"] / base["median_s"]
        if r["role"] == "baseline":
            continue
        peers = [
            q
            for q in ok
            if q["role"] == "peer" and (q["group"], q["kind"]) == (r["group"], r["kind"])
        ]
        if peers:
            best = min(peers, key=lambda q: q["median_s"])
            r["best_peer"] = best["impl"]
            r["vs_best_peer"] = r["median_s"] / best["median_s"]


# ---------------------------------------------------------------- device report: markdown


def _us(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1e6:,.1f}"


def _ms(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1e3:,.2f}"


def _x(value) -> str:
    return "" if value is None else f"{value:.2f}"


def _mib(value) -> str:
    if value is None:
        return ""
    return f"{value / 2**20:,.0f}" if value >= 10 * 2**20 else f"{value / 2**20:.2f}"


def _pct(value) -> str:
    if value is None:
        return ""
    return f"{value:.0f}%" + (" †" if value > 100 else "")


def bound_note(rows: list[dict]) -> str:
    """The footnote for the "% of bound" values above 100 %, or "" where there is none."""
    above = [r for r in rows if (r.get("pct_of_bound") or 0) > 100]
    if not above:
        return ""
    sizes = ", ".join(f"{s:g}" for s in sorted({r["size_mib"] for r in above}))
    return (
        "† above 100 %: the program took less time than its least bytes at the copy's "
        "measured rate allow. The byte model counts a separate forward and backward (5 moves "
        "for a norm, as in a network); an isolated forward+backward program that takes dy as "
        "an input can read x once for both (4 moves: up to 125 %). And x of "
        f"{sizes} MiB can be served in part from the device's cache, where the copy's write "
        "stream is not."
    )


def ops_markdown(rows: list[dict], quick: bool = False) -> str:
    shapes = list(dict.fromkeys((r["size_mib"], r["features"], r["dtype"]) for r in rows))
    bound = not quick and any(r.get("pct_of_bound") for r in rows)
    out = [
        "### Summary per shape",
        "",
        caption(
            quick,
            "Ratios are to the best peer (< 1: faster)"
            + (
                "; % of bound is the least bytes the program must move at the copy rate "
                "measured in the same rounds."
                if bound
                else "."
            ),
        ),
        "",
        "| x MiB | features | dtype | copy us "
        + ("| copy GB/s " if bound else "")
        + "| rms_norm fwd / copy | rms_norm fwd+bwd vs best peer (peer) "
        + ("| fwd, fwd+bwd % of bound " if bound else "")
        + "| add_rms_norm fwd+bwd vs composition | gated_rms_norm fwd+bwd vs composition "
        "| residuals / bytes(x): ours, flax |",
        "|---:|---:|---|---:|"
        + ("---:|" if bound else "")
        + "---:|---|"
        + ("---|" if bound else "")
        + "---:|---:|---|",
    ]
    for size, f, dtype in shapes:
        at = {
            (r["impl"], r["kind"]): r
            for r in rows
            if (r["size_mib"], r["features"], r["dtype"]) == (size, f, dtype)
        }
        copy = at.get(("copy baseline", "fwd"), {})
        fwd = at.get(("rms_norm", "fwd"), {})
        fb = at.get(("rms_norm", "fwd+bwd"), {})
        add = at.get(("add_rms_norm", "fwd+bwd"), {})
        gated = at.get(("gated_rms_norm", "fwd+bwd"), {})
        flax = at.get(("flax RMSNorm", "fwd+bwd"), {})
        cells = [f"{size:g}", str(f), dtype, _us(copy.get("median_s"))]
        if bound:
            cells.append(f"{copy['copy_gbs']:,.0f}" if copy.get("copy_gbs") else "")
        cells += [
            _x(fwd.get("vs_baseline")),
            f"{_x(fb.get('vs_best_peer'))} ({fb.get('best_peer') or ''})",
        ]
        if bound:
            cells.append(f"{_pct(fwd.get('pct_of_bound'))}, {_pct(fb.get('pct_of_bound'))}")
        cells += [
            _x(add.get("vs_best_peer")),
            _x(gated.get("vs_best_peer")),
            f"{_x(fb.get('residual_x'))}, {_x(flax.get('residual_x'))}",
        ]
        out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "### Every program",
        "",
        caption(quick, "Residuals: the bytes the backward keeps (`jax.vjp`), in bytes(x)."),
        "",
        "| x MiB | features | dtype | op | implementation | median us | min-max us "
        "| vs best peer " + ("| % of bound " if bound else "") + "| vs baseline | residuals "
        "| kernels | note |",
        "|---:|---:|---|---|---|---:|---|---:|"
        + ("---:|" if bound else "")
        + "---:|---:|---:|---|",
    ]
    for r in rows:
        ok = r.get("status") == "ok"
        spread = f"{_us(r.get('min_s'))}-{_us(r.get('max_s'))}" if ok else ""
        note = r.get("note", "") if not ok else ("Pallas kernel" if r.get("uses_kernel") else "")
        if not ok:
            note = f"{r['status']}: {note}"
        residuals = _x(r.get("residual_x")) if r["kind"] == "fwd+bwd" else ""
        cells = [
            f"{r['size_mib']:g}",
            str(r["features"]),
            r["dtype"],
            r["kind"],
            r["impl"],
            _us(r.get("median_s")),
            spread,
            _x(r.get("vs_best_peer")),
        ]
        if bound:
            cells.append(_pct(r.get("pct_of_bound")))
        cells += [_x(r.get("vs_baseline")), residuals, str(len(r.get("kernels", [])) or ""), note]
        out.append("| " + " | ".join(cells) + " |")
    note = bound_note(rows) if bound else ""
    return "\n".join(out + (["", note] if note else []))


def round_spread(row: dict) -> str:
    """(largest - smallest round median) / median, as a percentage; "" without rounds."""
    medians, median = row.get("round_medians_s"), row.get("median_s")
    if not medians or not median or len(medians) < 2:
        return ""
    return f"{(max(medians) - min(medians)) / median:.1%}"


def step_markdown(rows: list[dict], quick: bool = False, reference: str = "flax RMSNorm") -> str:
    """One row per train step: time, wall time, the ratio to ``reference``, memory."""
    first = ("mode",) if any("mode" in r for r in rows) else ("model", "mlp", "dtype")
    out = [
        caption(quick),
        "",
        "| "
        + " | ".join(first)
        + f" | norm | step ms (median) | min-max ms | round spread | wall ms | vs {reference} "
        "| compiled temp MiB | device peak MiB | note |",
        "|" + "---|" * len(first) + "---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = r.get("status") == "ok" and "median_s" in r
        spread = f"{_ms(r.get('min_s'))}-{_ms(r.get('max_s'))}" if ok else ""
        peak = r.get("peak_bytes")
        peak_text = "" if peak is None else ("" if r.get("peak_is_own") else "<= ") + _mib(peak)
        note = "" if r.get("status") == "ok" else f"{r.get('status')}: {r.get('note', '')}"
        cells = [str(r.get(k, "")) for k in first] + [
            r["norm"],
            _ms(r.get("median_s")),
            spread,
            round_spread(r),
            _ms(r.get("wall_median_s")),
            _x(r.get("vs_reference")),
            _mib(r.get("temp_bytes")),
            peak_text,
            note,
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out if quick else out[2:])


_PEAK = (
    "Device peak: `peak_bytes_in_use` after the program's run in a process of its own "
    "(`python -m benchmarks.peak`; `<=` where that failed and the peak is this process's "
    "after the program's first run, in order of increasing compiled size: the program's "
    "own peak is at most that). Round spread: the largest minus the smallest round median, "
    "over the median. Wall ms: wall-clock per step in separate interleaved rounds "
    "(accelerators only)."
)


def _rounds(section: dict) -> str:
    return (
        f"{section['method']}; {section['rounds']} interleaved rounds after a warm-up round"
        + (f", {section['iterations']} iterations per round" if section.get("iterations") else "")
        + f"; run {section['date']}"
    )


def report_markdown(report: dict) -> str:
    lines = [f"# Measured on {report['device']}", "", f"{report['machine']}.", ""]
    ops = report["sections"].get("ops")
    if ops:
        lines += [
            "## Isolated ops" + (f" ({SMOKE})" if ops.get("quick") else ""),
            "",
            f"Written by `{ops['command']}` on {ops['machine']}. {_rounds(ops)}.",
            "",
            ops_markdown(ops["results"], ops.get("quick", False)),
            "",
        ]
    step = report["sections"].get("step")
    if step:
        shape = step["shape"]
        lines += [
            "## Train step" + (f" ({SMOKE})" if step.get("quick") else ""),
            "",
            f"Written by `{step['command']}` on {step['machine']}. "
            "`models.prenorm_stack_train_step`: "
            f"{shape['layers']} layers, d {shape['d']}, {shape['tokens']} tokens. "
            f"{_rounds(step)}. {_PEAK}",
            "",
            step_markdown(step["results"], step.get("quick", False)),
            "",
        ]
    gemma = report["sections"].get("gemma")
    if gemma:
        lines += [
            "## Gemma-3-style train step" + (f" ({SMOKE})" if gemma.get("quick") else ""),
            "",
            f"Written by `{gemma['command']}` on {gemma['machine']}. {gemma['model']}; "
            f"batch {gemma['batch']} x "
            f"{gemma['seq']}, loss + grad + AdamW, bfloat16 activations, float32 weights. "
            f"Each mode's norms in their own interleaved rounds. {_rounds(gemma)}. {_PEAK}",
            "",
            step_markdown(gemma["results"], gemma.get("quick", False), "gemma's own"),
            "",
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------- device report: plot


def _bars(ax, rows: list[dict], group_of, title: str, ylabel: str) -> None:
    groups = list(dict.fromkeys(group_of(r) for r in rows))
    norms = list(dict.fromkeys(r["norm"] for r in rows))
    width = 0.8 / max(1, len(norms))
    for i, norm in enumerate(norms):
        values = [
            next(
                (
                    r.get("vs_reference") or 0
                    for r in rows
                    if group_of(r) == g and r["norm"] == norm
                ),
                0,
            )
            for g in groups
        ]
        ax.bar(np.arange(len(groups)) + i * width, values, width, label=norm)
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, groups, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if ax.has_data():
        ax.legend(fontsize=6)


_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def plot(report: dict, path: Path):
    """One panel per section present; returns the figure (saved to ``path``)."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    sections = [s for s in ("ops", "step", "gemma") if s in report["sections"]]
    fig = Figure(figsize=(6.5 * max(1, len(sections)), 5), layout="constrained")
    axes = fig.subplots(1, max(1, len(sections)), squeeze=False)[0]

    def title(name: str, text: str) -> str:
        quick = report["sections"][name].get("quick")
        return text + (f"\n{SMOKE}" if quick else "")

    for ax, name in zip(axes, sections, strict=False):
        rows = report["sections"][name]["results"]
        if report["sections"][name].get("quick"):
            ax.text(
                0.5,
                0.5,
                SMOKE,
                transform=ax.transAxes,
                ha="center",
                va="center",
                fontsize=16,
                rotation=20,
                alpha=0.2,
                color="red",
            )
        if name == "ops":
            for impl in ("rms_norm", "add_rms_norm", "gated_rms_norm", "rms_norm [pallas]"):
                pts = [
                    r
                    for r in rows
                    if r["impl"] == impl and r["kind"] == "fwd+bwd" and r.get("vs_best_peer")
                ]
                if pts:
                    labels = [
                        f"{r['size_mib']:g}M {r['features']} {_SHORT.get(r['dtype'], r['dtype'])}"
                        for r in pts
                    ]
                    ax.plot(labels, [r["vs_best_peer"] for r in pts], "o-", label=impl)
            ax.axhline(1.0, color="gray", lw=1)
            ax.set_ylabel("fwd+bwd time / best peer")
            ax.tick_params(axis="x", labelrotation=90, labelsize=6)
            ax.set_title(title(name, "isolated ops"), fontsize=9)
            if ax.has_data():
                ax.legend(fontsize=7)
        elif name == "step":
            _bars(
                ax,
                rows,
                lambda r: " ".join(str(p) for p in (r.get("mlp"), r.get("dtype")) if p),
                title(name, "pre-norm train step"),
                "step time / flax RMSNorm",
            )
        else:
            _bars(
                ax,
                rows,
                lambda r: r["mode"],
                title(name, "Gemma-3-style train step"),
                "step time / gemma's own norm",
            )
    fig.suptitle(report["device"], fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig


def write_report(report: dict, out: Path, stem: str, with_plot: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    (out / f"{stem}.md").write_text(report_markdown(report))
    if with_plot:
        plot(report, out / f"{stem}.png")


# ---------------------------------------------------------------- deviceless: markdown


def estimates_header(target, command: str, quick: bool, mib: float) -> str:
    from .estimates import unit_name

    return (
        caption(quick)
        + ("\n\n" if quick else "")
        + f"Target: {target.name} ({target.devices[0].device_kind}); written by `{command}`; "
        f"estimates in {unit_name(target)} from the compiler's cost model of a deviceless "
        f"compile (not a hardware timing); x = {mib:g} MiB per shape.\n\n"
    )


def estimates_markdown(target, results: list[dict]) -> str:
    """One row per shape, dtype and implementation."""
    unit = target.estimate_unit
    fmt = (lambda v: f"{v:,.1f}") if unit == "us" else (lambda v: f"{v:,.0f}")
    lines = [
        f"| features | dtype | implementation | fwd ({unit}) | kernels | fwd / copy "
        f"| fwd+bwd ({unit}) | kernels | fwd+bwd / traffic | fwd+bwd speed-up vs flax |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        cells = [
            str(r["features"]),
            r["dtype"],
            r["impl"],
            fmt(r["fwd"]),
            str(r["fwd_kernels"]),
            f"{r['fwd_vs_baseline']:.2f}",
            fmt(r["fwd_bwd"]),
            str(r["fwd_bwd_kernels"]),
            f"{r['fwd_bwd_vs_baseline']:.2f}",
            f"{r['fwd_bwd_speedup_vs_flax']:.2f}x",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_markdown(results: list[dict]) -> str:
    """One line per shape and dtype: rms_norm (p = 1) against the baselines and peers."""
    from .peers import NORM_PEERS

    lines = [
        "| features | dtype | fwd / copy | fwd+bwd / traffic | fwd+bwd vs best peer "
        "| fwd+bwd speed-up vs flax (p=1, p=0.0625, module) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for f, dtype in dict.fromkeys((r["features"], r["dtype"]) for r in results):
        row = {r["impl"]: r for r in results if r["features"] == f and r["dtype"] == dtype}
        ours = row["rms_norm"]
        best_peer = min(row[p]["fwd_bwd"] for p in NORM_PEERS)
        speedups = ", ".join(
            f"{row[k]['fwd_bwd_speedup_vs_flax']:.2f}x"
            for k in ("rms_norm", "rms_norm p=0.0625", "RMSNorm module")
        )
        lines.append(
            f"| {f} | {dtype} | {ours['fwd_vs_baseline']:.2f} | {ours['fwd_bwd_vs_baseline']:.2f} "
            f"| {ours['fwd_bwd'] / best_peer:.2f} | {speedups} |"
        )
    return "\n".join(lines)


def _pivot_markdown(records: list[dict], column: str, head, cell) -> str:
    """A table with one row per norm and, per value of ``records[i][column]``, the two
    cells ``cell(record)`` (``"a | b"``) under the headings ``head(value)``."""
    columns = list(dict.fromkeys(r[column] for r in records))
    norms = list(dict.fromkeys(r["norm"] for r in records))
    by_key = {(r[column], r["norm"]): r for r in records}
    lines = [
        "| norm | " + " | ".join(head(c) for c in columns) + " |",
        "|---|" + "---:|---:|" * len(columns),
    ]
    for norm in norms:
        cells = " | ".join(cell(by_key[(c, norm)]) for c in columns)
        lines.append(f"| {norm} | {cells} |")
    return "\n".join(lines)


def memory_markdown(memory: list[dict]) -> str:
    """One row per norm, one column per MLP: MiB per device and the ratio to flax's."""

    def cell(r):
        note = "" if r["fits"] else " (does not fit)"
        return f"{r['temp_bytes'] / 2**20:,.0f}{note} | {_x(r['vs_flax'])}"

    return _pivot_markdown(memory, "mlp", lambda m: f"{m} MLP: MiB | vs flax", cell)


def kernels_markdown(target, memory: list[dict]) -> str:
    """Per MLP and norm: the kernels of the compiled step, matmuls apart from the rest."""
    unit = target.estimate_unit
    fmt = (lambda v: f"{v:,.1f}") if unit == "us" else (lambda v: f"{v:,.0f}")
    lines = [
        f"| mlp | norm | kernels | matmul kernels (estimate, {unit}) "
        f"| other kernels (estimate, {unit}) | temp MiB | costliest other kernels |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in memory:
        if not r["fits"]:
            lines.append(f"| {r['mlp']} | {r['norm']} | | | | does not fit | |")
            continue
        costliest = ", ".join(f"{name} {fmt(est)}" for name, est in r["costliest_other"][:3])
        lines.append(
            f"| {r['mlp']} | {r['norm']} | {r['kernels']} "
            f"| {r['matmul_kernels']} ({fmt(r['matmul_estimate'])}) "
            f"| {r['other_kernels']} ({fmt(r['other_estimate'])}) "
            f"| {r['temp_bytes'] / 2**20:,.0f} | {costliest} |"
        )
    return "\n".join(lines)


def cost_markdown(target, cost: list[dict]) -> str:
    """One row per norm, one column pair per dtype: the step estimate and its excess."""
    return _pivot_markdown(
        cost,
        "dtype",
        lambda dt: f"{dt} step ({target.estimate_unit}) | minus rms_norm's",
        lambda r: f"{r['step']:,.0f} | {r['minus_ours']:+,.0f}",
    )


def step_tables(target, memory: list[dict], cost: list[dict], shapes: dict) -> str:
    """The train-step part of ``<target>.md`` and ``-summary.md``."""
    mem, cst = shapes["memory"], shapes["cost"]
    return (
        f"Train step ({mem['layers']} pre-norm blocks of two norms each, a linear token mixer "
        "and an MLP: relu or gelu with 4x hidden units, or LLaMA's SwiGLU with 8/3x; "
        f"bfloat16, lax.scan over layers, d = {mem['d']}, {mem['tokens']} tokens): temporary "
        "memory per device from the compiled program. `x * scale (floor)` is not a norm: it "
        "keeps what any norm with a learnable scale followed by a matmul must keep (x for the "
        "scale's gradient), so no norm can go below it.\n\n"
        + memory_markdown(memory)
        + "\n\nThe same steps' kernels: a matmul kernel holds a dot or a convolution (or calls "
        "cuBLAS or cuDNN); a loop body counts once.\n\n"
        + kernels_markdown(target, memory)
        + "\n\nA whole train step, the compiler's estimate (pre-norm blocks with a SwiGLU "
        f"MLP: {cst['layers']}, scan unrolled, d = {cst['d']}, "
        f"{cst['tokens']} tokens): here y feeds a matmul and dy comes back through it, so, "
        "unlike in the isolated forward+backward programs above, XLA cannot compute y inside "
        "the backward's reduction kernel.\n\n" + cost_markdown(target, cost) + "\n"
    )


def fused_markdown(target, results: list[dict], header: str) -> str:
    unit = target.estimate_unit
    lines = [
        header.rstrip()
        + " Fused ops against hand-written flax compositions (`flax.linen.RMSNorm`).\n",
        f"| features | dtype | implementation | fwd+bwd ({unit}, estimate) | vs composition "
        "| residuals / bytes(x) |",
        "|---:|---|---|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['features']} | {r['dtype']} | {r['impl']} | {r['fwd_bwd']:,.2f} "
            f"| {r['vs_composition']:.2f} | {r['residual_x']:.2f} |"
        )
    return "\n".join(lines)


def gemma_header(target, cfg, batch: int, seq: int, command: str, quick: bool) -> str:
    from .estimates import unit_name

    return (
        caption(quick)
        + ("\n\n" if quick else "")
        + f"Target: {target.name} ({target.devices[0].device_kind}); written by `{command}`. "
        f"Gemma-3-style train step (`benchmarks/models.py`: {cfg.layers} blocks, d {cfg.d}, "
        f"{cfg.heads} query heads / {cfg.kv_heads} KV head of {cfg.head_dim}, MLP "
        f"{cfg.hidden}, vocab {cfg.vocab:,}, window {cfg.window}), batch {batch} x {seq}, "
        "loss + grad + AdamW, bfloat16 activations, float32 weights, one device. "
        "Every number is from a deviceless compile: temp memory from the compiled program, "
        f"estimates in {unit_name(target)} from the compiler's cost model (not a hardware "
        "timing). Under `scan` a loop body counts once in the estimates and kernels.\n\n"
    )


def add_ratios(records: list[dict], baseline: str, group: tuple[str, ...], suffix: str) -> None:
    """Adds each record's ratios to the ``baseline`` norm's record of the same ``group``
    (e.g. the same mode): ``<key>_vs_<suffix>`` for temp memory and the estimates,
    ``kernels_minus_<suffix>`` for the kernel count."""
    for r in records:
        base = next(
            (b for b in records if b["norm"] == baseline and all(b[k] == r[k] for k in group)),
            None,
        )
        if base is None:
            continue
        for key in ("temp_bytes", "step", "non_matmul"):
            if r.get(key) is not None and base.get(key):
                r[f"{key}_vs_{suffix}"] = r[key] / base[key]
        if r.get("kernels") is not None and base.get("kernels") is not None:
            r[f"kernels_minus_{suffix}"] = r["kernels"] - base["kernels"]


def gemma_relative(records: list[dict]) -> None:
    """Adds each record's ratios to ``gemma's own`` norm in the same mode."""
    add_ratios(records, "gemma's own", ("mode",), "gemma")


def gemma_markdown(target, records: list[dict]) -> str:
    unit = target.estimate_unit

    def ratio(r: dict, key: str) -> str:
        value = r.get(f"{key}_vs_gemma")
        return "" if value is None else f"{value:.3f}"

    lines = [
        f"| mode | norm | temp MiB | vs gemma's | kernels | minus gemma's | step ({unit}) "
        f"| vs gemma's | non-matmul ({unit}) | vs gemma's |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = (lambda v: f"{v:,.0f}") if unit == "cycles" else (lambda v: f"{v:,.1f}")
    for r in records:
        temp = f"{r['temp_bytes'] / 2**20:,.0f}" + ("" if r["fits"] else " (does not fit)")
        cells = [r["mode"], r["norm"], temp, ratio(r, "temp_bytes")]
        if r["fits"]:
            cells += [
                str(r["kernels"]),
                f"{r.get('kernels_minus_gemma', 0):+d}",
                fmt(r["step"]),
                ratio(r, "step"),
                fmt(r["non_matmul"]),
                ratio(r, "non_matmul"),
            ]
        else:
            cells += ["", "", "", "", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def maxtext_header(
    target, cfg, batch: int, seq: int, command: str, quick: bool, jax_version: str
) -> str:
    from .estimates import unit_name

    return (
        caption(quick)
        + ("\n\n" if quick else "")
        + f"Target: {target.name} ({target.devices[0].device_kind}), jax {jax_version}; "
        f"written by `{command}`. MaxText-shaped Llama2-style train step "
        f"(`benchmarks/models.py`: {cfg.layers} layers, d {cfg.d}, {cfg.heads} heads of "
        f"{cfg.head_dim}, MLP {cfg.hidden}, vocab {cfg.vocab:,}), batch {batch} x {seq}, "
        "loss + grad + AdamW, bfloat16 activations, float32 weights, one device. "
        "`maxtext's own`: MaxText's `RMSNorm` (x_hat rounded to bfloat16, then times the "
        "scale in bfloat16); `rms_norm`: ours on the same parameter (float32, one rounding). "
        "Every number is from a deviceless compile: temp memory from the compiled program, "
        f"estimates in {unit_name(target)} from the compiler's cost model (not a hardware "
        "timing). Under `scan` a loop body counts once in the estimates and kernels.\n\n"
    )


def maxtext_relative(records: list[dict]) -> None:
    """Adds each record's ratios to MaxText's own norm in the same mode and remat policy."""
    add_ratios(records, "maxtext's own", ("mode", "remat"), "maxtext")


def maxtext_markdown(target, records: list[dict]) -> str:
    """Ours over MaxText's per (layers, remat), then every record."""
    unit = target.estimate_unit
    ours = [r for r in records if r["norm"] == "rms_norm" and "temp_bytes_vs_maxtext" in r]

    def ratio(r: dict, key: str) -> str:
        value = r.get(f"{key}_vs_maxtext")
        return "" if value is None else f"{value:.3f}"

    lines = [
        "Ours over MaxText's norm (below 1: ours needs less):\n",
        "| layers | remat | temp memory | whole-step estimate | non-matmul estimate "
        "| kernels, ours minus MaxText's |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in ours:
        kernels = r.get("kernels_minus_maxtext")
        lines.append(
            f"| {r['mode']} | {r['remat']} | {ratio(r, 'temp_bytes')} | {ratio(r, 'step')} "
            f"| {ratio(r, 'non_matmul')} | {'' if kernels is None else f'{kernels:+d}'} |"
        )
    lines += [
        "",
        "Every compiled program:\n",
        f"| layers | remat | norm | temp MiB | kernels (matmuls) | step ({unit}) "
        f"| non-matmul ({unit}) | compile s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    fmt = (lambda v: f"{v:,.0f}") if unit == "cycles" else (lambda v: f"{v:,.1f}")
    for r in records:
        temp = f"{r['temp_bytes'] / 2**20:,.1f}" + ("" if r["fits"] else " (does not fit)")
        cells = [r["mode"], r["remat"], r["norm"], temp]
        if r["fits"]:
            cells += [
                f"{r['kernels']} ({r['matmul_kernels']})",
                fmt(r["step"]),
                fmt(r["non_matmul"]),
            ]
        else:
            cells += ["", "", ""]
        cells.append(f"{r['compile_s']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
